"""Passes of fixed shapes over the KV pool, captured as CUDA graphs on a GPU (issue 67).

An eager transformers pass on a GPU is bound by the host launching its kernels: a 1.5B
one-token pass took 17 ms on an H200 busy for 3 ms of it (bench/results/gpu-h200). A CUDA
graph replays a pass's kernels without the host, but only over tensors of fixed shapes at
fixed addresses. So a pass here is one of a few shapes, a bucket (B sessions × N new tokens
each × L key columns each), and everything it reads is a tensor the host fills before it runs:

- `packed` [B, 2N + 3 + N²] int64: per session its new tokens [N], their positions [N], where
  its extent starts in the arenas, its past (entries cached), its new tokens' count n, and
  which new tokens each new token sees [N, N] (causal, or a token tree's ancestors). One
  host-to-device copy a pass.
- On the device, inside the pass: the arena columns the new entries go to (`slots` [B·N]:
  start + past + j), the columns attention reads (`columns` [B·L]: the session's past, then
  its new entries), and the additive mask [B, 1, N, L] from past, n and the visibility.

Each layer writes its new entries into the pool's arenas in place (`index_copy_`) and reads
its sessions' entries as one gather of L columns ([B, H, L, D]): a copy of what attention
reads, which on a GPU costs microseconds (the 1.5B's 28 layers × 2 KV heads × 2k tokens ×
128 × 2 B × 2 is 58 MB, about 15 µs at the H200's 4 TB/s; attention.GROUPED reads
grouped heads in place) and which the eager path's views avoid on CPU.
Padding (rows past a session's n, sessions past the batch's) writes to a scratch page of
the pool and reads only it; real rows never read a pad.

Buckets: N is 1..8 as is, then the next power of two up to MAX_TOKENS (a verify is K + 1
rows; a tree, its new tokens and nodes); B the next power of two up to the largest batch; L
the next power of two from MIN_LENGTH. On CUDA a bucket's graph is captured the first time a
pass needs it (`StaticPasses.warm` captures the usual ones at start-up), all in one memory
pool; the head (the vocabulary-wide Linear) runs after the replay, on the rows kept only.
On CPU the same passes run uncaptured: the suite tests them there (`--cuda-graphs on`).

What runs eagerly instead (`StaticPasses.fits`): prefills longer than MAX_TOKENS, sessions
not in the pool, models whose forward passes are watched by hooks (the target's feature
taps for an EAGLE head), and models whose logits are more than their head's Linear.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.engine.attention import GROUPED
from specdec.engine.kv_pool import KVPool, PoolCache
from specdec.engine.modeling import LoadedModel, with_cache
from specdec.engine.tree_pass import tree_attention_mask, tree_position_ids
from specdec.sampling.tree_sampling import ancestors

logger = logging.getLogger(__name__)

MAX_TOKENS = 64  # most new tokens per session in a static pass (a verify's K + 1, a tree's rows)
MIN_LENGTH = 256  # the shortest key length bucket
EXACT_TOKEN_BUCKETS = 8  # 1..8 new tokens each have a bucket: decode steps and verifies of K < 8


def token_bucket(tokens: int) -> int:
    """The N a pass of `tokens` new tokens per session runs at (≤ MAX_TOKENS)."""
    return tokens if tokens <= EXACT_TOKEN_BUCKETS else 1 << (tokens - 1).bit_length()


def batch_bucket(sessions: int) -> int:
    return 1 << (sessions - 1).bit_length()


def length_bucket(tokens: int) -> int:
    return max(MIN_LENGTH, 1 << (tokens - 1).bit_length())


@dataclass(frozen=True)
class Row:
    """One session's part of a static pass: `token_ids` after its `cache`'s entries, at
    `positions` (default: one after another), each seeing the cache and the new tokens
    `visible` allows ([n, n] bool; default causal), and the logits of its last `keep` tokens."""

    cache: Cache | None  # a PoolCache of the passes' pool (`fits` says so), typed as sessions hold it
    token_ids: Sequence[int]
    keep: int = 1
    positions: Sequence[int] | None = None
    visible: torch.Tensor | None = None


@dataclass(frozen=True)
class Bucket:
    sessions: int  # B
    tokens: int  # N
    length: int  # L

    def __str__(self) -> str:
        return f"{self.sessions}x{self.tokens}x{self.length}"


class _Layer(CacheLayerMixin):
    """A layer of the static pass's cache: writes the pass's new entries at the pass's slots in
    the pool's arenas and returns its sessions' entries gathered at the pass's columns."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: _StaticCache, index: int) -> None:
        super().__init__()
        self._cache, self._index = cache, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states: [B, H, N, D] → the sessions' entries [B, H, L, D] (gathered)."""
        cache = self._cache
        batch, heads, tokens, dim = key_states.shape
        out = []
        for arena, states in (
            (cache.pool.keys[self._index], key_states),
            (cache.pool.values[self._index], value_states),
        ):
            arena.index_copy_(1, cache.slots, states.transpose(0, 1).reshape(heads, batch * tokens, dim))
            gathered = arena.index_select(1, cache.columns)  # [H, B·L, D]
            out.append(gathered.view(heads, batch, -1, dim).transpose(0, 1))  # [B, H, L, D]
        return out[0], out[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.length, 0

    def get_seq_length(self) -> int:
        return 0  # positions and the mask are given: never read

    def get_max_length(self) -> int:
        return -1


class _StaticCache(Cache):
    """The cache a static pass hands the model: the pool's arenas, and the pass's slots and
    columns (static buffers under a CUDA graph)."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, columns: torch.Tensor, length: int) -> None:
        self.pool, self.slots, self.columns, self.length = pool, slots, columns, length
        super().__init__(layers=[_Layer(self, index) for index in range(len(pool.keys))])


@dataclass
class _Pass:
    """One bucket's pass: its input buffer and, on CUDA once captured, its graph and output."""

    packed: torch.Tensor  # [B, 2N + 3 + N²] on the device
    graph: Any = None  # torch.cuda.CUDAGraph
    hidden: torch.Tensor | None = None  # [B, N, H]: the captured pass's output
    runs: int = 0


@dataclass
class StaticPasses:
    """The static passes of one model over its pool (ModelRunner holds one per model)."""

    model: PreTrainedModel
    pool: KVPool
    max_sessions: int  # most sessions in one pass (the batch bucket's cap)
    max_length: int  # longest session (past + new) a pass takes; longer ones run eagerly
    capture: bool  # CUDA graphs (on a CUDA device); else the same passes uncaptured
    _passes: dict[Bucket, _Pass] = field(default_factory=dict)
    _scratch: int = 0  # the scratch page's first column: where pads write, and what they read

    def __post_init__(self) -> None:
        self._decoder = self.model.get_decoder()
        self._head = self.model.get_output_embeddings()
        self._modules = list(self.model.modules())  # what a hook could watch (`_hooked`)
        scratch = self.pool.open(1)  # held for the passes' lifetime: its page never goes back
        self._scratch_cache = scratch
        self._scratch = scratch.extent.start * self.pool.page_tokens
        with torch.inference_mode():
            for arena in (*self.pool.keys, *self.pool.values):
                arena[:, self._scratch : self._scratch + self.pool.page_tokens].zero_()
        dtype = self.pool.dtype
        self._blocked = torch.finfo(dtype if dtype.is_floating_point else torch.float32).min
        self._memory_pool = torch.cuda.graph_pool_handle() if self.capture else None
        # The attention masks a pass hands its decoder, one per kind of layer (all full attention).
        self._mask_kinds = set(getattr(self.model.config.get_text_config(), "layer_types", None) or ["full_attention"])
        if self.model.config._attn_implementation == "sdpa":  # the same SDPA, grouped heads read in place
            self.model.set_attn_implementation(GROUPED)

    @staticmethod
    def supported(model: PreTrainedModel) -> str | None:
        """Why `model`'s passes cannot run here, or None: its logits must be its head's Linear
        over the decoder's last hidden state (no soft-capping or scaling), over plain
        full-attention layers whose masks may be given as they are (SDPA, eager, row-wise)."""
        config = model.config.get_text_config()
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
            return "its logits are scaled or capped after the head"
        if not isinstance(model.get_output_embeddings(), torch.nn.Module):
            return "it has no output head"
        implementation = getattr(model.config, "_attn_implementation", "sdpa")
        if implementation not in ("sdpa", "eager", GROUPED) and not implementation.startswith("specdec_rowwise"):
            return f"its attention ({implementation}) does not take a given 4D mask"
        return None

    def fits(self, rows: Sequence[tuple[Cache | None, int]]) -> bool:
        """Whether sessions with (cache, new tokens) run here: each cache in this pool, each run
        at most MAX_TOKENS, each session at most max_length, at most max_sessions of them, and
        no hook watching the model (a hook sees nothing of a replayed graph)."""
        if not 0 < len(rows) <= self.max_sessions:
            return False
        for cache, tokens in rows:
            if not isinstance(cache, PoolCache) or cache.pool is not self.pool:
                return False
            if not 0 < tokens <= MAX_TOKENS or cache.lengths[0] + tokens > self.max_length:
                return False
        return not self._hooked()

    def _hooked(self) -> bool:
        """Whether a forward hook watches any module (the feature taps hook the embeddings,
        decoder layers or the final norm); a few hundred attribute reads a pass."""
        hooks = torch.nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            return True
        return any(module._forward_hooks or module._forward_pre_hooks for module in self._modules)

    def describe(self) -> str:
        """The buckets run so far (captured on CUDA), for Info and the log."""
        kind = "captured" if self.capture else "static, uncaptured"
        buckets = sorted(self._passes, key=lambda b: (b.sessions, b.tokens, b.length))
        eager = [b for b in buckets if self.capture and self._passes[b].graph is None]
        text = f"{kind}: {len(buckets)} buckets (sessions x tokens x length): " + " ".join(map(str, buckets))
        return text + (f"; not captured: {' '.join(map(str, eager))}" if eager else "")

    @torch.inference_mode()
    def run(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """One pass over `rows` (`fits` said they fit; each cache gets room for its tokens
        here). → per row the logits of its last `keep` tokens [keep, V], float32. Each cache
        then holds its new tokens' entries, as an eager pass leaves it."""
        caches = [_pooled(row.cache) for row in rows]
        past = [cache.lengths[0] for cache in caches]
        for cache, row, length in zip(caches, rows, past):
            cache.reserve(length + len(row.token_ids))
        width = max(len(row.token_ids) for row in rows)
        longest = max(length + len(row.token_ids) for length, row in zip(past, rows))
        bucket = Bucket(batch_bucket(len(rows)), token_bucket(width), length_bucket(longest))
        packed = self._pack(rows, caches, past, bucket)
        hidden = self._replay(bucket, packed)  # [B, N, H]
        for cache, row, length in zip(caches, rows, past):
            cache.lengths[:] = [length + len(row.token_ids)] * len(cache.lengths)
        picks = [
            hidden[index, len(row.token_ids) - min(row.keep, len(row.token_ids)) : len(row.token_ids)]
            for index, row in enumerate(rows)
        ]
        logits = self._head(torch.cat(picks))  # [Σ keep, V]: the head on the kept rows only
        return [part.float() for part in logits.split([len(pick) for pick in picks])]

    def _pack(self, rows: Sequence[Row], caches: list[PoolCache], past: list[int], bucket: Bucket) -> torch.Tensor:
        """The pass's inputs, host-side: [B, 2N + 3 + N²] int64 (module docstring)."""
        n = bucket.tokens
        packed = np.zeros((bucket.sessions, 2 * n + 3 + n * n), dtype=np.int64)
        packed[:, 2 * n] = self._scratch  # pad sessions: an extent at the scratch page, nothing cached
        causal = np.tril(np.ones((n, n), dtype=np.int64))
        for index, (row, cache, length) in enumerate(zip(rows, caches, past)):
            count = len(row.token_ids)
            line = packed[index]
            line[:count] = row.token_ids
            line[n : n + count] = row.positions if row.positions is not None else range(length, length + count)
            line[2 * n : 2 * n + 3] = (cache.extent.start * self.pool.page_tokens, length, count)
            visible = line[2 * n + 3 :].reshape(n, n)
            if row.visible is None:
                visible[:count, :count] = causal[:count, :count]
            else:
                visible[:count, :count] = row.visible.numpy()
        return torch.from_numpy(packed)

    def _forward(self, bucket: Bucket, packed: torch.Tensor) -> torch.Tensor:
        """The pass itself, all on the device from `packed` (captured as it is on CUDA).
        → the decoder's last hidden states [B, N, H]"""
        sessions, n, length = bucket.sessions, bucket.tokens, bucket.length
        device = packed.device
        ids, positions = packed[:, :n], packed[:, n : 2 * n]  # [B, N] each
        start, past, count = packed[:, 2 * n], packed[:, 2 * n + 1], packed[:, 2 * n + 2]  # [B] each
        visible = packed[:, 2 * n + 3 :].view(sessions, n, n).bool()  # [B, N, N]
        row = torch.arange(n, device=device)  # [N]
        column = torch.arange(length, device=device)  # [L]
        real_row = row[None, :] < count[:, None]  # [B, N]
        scratch = torch.full_like(start, self._scratch)
        slots = torch.where(real_row, start[:, None] + past[:, None] + row, scratch[:, None])  # [B, N]
        held = column[None, :] < (past + count)[:, None]  # [B, L]
        columns = torch.where(held, start[:, None] + column, scratch[:, None])  # [B, L]
        offset = column[None, :] - past[:, None]  # [B, L]: a new token's index, where ≥ 0
        sees_new = visible.gather(2, offset.clamp(0, n - 1)[:, None, :].expand(sessions, n, length))  # [B, N, L]
        sees_new &= ((offset >= 0) & (offset < count[:, None]))[:, None, :]
        allowed = (column[None, None, :] < past[:, None, None]) | sees_new  # [B, N, L]
        # A pad row sees column 0 only (its session's first entry, or the scratch page's): no
        # row of the softmax is empty, and no pad reads anything a real row wrote after it.
        allowed = torch.where(real_row[:, :, None], allowed, column[None, None, :] == 0)
        mask = torch.where(allowed, 0.0, self._blocked).to(self.pool.dtype)[:, None]  # [B, 1, N, L]
        cache = _StaticCache(self.pool, slots.reshape(-1), columns.reshape(-1), length)
        out = self._decoder(
            input_ids=ids,
            attention_mask={kind: mask for kind in self._mask_kinds},
            position_ids=positions,
            **with_cache(self._decoder, cache),
            use_cache=True,
        )
        return out.last_hidden_state  # [B, N, H]

    def _replay(self, bucket: Bucket, packed: torch.Tensor) -> torch.Tensor:
        """Runs the bucket's pass on `packed` (host tensor): uncaptured on CPU; on CUDA the
        bucket's graph, captured at its first use."""
        entry = self._passes.get(bucket)
        if entry is None:
            entry = self._passes[bucket] = self._prepare(bucket)
        entry.runs += 1
        if entry.graph is None:
            return self._forward(bucket, packed.to(self.pool.device))
        entry.packed.copy_(packed, non_blocking=True)
        entry.graph.replay()
        assert entry.hidden is not None
        return entry.hidden

    def _prepare(self, bucket: Bucket) -> _Pass:
        """A bucket's buffers; on CUDA its graph, captured over passes of pads only (every
        slot the scratch page), so capturing writes no session's entries. A bucket whose
        capture fails (out of memory, say) runs uncaptured from then on, with a warning."""
        rows = 2 * bucket.tokens + 3 + bucket.tokens**2
        packed = torch.zeros(bucket.sessions, rows, dtype=torch.long, device=self.pool.device)
        packed[:, 2 * bucket.tokens] = self._scratch
        entry = _Pass(packed)
        if not self.capture:
            return entry
        # No cyclic garbage collection inside a capture: a session's cache freed there would
        # record its pages' zeroing into the graph, to run again at every replay on pages that
        # by then are another session's (SGLang freezes the collector around capture too).
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            stream = torch.cuda.Stream(device=self.pool.device)
            stream.wait_stream(torch.cuda.current_stream(self.pool.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # lazy initialisations (cuBLAS workspaces, kernels) outside the capture
                    self._forward(bucket, packed)
            torch.cuda.current_stream(self.pool.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory_pool, stream=stream, capture_error_mode="thread_local"):
                entry.hidden = self._forward(bucket, packed)
            entry.graph = graph
        except RuntimeError as exc:  # the bucket stays usable, uncaptured
            logger.warning("no CUDA graph for %s sessions x tokens x length (%s); it runs eagerly", bucket, exc)
            entry.hidden = None
        finally:
            if collecting:
                gc.enable()
        return entry

    def warm(self, tokens: Sequence[int], lengths: Sequence[int]) -> None:
        """Prepares (captures, on CUDA) the one-session buckets of these new-token counts and
        session lengths now, so no request waits for a capture."""
        for count in sorted({token_bucket(t) for t in tokens if 0 < t <= MAX_TOKENS}):
            for length in sorted({length_bucket(t) for t in lengths if t <= self.max_length}):
                bucket = Bucket(1, count, length)
                if bucket not in self._passes:
                    with torch.inference_mode():
                        self._passes[bucket] = self._prepare(bucket)


def _pooled(cache: Cache | None) -> PoolCache:
    if not isinstance(cache, PoolCache):
        raise AssertionError(f"a static pass runs sessions of the pool only; got {type(cache).__name__}")
    return cache


class _Runner(Protocol):
    """What `static_passes_for` reads of a runner (specdec.engine.runner.ModelRunner)."""

    loaded: LoadedModel
    model: PreTrainedModel
    pool: KVPool | None
    takes_static_passes: bool
    max_batch_size: int
    max_speculative_tokens: int


def static_passes_for(runner: _Runner, setting: str) -> StaticPasses | None:
    """--cuda-graphs for a runner: `auto` (on for a CUDA device), `on` (on CPU: the same passes
    uncaptured, which the tests run), `off`. On CUDA the one-session decode and verify buckets
    up to 2k tokens are captured now. ValueError where `on` cannot be, with the reason."""
    cuda = runner.loaded.device.startswith("cuda")
    if setting == "off" or setting == "auto" and not cuda:
        return None
    why = None
    if runner.pool is None:
        why = "its KV is not in the pool (a cache with sliding-window layers, or a device map)"
    elif runner.loaded.tensor_parallel_size > 1:
        why = "it is split over tensor-parallel ranks"
    elif not runner.takes_static_passes:
        why = f"{type(runner).__name__}'s passes read state of their own mid-pass"
    else:
        why = StaticPasses.supported(runner.model)
    if why is not None:
        if setting == "on":
            raise ValueError(f"--cuda-graphs on: {runner.loaded.model_id} cannot run static passes: {why}")
        logger.info("no CUDA graphs for %s: %s; passes run eagerly", runner.loaded.model_id, why)
        return None
    assert runner.pool is not None
    max_length = min(runner.loaded.max_context, runner.pool.capacity_tokens)
    passes = StaticPasses(runner.model, runner.pool, runner.max_batch_size, max_length, capture=cuda)
    if cuda:
        started = time.perf_counter()
        tokens = range(1, min(runner.max_speculative_tokens + 1, EXACT_TOKEN_BUCKETS) + 1)
        passes.warm(tokens, [MIN_LENGTH * 2**i for i in range(4)])
        logger.info("%s: %s in %.1f s", runner.loaded.model_id, passes.describe(), time.perf_counter() - started)
    return passes


def tree_row(cache: Cache | None, new_tokens: Sequence[int], token_ids: Sequence[int], parents: Sequence[int]) -> Row:
    """A session's token tree as a Row (specdec.engine.tree_pass's layout, every node run):
    `new_tokens` causal, then each node seeing them and its ancestors, at its depth. It keeps
    what tree_forward returns: the root's row (the last new token's) and every node's."""
    paths = ancestors(list(parents))
    past = _pooled(cache).lengths[0]
    allowed = tree_attention_mask(paths, past, len(new_tokens))[0, 0, :, past:] == 0  # [n, n]
    positions = tree_position_ids(paths, past, len(new_tokens))[0].tolist()
    run = [*new_tokens, *token_ids]
    return Row(cache, run, keep=len(run) - max(len(new_tokens) - 1, 0), positions=positions, visible=allowed)
