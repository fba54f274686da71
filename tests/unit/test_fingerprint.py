"""The weights fingerprint (specdec.engine.fingerprint, ModelInfo.weights_fingerprint): the
same for the same weights however often and from whatever path they are loaded, another when
one weight changes or when what is served differs (dtype, int8, a cut output head)."""

from __future__ import annotations

import shutil

import torch

from specdec.engine.fingerprint import SAMPLE_BYTES, raw_bytes, sampled_runs, tensor_digest, weights_fingerprint
from specdec.engine.modeling import load_causal_lm, restrict_output_head
from specdec.engine.quantize import quantize_int8
from specdec.rpc import wire
from specdec.tools.testing import build_model, word_tokenizer


def build(folder, seed: int = 0):
    return build_model(folder, word_tokenizer(12), seed=seed, logit_scale=1.0, eos_token_id=None)


def fingerprint(folder, dtype: str = "float32") -> str:
    return weights_fingerprint(load_causal_lm(str(folder), dtype, "cpu").model)


def test_the_same_weights_have_one_fingerprint_from_any_path(tmp_path):
    build(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")
    first = fingerprint(tmp_path / "a")
    assert fingerprint(tmp_path / "a") == first  # loaded twice
    assert fingerprint(tmp_path / "elsewhere") == first  # the config's path is no part of it


def test_one_weight_changed_changes_the_fingerprint(tmp_path):
    model = build(tmp_path / "a")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    model.save_pretrained(tmp_path / "b")
    word_tokenizer(12).save_pretrained(tmp_path / "b")
    assert fingerprint(tmp_path / "b") != fingerprint(tmp_path / "a")


def test_a_large_tensor_counts_every_byte_and_where_its_sampled_bytes_sit():
    """Beyond SAMPLE_BYTES a tensor's bytes are hashed in samples; the exact sum of all of them
    catches a weight changed between the samples, and the samples catch rows moved about."""
    tensor = torch.randn(4, SAMPLE_BYTES // 4)  # [4, N] float32: 4 MiB, sampled
    changed = tensor.clone()
    # Byte SAMPLE_BYTES / 8: past the first sample (the first 1/16 of SAMPLE_BYTES), before the
    # second (at about a fifteenth of the tensor's 4 * SAMPLE_BYTES).
    changed[0, SAMPLE_BYTES // 32] += 1.0
    assert sampled(changed) == sampled(tensor)
    assert tensor_digest(changed) != tensor_digest(tensor)
    swapped = tensor[[3, 1, 2, 0]]  # the first and last rows, both sampled, change places
    assert tensor_digest(swapped) != tensor_digest(tensor)
    assert tensor_digest(tensor.clone()) == tensor_digest(tensor)


def test_the_fingerprint_is_of_what_is_served(tmp_path):
    build(tmp_path / "a")
    float32 = fingerprint(tmp_path / "a")
    assert fingerprint(tmp_path / "a", "bfloat16") != float32
    quantised = [quantize_int8(load_causal_lm(str(tmp_path / "a"), "float32", "cpu").model) for _ in range(2)]
    assert weights_fingerprint(quantised[0]) == weights_fingerprint(quantised[1]) != float32
    cut = load_causal_lm(str(tmp_path / "a"), "float32", "cpu").model
    restrict_output_head(cut, torch.arange(8))  # a draft's head cut to 8 ids (--draft-vocab)
    assert weights_fingerprint(cut) != float32


def sampled(tensor: torch.Tensor) -> bytes:
    return b"".join(run.numpy().tobytes() for run in sampled_runs(raw_bytes(tensor)))


def test_info_reports_the_runners_weights(target_runner):
    info = wire.description_to_pb(target_runner.describe())
    assert info.weights_fingerprint == weights_fingerprint(target_runner.model)
    assert len(info.weights_fingerprint) == 64 and info.device_kind == "cpu"
