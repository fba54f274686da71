"""Which weights a model service computes with (ModelInfo.weights_fingerprint), whatever the
path they were loaded from: the coordinator's pools compare it, not the --model string, so
two replicas of one pool serve one checkpoint (coordinator.identity.IDENTITY).

The fingerprint covers what is served, after the loader changed it: an int8 layer's int8
weights and scales, a draft's output head cut to fewer rows, under tensor parallelism this
rank's shard. Each tensor counts by its name, shape and dtype, an exact sum of all its bytes
(so one weight changed anywhere changes it) and a sample of them (so do rows moved about): a
full cryptographic hash of a 1.5B float32 model's 6 GB would cost seconds at start-up.

An EAGLE head is made for a checkpoint, not for one way of serving it: `checkpoint_fingerprint`
covers a folder's tensors as stored, so the same checkpoint served in bf16, in int8 or on
another device keeps it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from accelerate.hooks import AlignDevicesHook
from accelerate.utils import align_module_device, has_offloaded_params

logger = logging.getLogger(__name__)

# Bytes of each tensor hashed as they are: all of a smaller tensor's, SAMPLE_CHUNKS evenly
# spaced runs (the first and the last among them) of a larger one's.
SAMPLE_BYTES = 1 << 20
SAMPLE_CHUNKS = 16
# Bytes of each stored tensor a checkpoint fingerprint reads: SAMPLE_CHUNKS evenly spaced runs,
# 22 MB over the 1.5B target's 339 tensors, where reading them all would be its 6 GB.
CHECKPOINT_SAMPLE_BYTES = 1 << 16
# Config keys that name where or with what the model was loaded, not what it computes.
UNSERVED_CONFIG_KEYS = ("transformers_version",)


@dataclass(frozen=True)
class ServedWeights:
    """What a model service computes with, as ModelInfo reports it for the pools to compare."""

    fingerprint: str  # weights_fingerprint
    device_kind: str


def served_weights(model: torch.nn.Module) -> ServedWeights:
    """The model's weights as they are now: call it once the loader has done changing them."""
    start = time.perf_counter()
    with torch.no_grad():
        weights = ServedWeights(weights_fingerprint(model), device_kind(model))
    logger.info(
        "weights fingerprint %s on %s (%.0f ms)",
        weights.fingerprint[:16],
        weights.device_kind,
        (time.perf_counter() - start) * 1e3,
    )
    return weights


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over the model's config and every tensor it serves, in hex."""
    digest = hashlib.sha256(config_json(model).encode())
    for name, tensor_bytes in served_tensor_digests(model):
        digest.update(name.encode() + b"\0" + tensor_bytes)
    return digest.hexdigest()


def config_json(model: torch.nn.Module) -> str:
    """The model's config as JSON with sorted keys, less its private keys (the path it was
    read from among them) and UNSERVED_CONFIG_KEYS."""
    config = getattr(model, "config", None)
    if config is None:
        return "{}"
    served = {
        key: value
        for key, value in config.to_dict().items()
        if not key.startswith("_") and key not in UNSERVED_CONFIG_KEYS
    }
    return json.dumps(served, sort_keys=True, default=str)


def served_tensor_digests(model: torch.nn.Module) -> Iterator[tuple[str, bytes]]:
    """(name, digest) of each state_dict entry, then of each packed weight (a module's
    `weight_digest`, such as specdec.engine.quantize.RowwiseInt8Linear's), in module order.
    A tensor under two names (tied embeddings) is read once."""
    by_storage: dict[tuple[int, int, torch.dtype, tuple[int, ...]], bytes] = {}
    for name, tensor, resident in _served_state(model):
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype, tuple(tensor.shape))
        if not resident:  # a copy, freed after: another may take its address
            yield name, tensor_digest(tensor)
            continue
        if key not in by_storage:
            by_storage[key] = tensor_digest(tensor)
        yield name, by_storage[key]
    for name, module in model.named_modules():
        packed = getattr(module, "weight_digest", None)
        if isinstance(packed, bytes):
            yield f"{name}.weight_digest", packed


def _served_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, resident) for each state_dict entry as it computes: a DTensor's shard
    (tensor parallelism); a weight accelerate offloaded (--device auto; on the meta device and
    brought in by a hook at each pass) brought in the same way, one module at a time."""
    onloaded: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if not tensor.is_meta:
            yield name, _local(tensor), True
            continue
        if name not in onloaded:
            onloaded = _onload(model, name)
        yield name, onloaded.pop(name), False


def _onload(model: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    """The state, on the CPU, of the offloaded module holding state_dict entry `name`."""
    parts = name.split(".")
    for end in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:end])
        module = model.get_submodule(prefix)
        if has_offloaded_params(module):
            with align_module_device(module, torch.device("cpu")):
                return {".".join(filter(None, (prefix, key))): value for key, value in module.state_dict().items()}
    raise ValueError(f"weight {name} is on the meta device and no accelerate hook brings it in: was the model loaded?")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (tensor parallelism); any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """SHA-256 over the tensor's shape, dtype, the wrapping sum of its bytes read as int64
    words (exact, so the same on any device and in any order of summing) and a sample of its
    bytes (`sampled_runs`)."""
    flat = raw_bytes(tensor)  # [nbytes] uint8, on the tensor's device
    whole = flat.numel() // 8 * 8
    words = flat[:whole].view(torch.int64)  # [nbytes // 8]
    word_sum = int(words.sum()) if whole else 0
    digest = hashlib.sha256(f"{tuple(tensor.shape)} {tensor.dtype} {word_sum}".encode())
    for run in [*sampled_runs(flat), flat[whole:]]:  # and the bytes past the last whole word
        digest.update(run.cpu().numpy().data)  # a CPU tensor's own memory: no copy
    return digest.digest()


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:  # [...] any dtype → [nbytes] uint8
    flat = tensor.detach().reshape(-1)
    if flat.storage_offset() * flat.element_size() % 8:  # an int64 view needs aligned storage
        flat = flat.clone()
    return flat.view(torch.uint8) if flat.dtype is not torch.uint8 else flat


def sampled_runs(flat: torch.Tensor) -> list[torch.Tensor]:  # [nbytes] uint8 → views, SAMPLE_BYTES at most
    return [flat[start : start + size] for start, size in sample_spans(flat.numel(), SAMPLE_BYTES)]


def sample_spans(nbytes: int, sample_bytes: int) -> list[tuple[int, int]]:
    """(offset, size) of the bytes hashed of `nbytes`: all of them up to `sample_bytes`, else
    SAMPLE_CHUNKS evenly spaced runs (the first and the last among them) of that much in all."""
    if nbytes <= sample_bytes:
        return [(0, nbytes)]
    run = sample_bytes // SAMPLE_CHUNKS
    return [(start, run) for start in torch.linspace(0, nbytes - run, SAMPLE_CHUNKS).long().tolist()]


def device_kind(model: torch.nn.Module) -> str:
    """The kinds of device the weights compute on, e.g. "cpu", "cuda", or "cpu+cuda" (a device
    map over both): another kind computes other logits from the same weights. An offloaded
    weight computes where its hook brings it."""
    kinds = {tensor.device.type for tensor in model.state_dict().values() if not tensor.is_meta}
    for module in model.modules():
        if has_offloaded_params(module):
            hook = cast(AlignDevicesHook, module._hf_hook)
            kinds.add(torch.device(hook.execution_device).type)
    return "+".join(sorted(kinds))


def checkpoint_fingerprint(folder: str | Path) -> str:
    """Which checkpoint a folder stores, whatever serves it (dtype, quantisation, device, tensor
    parallelism): SHA-256 in hex over the tensors transformers loads from it (`_weight_files`)
    in name order, each by name, stored dtype, shape and CHECKPOINT_SAMPLE_BYTES of its stored
    bytes in evenly spaced runs (the first and the last among them), so sharding the files
    otherwise keeps it and any fine-tune, which moves nearly every weight, changes it. A copy
    saved in another dtype is another checkpoint. "" where there is nothing to compare: no
    safetensors weights (a hub id, a pytorch_model.bin), or files it cannot read (logged)."""
    tensors: dict[str, bytes] = {}
    for path, names in _weight_files(Path(folder)).items():
        try:
            tensors |= _stored_digests(path, names)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            logger.warning("no checkpoint fingerprint: %s is not a safetensors file it can read (%s)", path, exc)
            return ""
    if not tensors:
        return ""
    whole = hashlib.sha256()
    for name in sorted(tensors):
        whole.update(tensors[name])
    return whole.hexdigest()


def _weight_files(folder: Path) -> dict[Path, set[str] | None]:
    """The safetensors files transformers loads from `folder`, each with the tensor names it
    takes there (None: all): the index's weight map where the weights are sharded, else
    model.safetensors alone. Other files (a consolidated.safetensors beside them, shards an
    earlier save left) are not the checkpoint."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("no checkpoint fingerprint: %s is not a weights index it can read (%s)", index, exc)
            return {}
        files: dict[Path, set[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(folder / file, set()).add(name)  # type: ignore[union-attr]
        return files
    single = folder / "model.safetensors"
    return {single: None} if single.is_file() else {}


def _stored_digests(path: Path, names: set[str] | None) -> dict[str, bytes]:
    """Per tensor of a safetensors file (those of `names`; None: all), the digest
    `checkpoint_fingerprint` combines. ValueError for a header that is not one."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if not 2 <= length <= size - 8:
            raise ValueError(f"a header of {length} bytes in a file of {size}")
        header = json.loads(handle.read(length))
        digests = {}
        for name, entry in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            start, end = entry["data_offsets"]
            digest = hashlib.sha256(f"{name} {entry['dtype']} {entry['shape']} {end - start}".encode())
            for offset, run in sample_spans(end - start, CHECKPOINT_SAMPLE_BYTES):
                handle.seek(8 + length + start + offset)
                digest.update(handle.read(run))
            digests[name] = digest.digest()
        return digests
