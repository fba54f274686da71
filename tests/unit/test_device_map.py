"""Device-map sharding (`--device auto`), on a CPU-only host.

`--device auto` must load and serve where there is no GPU (accelerate then keeps every
layer on the CPU). To exercise a real split, the second test dispatches the model with
accelerate over two placements, layer 1's weights offloaded to disk and brought in by
accelerate's hooks at every forward pass: the same hook path that moves activations from one
GPU to the next under `--device auto`. Verification through it (lone, batched, rolled
back) must give what the plain model gives, and the KV cache must stay with its layer.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoModelForCausalLM

from specdec.engine.modeling import load_causal_lm
from specdec.sampling.probs import SamplingParams
from target_service.runner import TargetRunner, VerifyCall

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=0, top_p=1.0)


def make_runner(loaded) -> TargetRunner:
    return TargetRunner(loaded, max_sessions=8, session_ttl_s=60, max_speculative_tokens=8)


def rounds(runner: TargetRunner) -> list:
    """Two sessions: a prefill, a batched round, a rolled-back round; sampled and greedy."""
    vocab = runner.loaded.vocab_size
    probs = torch.softmax(torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)), dim=-1)  # [3, V]
    empty = torch.zeros(0, vocab)
    results = [
        runner.verify_one(
            VerifyCall("a", 0, [5, 6, 7, 8, 9, 10], [11, 12, 13], probs, SAMPLED, 3, return_distributions=True)
        ),
        runner.verify_one(VerifyCall("b", 0, [20, 21, 22], [23], empty, GREEDY, 0)),
        *runner.verify_batch(
            [
                VerifyCall(
                    "a", 7, [14], [15, 16, 17], probs, SAMPLED, 4, return_distributions=True
                ),  # two drafts rolled back
                VerifyCall("b", 4, [24, 25], [26, 27], empty, GREEDY, 0),
            ]
        ),
    ]
    return results


def same(left: list, right: list) -> None:
    for mine, theirs in zip(left, right, strict=True):
        assert mine.recovered_token_ids == theirs.recovered_token_ids
        assert mine.bonus_token_id == theirs.bonus_token_id
        assert mine.sequence_length == theirs.sequence_length
        torch.testing.assert_close(
            torch.tensor(mine.draft_token_target_probs), torch.tensor(theirs.draft_token_target_probs)
        )
        if mine.target_probs is not None:
            torch.testing.assert_close(mine.target_probs, theirs.target_probs, atol=1e-6, rtol=1e-5)


def test_device_map_auto_loads_and_verifies_like_the_plain_model_on_a_cpu_only_host(tiny_pair):
    plain = make_runner(load_causal_lm(str(tiny_pair.target), "float32", "cpu"))
    mapped = make_runner(load_causal_lm(str(tiny_pair.target), "float32", "cpu", device_map="auto"))
    assert mapped.describe().device == "auto" and mapped.loaded.device == "cpu"
    same(rounds(mapped), rounds(plain))


def test_a_model_split_by_accelerate_over_two_placements_verifies_like_the_plain_model(tiny_pair, tmp_path):
    loaded = load_causal_lm(str(tiny_pair.target), "float32", "cpu")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    model = AutoModelForCausalLM.from_pretrained(
        tiny_pair.target, dtype=torch.float32, device_map=device_map, offload_folder=str(tmp_path / "offload")
    ).eval()
    assert model.hf_device_map == device_map
    assert model.model.layers[1].self_attn.q_proj.weight.device.type == "meta", "layer 1 was not offloaded"
    assert hasattr(model.model.layers[1], "_hf_hook"), "accelerate did not dispatch the model"
    split = make_runner(dataclasses.replace(loaded, model=model, device_label="split"))

    plain = make_runner(loaded)
    same(rounds(split), rounds(plain))
    # Layer 1's weights, brought in from disk, count as they compute: one model, on the CPU.
    assert split.weights == plain.weights and split.weights.device_kind == "cpu"
    # The cache follows its layer: every layer's keys sit where accelerate runs that layer.
    for layer in split.sessions.open("a", 1).cache.layers:
        assert layer.keys.device.type == "cpu"
    assert split.sessions.open("a", 1).cached_tokens == 11  # 6 + 3 drafts, then 7 kept + 1 + 3 drafts
