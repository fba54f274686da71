"""Passes of fixed shapes over the KV pool, captured as CUDA graphs on a GPU (issue 67).

An eager transformers pass on a GPU is bound by the host launching its kernels: a 1.5B
one-token pass took 17 ms on an H200 busy for 3 ms of it (bench/results/gpu-h200). A CUDA
graph replays a pass's kernels without the host, but only over tensors of fixed shapes at
fixed addresses. So a pass here is one of a few shapes, a bucket (B sessions × N new tokens
each × L key columns each), and everything it reads is a tensor the host fills before it runs:

- `packed` [B, N, 5 + N] int64: per session and new token, the token, its position, in every
  row alike where the session's extent starts in the arenas, its past (entries cached) and
  its new tokens' count n, then which new tokens it sees [N] (causal, or a token tree's
  ancestors). One host-to-device copy a pass.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from specdec.engine.attention import BATCHES, EVERY_ROW, GROUPED, NAME
from specdec.engine.kv_pool import KVPool, PoolCache
from specdec.engine.modeling import LoadedModel, with_cache
from specdec.engine.pass_cache import PassCache
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


@dataclass
class _Pass:
    """One bucket's pass: its input buffer and, on CUDA once captured, its graph and output."""

    packed: torch.Tensor  # [B, N, 5 + N] on the device
    column: torch.Tensor  # [L] 0..L-1 on the device: its length is the bucket's L
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
    compile: bool = False  # the pass compiled by torch.compile (Inductor) first, then captured
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
        # Compiled with its sizes symbolic (B, N and L are sizes of packed and column),
        # so every bucket shares one compiled pass: Dynamo specialises only sizes of 1, so at most
        # four (one session or more, one token or more). Inductor fuses the norms, rotary
        # embeddings, activations and residual adds, which eagerly are a few hundred kernels of
        # a few microseconds each; the matrix products stay cuBLAS's (SGLang compiles the same
        # way and captures on top).
        self._compiled = torch.compile(self._forward, dynamic=True, fullgraph=True) if self.compile else None
        (self._cache_keyword,) = with_cache(self._decoder, None)  # read once: a lookup in a pass is a guard

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
        if implementation not in ("sdpa", "eager", GROUPED, NAME, EVERY_ROW, BATCHES):
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
        kind = ("compiled, " if self.compile else "") + ("captured" if self.capture else "static, uncaptured")
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
        """The pass's inputs, host-side: [B, N, 5 + N] int64 (module docstring)."""
        n = bucket.tokens
        packed = np.zeros((bucket.sessions, n, 5 + n), dtype=np.int64)
        packed[:, :, 2] = self._scratch  # pad sessions: an extent at the scratch page, nothing cached
        causal = np.tril(np.ones((n, n), dtype=np.int64))
        for index, (row, cache, length) in enumerate(zip(rows, caches, past)):
            count = len(row.token_ids)
            block = packed[index]  # [N, 5 + N]
            block[:count, 0] = row.token_ids
            block[:count, 1] = row.positions if row.positions is not None else range(length, length + count)
            block[:, 2:5] = (cache.extent.start * self.pool.page_tokens, length, count)
            block[:count, 5 : 5 + count] = causal[:count, :count] if row.visible is None else row.visible.numpy()
        return torch.from_numpy(packed)

    def _forward(self, packed: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        """The pass itself, all on the device from `packed` (captured as it is on CUDA), over
        key columns `column` [L] (0..L-1): the bucket's sizes are its tensors' (`_Pass`), so
        one compiled pass serves every bucket.
        → the decoder's last hidden states [B, N, H]"""
        sessions, n, length = packed.shape[0], packed.shape[1], column.shape[0]
        # Fields at fixed columns: an index that is a size would fix the size (Dynamo specialises it).
        ids, positions = packed[:, :, 0], packed[:, :, 1]  # [B, N] each
        start, past, count = packed[:, 0, 2], packed[:, 0, 3], packed[:, 0, 4]  # [B] each
        visible = packed[:, :, 5:].bool()  # [B, N, N]
        row = torch.arange(n, device=packed.device)  # [N]
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
        cache = PassCache(self.pool, slots.reshape(-1), columns.reshape(-1), length)
        out = self._decoder(
            input_ids=ids,
            attention_mask={kind: mask for kind in self._mask_kinds},
            position_ids=positions,
            **{self._cache_keyword: cache},
            use_cache=True,
        )
        return out.last_hidden_state  # [B, N, H]

    def _replay(self, bucket: Bucket, packed: torch.Tensor) -> torch.Tensor:
        """Runs the bucket's pass on `packed` (host tensor): uncaptured on CPU; on CUDA the
        bucket's graph, captured at its first use."""
        entry = self._entry(bucket)
        entry.runs += 1
        if entry.graph is None:
            return self._pass(packed.to(self.pool.device), entry.column)
        entry.packed.copy_(packed.pin_memory(), non_blocking=True)  # from pageable memory it waits for the queue
        entry.graph.replay()
        assert entry.hidden is not None
        return entry.hidden

    def _pass(self, packed: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        """`_forward`, compiled where `compile` is set, its sizes marked symbolic (else Dynamo
        fixes a size that stayed the same over its first compilations). A compilation that
        fails (Dynamo's recompile limit, a backend error) leaves the pass uncompiled from then
        on, with a warning: running it again writes the same entries to the same columns."""
        if self._compiled is None:
            return self._forward(packed, column)
        for tensor in (packed, column):
            for dim in range(tensor.dim()):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        try:
            return self._compiled(packed, column)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager pass is the same pass
            logger.warning("compiling the static pass failed (%s: %s); it runs uncompiled", type(exc).__name__, exc)
            self._compiled, self.compile = None, False
            return self._forward(packed, column)

    def pass_over_pads(self, bucket: Bucket) -> tuple[Callable[[], torch.Tensor], Callable[[], None] | None]:
        """For benchmarks: the bucket's pass over pads only (every slot the scratch page, so it
        writes no session's entries), uncaptured, as its graph replays it; and the graph's
        replay, where it has one (prepared, or captured, now if not yet)."""
        entry = self._entry(bucket)
        with torch.inference_mode():
            self._pads(entry.packed)  # a replay on CUDA left its real rows there
        graph = entry.graph
        return (lambda: self._pass(entry.packed, entry.column)), (graph.replay if graph is not None else None)

    def _entry(self, bucket: Bucket) -> _Pass:
        """The bucket's pass, prepared (captured, on CUDA) at its first use."""
        entry = self._passes.get(bucket)
        if entry is None:
            with torch.inference_mode():
                entry = self._passes[bucket] = self._prepare(bucket)
        return entry

    def _prepare(self, bucket: Bucket) -> _Pass:
        """A bucket's buffers; on CUDA its graph, captured over passes of pads only (every
        slot the scratch page), so capturing writes no session's entries. A bucket whose
        capture fails (out of memory, say) runs uncaptured from then on, with a warning."""
        n, device = bucket.tokens, self.pool.device
        packed = self._pads(torch.empty(bucket.sessions, n, 5 + n, dtype=torch.long, device=device))
        entry = _Pass(packed, torch.arange(bucket.length, device=device))
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
                for _ in range(2):  # lazy initialisations (cuBLAS workspaces, kernels, compiling) outside the capture
                    self._pass(packed, entry.column)
            torch.cuda.current_stream(self.pool.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory_pool, stream=stream, capture_error_mode="thread_local"):
                entry.hidden = self._pass(packed, entry.column)
            entry.graph = graph
        except RuntimeError as exc:  # the bucket stays usable, uncaptured
            logger.warning("no CUDA graph for %s sessions x tokens x length (%s); it runs eagerly", bucket, exc)
            entry.hidden = None
        finally:
            if collecting:
                gc.enable()
        return entry

    def _pads(self, packed: torch.Tensor) -> torch.Tensor:
        """`packed` [B, N, 5 + N] made pads only, in place: every session an extent at the
        scratch page with nothing cached, so a pass over it writes no session's entries."""
        packed.zero_()
        packed[:, :, 2] = self._scratch
        return packed

    def warm(self, tokens: Sequence[int], lengths: Sequence[int], sessions: Sequence[int] = (1,)) -> None:
        """Prepares (captures, on CUDA; compiles, if compiling) the buckets of these session
        counts, new-token counts and session lengths now, so no request waits for a capture."""
        for count in sorted({token_bucket(t) for t in tokens if 0 < t <= MAX_TOKENS}):
            for length in sorted({length_bucket(t) for t in lengths if t <= self.max_length}):
                for batch in sorted({batch_bucket(b) for b in sessions if 0 < b <= self.max_sessions}):
                    self._entry(Bucket(batch, count, length))


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
    uncaptured, which the tests run), `compiled` (`on`, the pass compiled by torch.compile
    first), `off`. On CUDA the one-session decode and verify buckets up to 2k tokens are
    captured now; compiled, two-session ones too, so that every variant Dynamo compiles (one
    session or more, one token or more) is compiled before a request comes. ValueError where
    `on` or `compiled` cannot be, with the reason."""
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
    if why is None and setting == "compiled":
        why = _uncompilable(runner)
    if why is not None:
        if setting in ("on", "compiled"):
            raise ValueError(f"--cuda-graphs {setting}: {runner.loaded.model_id} cannot run static passes: {why}")
        logger.info("no CUDA graphs for %s: %s; passes run eagerly", runner.loaded.model_id, why)
        return None
    assert runner.pool is not None
    max_length = min(runner.loaded.max_context, runner.pool.capacity_tokens)
    compiled = setting == "compiled"
    passes = StaticPasses(runner.model, runner.pool, runner.max_batch_size, max_length, capture=cuda, compile=compiled)
    if cuda:
        started = time.perf_counter()
        tokens = range(1, min(runner.max_speculative_tokens + 1, EXACT_TOKEN_BUCKETS) + 1)
        passes.warm(tokens, [MIN_LENGTH * 2**i for i in range(4)])
        if compiled:
            passes.warm([1, 2], [MIN_LENGTH], sessions=[2])
        logger.info("%s: %s in %.1f s", runner.loaded.model_id, passes.describe(), time.perf_counter() - started)
    return passes


def _uncompilable(runner: _Runner) -> str | None:
    """Why torch.compile cannot trace `runner`'s static pass whole, or None: the CPU target's
    row-wise attention reads its masks on the host (data-dependent sizes), and int8 Linear
    layers (CPU, float32) call quantized kernels Dynamo does not trace."""
    if runner.loaded.quantization:
        return f"its Linear layers are {runner.loaded.quantization}, which torch.compile cannot trace"
    implementation = getattr(runner.model.config, "_attn_implementation", "")
    if implementation in (NAME, EVERY_ROW, BATCHES):
        return "its row-wise attention (a CPU model's) reads its masks on the host, which torch.compile cannot trace"
    return None


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
