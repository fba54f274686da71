"""What crosses between the host and the model's device. On an accelerator each crossing to the
host waits for the work queued before it (the pass), so a call's outputs cross together, once;
and a host input goes through pinned memory without waiting."""

from __future__ import annotations

import torch

ALIGN = 8  # bytes: each packed tensor starts where any dtype's view of it may start


def fetch(*tensors: torch.Tensor) -> list[list[float]]:
    """Small tensors of one device as Python numbers, in one transfer: on an accelerator one
    wait for the queued work instead of one per `.item()`. Each comes back flattened, as
    float64, which holds every float32 and every id below 2**53 exactly."""
    flat = [tensor.reshape(-1).double() for tensor in tensors]
    values = torch.cat(flat).tolist()
    out, start = [], 0
    for tensor in flat:
        out.append(values[start : start + tensor.numel()])
        start += tensor.numel()
    return out


def fetch_tensors(**tensors: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Tensors of one device on the host in one transfer, by name, each with its dtype and shape
    (a None is left out): their bytes packed into one buffer, each at an 8-byte boundary, copied
    once and viewed back. Unlike `fetch`, for any size and dtype (a [K + 1, V] row block,
    bfloat16 features, booleans)."""
    present = {name: tensor.detach().contiguous() for name, tensor in tensors.items() if tensor is not None}
    if not present:
        return {}
    device = next(iter(present.values())).device  # another's (a model split over devices) is copied there first
    parts, spans, offset = [], [], 0
    for tensor in present.values():
        raw = tensor.reshape(-1).view(torch.uint8)  # [bytes]
        raw = raw if raw.device == device else raw.to(device)
        pad = -raw.numel() % ALIGN
        parts += [raw, raw.new_zeros(pad)] if pad else [raw]
        spans.append((offset, raw.numel(), tensor.dtype, tensor.shape))
        offset += raw.numel() + pad
    host = torch.cat(parts).cpu()  # the one crossing
    views = (host[start : start + size].view(dtype).view(shape) for start, size, dtype, shape in spans)
    return dict(zip(present, views))


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`. To CUDA through pinned memory and without waiting: a copy
    from pageable memory waits for the work queued before it (the pass), each one a wait."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
