"""Running several sessions' calls in one forward pass: which calls may share a pass, and how
their KV caches are padded into a batch and split back (used by both runners)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from transformers import DynamicCache

from specdec.engine.kv import plain_cache
from specdec.engine.kv_pool import PoolCache
from specdec.engine.sessions import KVSession
from specdec.errors import JobGivenUp, status_of

T = TypeVar("T")

# A batched pass right-pads every session's tokens to the longest run; a session whose run
# would make the padding cost more than this many times the real tokens (a prompt prefill
# among decode rounds) gets a pass of its own instead.
MAX_PADDING_RATIO = 2.0


def padded_cache(sessions: list[KVSession], past: list[int], max_past: int, config) -> DynamicCache:
    """The sessions' caches stacked as a batch, each past left-padded with zeros to `max_past`.

    per layer: B × [1, H, P_b, D] → [B, H, max_past, D]
    """
    if max_past == 0:
        return DynamicCache(config=config)
    layers = []
    for layer_index in range(len(sessions[0].model_cache().layers)):
        # Any: transformers types a layer as any cache kind's; a session's are full-attention layers.
        source: list[Any] = [session.model_cache().layers[layer_index] for session in sessions]
        reference = next(layer for layer, length in zip(source, past) if length)
        heads, head_dim = reference.keys.shape[1], reference.keys.shape[3]
        keys = reference.keys.new_zeros(len(sessions), heads, max_past, head_dim)
        values = reference.values.new_zeros(len(sessions), heads, max_past, reference.values.shape[3])
        for row, (layer, length) in enumerate(zip(source, past)):
            if length:
                keys[row, :, max_past - length :] = layer.keys[0]
                values[row, :, max_past - length :] = layer.values[0]
        layers.append((keys, values))
    return plain_cache(layers)  # plain layers (kv.batchable_cache), holding the new tensors


def row_cache(cache: DynamicCache, row: int, start: int, end: int) -> DynamicCache:
    """Row `row`, columns [start, end) of a batched cache as a session's own cache: a copy of
    the slice, so the batch's tensors are freed."""
    layers: list[Any] = cache.layers  # full-attention layers (see padded_cache)
    return plain_cache(
        (
            layer.keys[row : row + 1, :, start:end].clone(memory_format=torch.contiguous_format),
            layer.values[row : row + 1, :, start:end].clone(memory_format=torch.contiguous_format),
        )
        for layer in layers
    )


def hand_back(session: KVSession, cache: DynamicCache, row: int, start: int, end: int) -> None:
    """Row `row`, columns [start, end) of a batched cache become the session's entries: copied
    into its pool extent, or (a cache of another kind) as a cache of their own (`row_cache`)."""
    if isinstance(session.cache, PoolCache):
        layers: list[Any] = cache.layers
        session.cache.load(
            [(layer.keys[row : row + 1, :, start:end], layer.values[row : row + 1, :, start:end]) for layer in layers]
        )
    else:
        session.cache = row_cache(cache, row, start, end)


def batch_groups(lengths: list[int], max_padding_ratio: float) -> list[list[int]]:
    """Splits items (by how many tokens each runs) into passes: similar lengths share a pass,
    but one whose padding would cost more than `max_padding_ratio` × the real tokens (a prompt
    prefill among one-token decodes) starts a new pass. Returns indices into `lengths`."""
    groups: list[list[int]] = []
    real = 0
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        length = lengths[index]  # the longest so far, as the order is ascending
        if groups and (len(groups[-1]) + 1) * length <= max_padding_ratio * (real + length):
            groups[-1].append(index)
            real += length
        else:
            groups.append([index])
            real = length
    return groups


def call_waves(keys: Sequence[tuple[str, ...]], reads: Sequence[tuple[str, ...]] | None = None) -> list[list[int]]:
    """Indices of calls split into waves that may share passes. keys[i]: the session ids call
    i writes; reads[i]: ids it only reads at its start (a fork copies its parent then).

    A call goes in the wave after the last one that wrote any of its keys, so calls on one
    session keep their order and never share a pass. A writer may share the wave of calls
    that only read its session before it: every call of a wave starts, in index order,
    before any of them steps, so those readers copy the session as it was before the writer.
    A reader goes after the last writer of what it reads."""
    reads = reads or [()] * len(keys)
    last_write: dict[str, int] = {}
    last_read: dict[str, int] = {}
    waves: list[list[int]] = []
    for index, (call_keys, call_reads) in enumerate(zip(keys, reads, strict=True)):
        wave = max(
            [last_write[key] + 1 for key in (*call_keys, *call_reads) if key in last_write]
            + [last_read[key] for key in call_keys if key in last_read],
            default=0,
        )
        for key in call_keys:
            last_write[key] = wave
        for key in call_reads:
            last_read[key] = max(last_read.get(key, 0), wave)
        if wave == len(waves):
            waves.append([])
        waves[wave].append(index)
    return waves


def start_each(indices: list[int], start: Callable[[int], T], results: list) -> list[tuple[int, T]]:
    """(index, start(index)) for each call that starts; one that raises gets its exception in
    `results` and stays out of the batch."""
    started = []
    for index in indices:
        try:
            started.append((index, start(index)))
        except Exception as exc:  # noqa: BLE001 - handed back to that caller alone
            results[index] = exc
    return started


@contextlib.contextmanager
def stopping(runner: Any, should_stop: dict[str, Callable[[], bool]]) -> Iterator[None]:
    """While open, a session's prefill that `runner` cuts into passes (ModelRunner._prefill_blocks)
    also stops between them once `should_stop[session_id]()`: that caller of a batch gone while
    the others still wait (JobGivenUp, for it alone). The job's own check stops a prefill only
    once every caller is gone (ModelThread.between_passes): a long prompt whose client left
    held the batch's other callers for its whole prefill."""
    plain = runner.between_passes

    def check(session: KVSession | None = None) -> None:
        plain(session)
        stop = None if session is None else should_stop.get(session.session_id)
        if stop is not None and stop():
            raise JobGivenUp("the caller stopped waiting for this call (cancelled or past its deadline)")

    runner.between_passes = check
    try:
        yield
    finally:
        runner.between_passes = plain


def result_or_error(fn, *args):
    """fn(*args), or the exception it raised: one call's failure handed back to it alone."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - handed back to that caller alone
        return exc


def untraced_if_refused(result: T) -> T:
    """`result`, with its traceback dropped if it is a refusal (any status but INTERNAL, which
    is logged with its own), and those of what it was raised from or in handling (a PoolFull).
    Their frames, and the callers' frames those keep, hold the refused call's session, ended,
    and so its pool pages: while a batch runs, and after it, in a cycle through the frame that
    held the batch's results, until the cyclic collector runs."""
    todo: list[BaseException | None] = (
        [result] if isinstance(result, Exception) and status_of(result) != "INTERNAL" else []
    )
    seen: set[int] = set()
    while todo:
        if (item := todo.pop()) is not None and id(item) not in seen:
            seen.add(id(item))
            item.__traceback__ = None
            todo += [item.__context__, item.__cause__]
    return result
