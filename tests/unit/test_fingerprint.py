"""The weights fingerprint (specdec.engine.fingerprint, ModelInfo.weights_fingerprint): the
same for the same weights however often and from whatever path they are loaded, another when
one weight changes or when what is served differs (dtype, int8, a cut output head)."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from specdec.engine.fingerprint import (
    CHECKPOINT_SAMPLE_BYTES,
    SAMPLE_BYTES,
    checkpoint_fingerprint,
    raw_bytes,
    sampled_runs,
    tensor_digest,
    weights_fingerprint,
)
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


def test_info_reports_the_runners_weights(target_runner, tiny_pair):
    info = wire.description_to_pb(target_runner.describe())
    assert info.weights_fingerprint == weights_fingerprint(target_runner.model)
    assert len(info.weights_fingerprint) == 64 and info.device_kind == "cpu"
    assert info.checkpoint_fingerprint == checkpoint_fingerprint(tiny_pair.target)


def test_a_checkpoint_keeps_its_fingerprint_however_it_is_served_or_sharded(tmp_path):
    """checkpoint_fingerprint reads the folder's tensors as stored: served in bf16 or int8 the
    checkpoint is the one an EAGLE head was trained on; split into other files, too."""
    build(tmp_path / "a")
    stored = checkpoint_fingerprint(tmp_path / "a")
    assert len(stored) == 64
    assert fingerprint(tmp_path / "a") != fingerprint(tmp_path / "a", "bfloat16")  # served otherwise...
    served = [load_causal_lm(str(tmp_path / "a"), dtype, "cpu") for dtype in ("float32", "bfloat16")]
    assert {loaded.checkpoint_fingerprint for loaded in served} == {stored}  # ...one checkpoint
    state = load_file(str(tmp_path / "a" / "model.safetensors"))
    names = sorted(state)
    shutil.copytree(tmp_path / "a", tmp_path / "sharded")
    (tmp_path / "sharded" / "model.safetensors").unlink()
    shards = {"model-1.safetensors": names[::2], "model-2.safetensors": names[1::2]}
    for file, held in shards.items():
        save_file({name: state[name] for name in held}, str(tmp_path / "sharded" / file))
    weight_map = {name: file for file, held in shards.items() for name in held}
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_causal_lm(str(tmp_path / "sharded"), "float32", "cpu").checkpoint_fingerprint == stored
    # Files transformers does not load are no part of it: another format's copy beside the
    # weights, a shard an earlier save left, which the index does not name.
    save_file({name: tensor * 2 for name, tensor in state.items()}, str(tmp_path / "a" / "consolidated.safetensors"))
    save_file({names[0]: state[names[0]] * 2}, str(tmp_path / "sharded" / "model-3.safetensors"))
    assert checkpoint_fingerprint(tmp_path / "a") == checkpoint_fingerprint(tmp_path / "sharded") == stored
    assert checkpoint_fingerprint(tmp_path / "no-such-folder") == ""


def test_weights_it_cannot_read_give_no_fingerprint_and_stop_nothing(tmp_path, caplog):
    """A file that is not safetensors where the weights should be (a Git LFS pointer, a
    truncated download) is logged and leaves nothing to compare; the fingerprint never stops a
    service that loaded."""
    (tmp_path / "lfs").mkdir()
    (tmp_path / "lfs" / "model.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "model.safetensors.index.json").write_text("{")
    assert checkpoint_fingerprint(tmp_path / "lfs") == checkpoint_fingerprint(tmp_path / "index") == ""
    assert "lfs/model.safetensors is not a safetensors file" in caplog.text
    assert "is not a weights index" in caplog.text


def test_another_checkpoint_has_another_fingerprint(tmp_path):
    """A weight changed in a sampled run of a tensor read in samples, the same weights stored in
    another dtype, and a fine-tune's small change to every weight each make another checkpoint."""
    build(tmp_path / "a")
    state = load_file(str(tmp_path / "a" / "model.safetensors"))
    state["extra.weight"] = torch.randn(4, CHECKPOINT_SAMPLE_BYTES // 4)  # [4, N] float32: read in samples
    save_file(state, str(tmp_path / "a" / "model.safetensors"))
    stored = checkpoint_fingerprint(tmp_path / "a")
    changed = state["extra.weight"].clone()
    changed[3, -1] += 1.0  # the last byte run is sampled
    variants = {
        "one weight": state | {"extra.weight": changed},
        "bfloat16": {name: tensor.to(torch.bfloat16) for name, tensor in state.items()},
        "fine-tuned": {name: tensor * 1.001 for name, tensor in state.items()},
    }
    for what, variant in variants.items():
        folder = tmp_path / what
        shutil.copytree(tmp_path / "a", folder)
        save_file(variant, str(folder / "model.safetensors"))
        assert checkpoint_fingerprint(folder) != stored, what
