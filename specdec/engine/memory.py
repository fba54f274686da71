"""How much memory a model service's KV takes: `--max-kv-bytes` as a size, or as a share of
the memory left when the service starts (`90%`), and the pool that budget needs.

A share is measured once, after the weights are loaded and before the pool is allocated: on
CUDA the device's free memory (`torch.cuda.mem_get_info`), on CPU the memory the kernel says
is available (MemAvailable). The CUDA graphs of static passes (specdec.engine.static_pass) are
captured after the pool, so a share near 100% leaves them, and each pass's activations, no
room: a bucket whose capture fails runs eager, with a warning. Under tensor parallelism every
rank takes the smallest rank's memory: admission and eviction must be the same on each.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specdec.engine.kv_pool import PAGE_TOKENS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryShare:
    """`--max-kv-bytes 90%`: that share of the memory left when the service starts."""

    fraction: float  # (0, 1]

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"a share of memory is more than 0% and at most 100%; got {self}")

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%"


def available_bytes(device: str) -> int:
    """Memory not in use now: the device's free memory (CUDA), or MemAvailable (CPU)."""
    if not device.startswith("cpu"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def first_pages_bytes(bytes_per_token: int, max_sessions: int) -> int:
    """The page every session's extent starts with."""
    return max_sessions * PAGE_TOKENS * bytes_per_token


def kv_budget(
    setting: int | MemoryShare, bytes_per_token: int, max_sessions: int, device: str, prefix_bytes: int = 0
) -> int:
    """--max-kv-bytes in bytes of entries sessions may hold (SessionStore's budget; 0: none).
    A share becomes that share of `available_bytes` (the least of the ranks' under tensor
    parallelism: every rank calls this once as it loads), less the sessions' first pages, so
    that the pool `pool_bytes` sizes for it takes the share on CUDA. The prefix cache's bytes
    (`prefix_bytes`) count in the budget, so they may not exceed it (a size's config checks)."""
    if not isinstance(setting, MemoryShare):
        return setting
    available = available_bytes(device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        least = torch.tensor([available], dtype=torch.int64, device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        available = int(least.item())
    budget = int(setting.fraction * available) - first_pages_bytes(bytes_per_token, max_sessions)
    if prefix_bytes and prefix_bytes > budget:
        raise ValueError(
            f"--prefix-cache-bytes ({prefix_bytes}) is counted in --max-kv-bytes ({setting} of the "
            f"{available / 2**30:.2f} GiB available on {device}: {max(budget, 0)} bytes) and cannot exceed it"
        )
    tokens = budget // max(bytes_per_token, 1)
    if tokens < PAGE_TOKENS:
        raise ValueError(
            f"--max-kv-bytes {setting} of the {available / 2**30:.2f} GiB available on {device} leaves room for "
            f"{max(tokens, 0)} tokens beside a first page for each of --max-sessions {max_sessions} "
            f"({bytes_per_token} bytes a token): give a larger share, fewer sessions or a size"
        )
    logger.info(
        "KV budget: %s of %.2f GiB available on %s = %.2f GiB, about %d tokens",
        setting,
        available / 2**30,
        device,
        budget / 2**30,
        tokens,
    )
    return budget


def pool_bytes(budget: int, bytes_per_token: int, max_sessions: int, device: str) -> int:
    """How large a model service's pool is. With a KV budget (counted in the entries sessions
    hold, as SessionStore.make_room counts them): room for what the budget admits to grow by
    doubling on CPU, where memory is committed only as written, so the headroom costs nothing
    until used, or the budget itself on CUDA; plus a first page per session. Without one: half
    the machine's memory on CPU, half the device's free memory (after the weights) on CUDA."""
    if budget:
        return (2 * budget if device.startswith("cpu") else budget) + first_pages_bytes(bytes_per_token, max_sessions)
    if device.startswith("cpu"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    return available_bytes(device) // 2
