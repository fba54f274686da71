"""What the draft and target runners share: a loaded model, its sessions, and an incremental
forward pass that runs only the tokens the session's KV cache has not seen."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from contextlib import AbstractContextManager, nullcontext

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from specdec.engine import attention
from specdec.engine.batched_pass import DecodeBatch, admit_session, padded_pass, padded_tree_pass, static_batch
from specdec.engine.batching import MAX_PADDING_RATIO, result_or_error
from specdec.engine.calls import ModelDescription, check_context, check_token_ids
from specdec.engine.costs import (
    PassCosts,
)
from specdec.engine.fingerprint import served_weights
from specdec.engine.kv import batchable_cache
from specdec.engine.kv_pool import KVPool, kv_geometry
from specdec.engine.memory import MemoryShare, kv_budget, pool_bytes
from specdec.engine.modeling import LoadedModel, session_inputs, with_cache
from specdec.engine.pace import Pacer
from specdec.engine.prefix_cache import DEFAULT_PREFIX_BLOCK_TOKENS, PrefixCache
from specdec.engine.sessions import KVSession, SessionStore
from specdec.engine.static_pass import Row, StaticPasses, static_passes_for, tree_row
from specdec.engine.tree_pass import CachedTree, tree_forward
from specdec.errors import ModelOutputError

# A per-token exact runner's longest pass over tokens it only needs the last logits of (a
# prompt, a re-prefill): the same entries however a run is cut, and shorter passes keep the
# activations in cache. An int8 1.5B prefill on a 2-core AVX-512 EPYC, per-row attention
# (matmul and softmax per row, 2026-11-25): 800 tokens took 3.64 s in passes of 256, 3.78 s
# in 128, 5.02 s in one pass (SDPA, one pass: 4.54 s).
EXACT_PASS_TOKENS = 256

logger = logging.getLogger(__name__)


class ModelRunner:
    """A causal LM with per-session KV caches. Not thread-safe: one thread drives it."""

    max_padding_ratio = MAX_PADDING_RATIO  # batched calls: see batch_groups
    takes_static_passes = True  # False: a runner whose passes read Python state mid-pass (an EAGLE head)

    def __init__(
        self,
        loaded: LoadedModel,
        max_sessions: int,
        session_ttl_s: float,
        max_speculative_tokens: int,
        max_kv_bytes: int | MemoryShare = 0,
        prefix_cache_bytes: int = 0,
        prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.weights = served_weights(self.model)  # as served: quantised, its head cut (the loader's done)
        self.max_speculative_tokens = max_speculative_tokens
        # Plain full-attention layers only (no sliding windows): the pool, token trees and prefix blocks need them.
        self.trees = plain = batchable_cache(DynamicCache(config=self.model.config))
        if prefix_cache_bytes and not plain:
            raise ValueError(
                f"--prefix-cache-bytes needs a model whose KV cache is plain full attention; {loaded.model_id} "
                "has sliding-window or other layers, whose entries a block cannot be cut from"
            )
        prefix = PrefixCache(prefix_block_tokens, prefix_cache_bytes) if prefix_cache_bytes else None
        # Under tensor parallelism each rank caches 1/N of the KV heads; budgets count this rank's share.
        self.kv_bytes_per_token = kv_bytes_per_token(self.model) // loaded.tensor_parallel_size
        max_kv_bytes = kv_budget(max_kv_bytes, self.kv_bytes_per_token, max_sessions, loaded.device, prefix_cache_bytes)
        # Every session's KV and prefix block sits in one preallocated pool (specdec.engine.kv_pool), but for
        # models with other layer kinds (sliding windows) or over several devices: transformers' own cache.
        self.pool: KVPool | None = None
        if plain and loaded.device_label != "auto":
            device, parallel = loaded.device, loaded.tensor_parallel_size
            size = pool_bytes(max_kv_bytes, self.kv_bytes_per_token, max_sessions, device)
            block = prefix_block_tokens if prefix is not None else 0  # a prefix block a page, where it divides one
            self.pool = KVPool.for_bytes(self.model.config, size, self.model.dtype, device, parallel, block)
        self.sessions = SessionStore(max_sessions, session_ttl_s, self.new_cache, max_kv_bytes, prefix)
        self.processed_tokens_total = 0  # tokens run since start; tests use it to prove prefixes are reused
        # Passes that ran more than one session (forward_batch), the sessions they ran, the most at once.
        self.batched_forwards = self.batched_sessions_total = self.max_batch_size_seen = 0
        self.between_passes = lambda session=None: None  # before each pass of a prefill cut in passes (ModelThread's)
        self.pass_costs: PassCosts | None = None  # set by specdec.engine.calibration
        self.max_batch_size = 1  # most sessions a batched pass serves (--max-batch-size; set by the loader)
        self.pacer: Pacer | None = None  # bench.emulated: passes held to an accelerator's time (engine.pace)
        # --cuda-graphs: passes of fixed shapes over the pool, captured on CUDA (use_static_passes).
        self.static: StaticPasses | None = None

    def use_static_passes(self, setting: str) -> None:
        """--cuda-graphs (specdec.engine.static_pass.static_passes_for); after max_batch_size is set."""
        self.static = static_passes_for(self, setting)

    def new_cache(self) -> Cache:
        """An empty cache for a new session: an extent of the pool (PoolFull when none is free)."""
        if self.pool is not None:
            return self.pool.open()
        return DynamicCache(config=self.model.config)

    def describe(self) -> ModelDescription:
        dtype = str(self.model.dtype).removeprefix("torch.")
        description = ModelDescription.of(
            self.loaded, dtype, self.loaded.device_label, len(self.sessions), self.max_speculative_tokens
        )
        return dataclasses.replace(
            description,
            fork_sessions=self.sessions.forks(),
            max_sessions=self.sessions.max_sessions,
            kv_cache_bytes=self.sessions.kv_bytes(),
            max_kv_cache_bytes=self.sessions.max_kv_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token,
            evicted_sessions=self.sessions.evicted,
            tensor_parallel_size=self.loaded.tensor_parallel_size,
            quantization=self.loaded.quantization,
            weights_fingerprint=self.weights.fingerprint,
            device_kind=self.weights.device_kind,
            pass_cost_profile=self.pacer.profile.name if self.pacer else "",
            static_passes=self.static.describe() if self.static is not None else "",
            emulation_overruns=self.pacer.overruns if self.pacer else 0,
            trees=self.trees,  # both model runners score token trees (forward_tree), but over sliding windows
            max_batch_size=self.max_batch_size,
            prefix_cache=self.sessions.prefix.figures() if self.sessions.prefix is not None else (),
            **self._cost_fields(),
        )

    def _paced(self, new_tokens: int, context_tokens: int) -> AbstractContextManager:
        """Around every forward pass: holds it to the profile's time when one is set."""
        return self.pacer.hold(new_tokens, context_tokens) if self.pacer is not None else nullcontext()

    def _synchronize(self) -> None:
        """Waits for queued GPU work, so a timing covers the pass and not only its launch."""
        if self.loaded.device.startswith("cuda"):
            torch.cuda.synchronize(self.loaded.device)

    def _cost_fields(self) -> dict:
        if self.pass_costs is None:
            return {}
        return dict(
            calibrated_pass_ms=self.pass_costs.calibrated_ms,
            live_pass_ms=tuple(self.pass_costs.live_ms),
            cost_context_tokens=self.pass_costs.context_tokens,
            calibrated_batch_ms=self.pass_costs.batch_ms,
        )

    def end_session(self, session_id: str, keep: bool = True) -> bool:
        """The caller is done with the session: its blocks stay in the prefix cache unless
        `keep` is False (its sequence is no request's output)."""
        return self.sessions.finish(session_id) if keep else self.sessions.end(session_id)

    def expire_sessions(self) -> int:
        return self.sessions.expire()

    def check_logits(self, logits: torch.Tensor, session_id: str, total: float | None = None) -> None:
        """logits: [..., V]. NaN or +inf fails the call (ModelOutputError); -inf is a masked id.

        On the hot path one sum decides (`total`: fetched with the caller's outputs, one wait);
        the elementwise checks, each about 30 times dearer, run only when it is not finite."""
        if math.isfinite(float(logits.sum()) if total is None else total):
            return
        if bool(torch.isnan(logits).any() or torch.isposinf(logits).any()):
            raise ModelOutputError(
                f"model {self.loaded.model_id} produced NaN or infinite logits for session {session_id!r} "
                f"({self.describe().numerics}); no token can be chosen from them"
            )

    def check_tokens(self, token_ids: list[int], what: str) -> None:
        check_token_ids(token_ids, self.loaded.vocab_size, what)

    def check_length(self, total: int) -> None:
        check_context(total, self.loaded.max_context)

    @torch.inference_mode()
    def forward(self, session: KVSession, token_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        """Runs `token_ids` on top of the session's cache; returns the last positions' logits.

        token_ids: [N] → logits [min(logits_to_keep, N), V] (float32, on the model's device)
        """
        try:
            self.sessions.make_room(session, len(token_ids) * self.kv_bytes_per_token, self.kv_bytes_per_token)
            if self.per_token_exact:
                # The last pass carries the logits kept and up to a pass's worth before them.
                rest, logits = self._prefill_blocks(session, token_ids, logits_to_keep, lead=True)
            else:
                # With one logit to keep, the last whole block's pass gives it: no pass is left over.
                rest, logits = self._prefill_blocks(session, token_ids, 0 if logits_to_keep == 1 else logits_to_keep)
            if rest:
                return self._forward_admitted(session, rest, logits_to_keep)
            assert logits is not None, "no tokens left and no block ran"
            return logits
        except BaseException:
            # A half-updated cache cannot be trusted (nor a session that does not fit the KV
            # budget be kept); the caller re-prefills on NOT_FOUND.
            self.sessions.end(session.session_id)
            raise

    @torch.inference_mode()
    def forward_tree(
        self,
        session: KVSession,
        new_tokens: list[int],
        token_ids: list[int],
        parents: list[int],
        first_node: int = 1,
    ) -> torch.Tensor:
        """specdec.engine.tree_pass.tree_forward on the session's cache, admitted to the KV budget as
        `forward` admits a pass; records the nodes it leaves cached (KVSession.tree).

        → logits [1 + R, V] with new tokens (the root's row first), else [R, V]; float32"""
        ran = len(token_ids) - first_node + 1
        try:
            self.sessions.make_room(session, (len(new_tokens) + ran) * self.kv_bytes_per_token, self.kv_bytes_per_token)
            new_tokens = self._prefill_blocks(session, new_tokens, 1)[0] if new_tokens else new_tokens
            with self._paced(len(new_tokens) + ran, session.cached_tokens):
                if (
                    self.static is not None
                    and first_node == 1
                    and token_ids
                    and (new_tokens or session.cached_tokens)
                    and self.static.fits([(session.cache, len(new_tokens) + ran)])
                ):
                    logits = self.static.run([tree_row(session.cache, new_tokens, token_ids, parents)])[0]
                else:
                    logits = tree_forward(self.model, session.model_cache(), new_tokens, token_ids, parents, first_node)
                self._synchronize()
        except BaseException:
            self.sessions.end(session.session_id)  # as in `forward`: a half-updated cache is not kept
            raise
        self.processed_tokens_total += len(new_tokens) + ran
        session.tree = CachedTree(len(session.tokens), tuple(token_ids), tuple(parents), len(token_ids))
        return logits.float()

    @property
    def per_token_exact(self) -> bool:
        """Every solo pass computes each token exactly as any other pass would (per-row attention
        over every row, per-token int8 Linear layers: specdec.engine.attention), so a prefix cache
        may keep every entry such a pass leaves, and no prefill needs cutting into blocks."""
        return bool(self.loaded.quantization) and self.model.config._attn_implementation == attention.EVERY_ROW

    def _prefill_blocks(
        self, session: KVSession, token_ids: list[int], tail: int, lead: bool = False
    ) -> tuple[list[int], torch.Tensor | None]:
        """Runs the leading tokens of `token_ids` (the tokens after the session's cache) in
        passes of their own, leaving at least `tail` tokens, and returns those left for the
        caller's pass and the last such pass's last logits [1, V] (None when none ran).

        - A per-token exact runner computes every token alike however its passes are cut, so
          it cuts a long run into passes of EXACT_PASS_TOKENS: bitwise the same entries, and a
          faster prefill on CPU than one long pass. Under an emulated profile the run stays
          one pass, as the profile prices it. With `lead` (a solo caller's pass) it leaves the
          caller the tail and what precedes it back to the last whole pass, so a prompt and
          the tokens it scores share one pass, and a short prompt runs in one.
        - Any other runner, with a prefix cache, runs each whole block in a block-aligned pass
          of its own, so every block a session prefills is computed exactly as any other
          session computes it, and a cached block equals a fresh prefill's, bit for bit
          (specdec.engine.prefix_cache). Only a session whose whole cache is such blocks goes
          on in blocks; any other runs `token_ids` as given."""
        start = session.cached_tokens
        if self.per_token_exact:
            size = EXACT_PASS_TOKENS if self.pacer is None else max(len(token_ids), 1)
            run = (len(token_ids) - tail) // size * size if lead else len(token_ids) - tail
            if run <= 0 or not tail and run <= size:
                return token_ids, None  # the caller's pass is the whole run
            logits = None
            for begin in range(0, run, size):
                self.between_passes(session)
                logits = self._forward_admitted(session, token_ids[begin : min(begin + size, run)], 1)
            return token_ids[run:], logits
        prefix = self.sessions.prefix
        if prefix is None or session.aligned_tokens != start:
            return token_ids, None
        if start % prefix.block_tokens:
            return token_ids, None
        size = prefix.block_tokens
        end = (start + len(token_ids) - tail) // size * size
        logits = None
        for block_start in range(start, end, size):
            self.between_passes(session)
            logits = self._forward_admitted(session, token_ids[block_start - start : block_start - start + size], 1)
            session.aligned_tokens = block_start + size
        return token_ids[max(end - start, 0) :], logits

    def _forward_admitted(self, session: KVSession, token_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        started = time.perf_counter()
        start = session.cached_tokens
        if self.static is not None and self.static.fits([(session.cache, len(token_ids))]):
            with self._paced(len(token_ids), start):
                logits = self.static.run([Row(session.cache, token_ids, keep=logits_to_keep)])[0]
                self._synchronize()
        else:
            input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.loaded.device)  # [1, N]
            cache_position = torch.arange(start, start + len(token_ids), device=self.loaded.device)  # [N]
            with self._paced(len(token_ids), start):
                out = self.model(
                    input_ids=input_ids,
                    **with_cache(self.model, session.cache),
                    **session_inputs(self.model, [session]),
                    cache_position=cache_position,
                    use_cache=True,
                    logits_to_keep=logits_to_keep,
                )
                self._synchronize()
            logits = out.logits[0].float()  # [min(logits_to_keep, N), V]
        self.processed_tokens_total += len(token_ids)
        if self.per_token_exact and session.aligned_tokens == start:
            session.aligned_tokens = start + len(token_ids)  # a solo pass: exact, however it was cut
        if self.pass_costs is not None:
            self.pass_costs.observe(len(token_ids), (time.perf_counter() - started) * 1e3)
        return logits

    @torch.inference_mode()
    def forward_batch(
        self,
        sessions: list[KVSession],
        token_ids: list[list[int]],
        logits_to_keep: list[int],
        trees: list[tuple[list[int], list[int]]] | None = None,
    ) -> list[torch.Tensor | Exception]:
        """`forward` for several sessions (distinct ids) in ONE pass of the model; item b gets
        logits [min(logits_to_keep[b], N_b), V] or the exception that failed it alone.

        `trees`: per session, a token tree (node tokens, parents) to score after its
        `token_ids` (which end in the tree's root), as `forward_tree` would: item b then gets
        logits [1 + nodes_b, V] and `logits_to_keep` is not read.

        Each session is admitted to the KV budget as `forward` would admit it; one that does
        not fit fails alone. The pass left-pads every past to the longest and right-pads every
        run of new tokens to the longest, masks the pads, gives each row its own positions,
        and afterwards hands each session a cache of exactly its past and its new tokens.
        A failed pass fails (and ends) every session in it, as `forward` does for one.
        """
        if len(sessions) == 1 or not all(batchable_cache(session.cache) for session in sessions):
            return self._forward_each(sessions, token_ids, logits_to_keep, trees)
        results: list[torch.Tensor | Exception | None] = [None] * len(sessions)
        token_ids = list(token_ids)  # the blocks run ahead (_prefill_blocks) shorten an item
        with self.sessions.sharing(session.session_id for session in sessions):  # none evicted for another
            admitted = self._admit_batch(sessions, token_ids, logits_to_keep, trees, results)
        if not admitted:
            return results  # type: ignore[return-value]
        chosen = [sessions[i] for i in admitted]
        try:
            outputs = self._pass_admitted(chosen, admitted, token_ids, logits_to_keep, trees)
        except Exception as exc:  # noqa: BLE001 - every caller in the pass gets it
            for session in chosen:
                self.sessions.end(session.session_id)
            for index in admitted:
                results[index] = exc
            return results  # type: ignore[return-value]
        except BaseException:
            for session in chosen:
                self.sessions.end(session.session_id)
            raise
        for index, logits in zip(admitted, outputs):
            results[index] = logits
        return results  # type: ignore[return-value]

    def _forward_each(
        self,
        sessions: list[KVSession],
        token_ids: list[list[int]],
        logits_to_keep: list[int],
        trees: list[tuple[list[int], list[int]]] | None,
    ) -> list[torch.Tensor | Exception]:
        """`forward_batch` one session at a time, through `forward` or `forward_tree`: for a
        single session, or for caches that cannot be padded into a batch."""
        if trees is not None:
            return [
                result_or_error(self.forward_tree, session, tokens, *tree)
                for session, tokens, tree in zip(sessions, token_ids, trees)
            ]
        return [result_or_error(self.forward, *item) for item in zip(sessions, token_ids, logits_to_keep)]

    def _admit_batch(
        self,
        sessions: list[KVSession],
        token_ids: list[list[int]],
        logits_to_keep: list[int],
        trees: list[tuple[list[int], list[int]]] | None,
        results: list[torch.Tensor | Exception | None],
    ) -> list[int]:
        """Admits each session of a batched pass to the KV budget beside the others, then runs
        its whole blocks alone first, as `forward` runs them, shortening its item of `token_ids`
        in place. A session that fails either step is ended and its exception put in its item
        of `results`, for its caller alone. → the indices of the sessions admitted"""
        admitted: list[int] = []
        pending_bytes = 0
        for index, (session, tokens) in enumerate(zip(sessions, token_ids)):
            extra_bytes = (len(tokens) + (len(trees[index][0]) if trees is not None else 0)) * self.kv_bytes_per_token
            if (refused := admit_session(self, session, extra_bytes, pending_bytes)) is not None:
                results[index] = refused
                continue
            pending_bytes += extra_bytes
            try:  # a session's whole blocks run alone first, as `forward` runs them
                before = len(token_ids[index])
                token_ids[index] = self._prefill_blocks(
                    session, token_ids[index], 1 if trees is not None else logits_to_keep[index]
                )[0]
                pending_bytes -= (before - len(token_ids[index])) * self.kv_bytes_per_token  # now in the cache
            except Exception as exc:  # noqa: BLE001 - handed back to that caller alone
                self.sessions.end(session.session_id)
                results[index] = exc
                continue
            admitted.append(index)
        return admitted

    def _pass_admitted(
        self,
        chosen: list[KVSession],
        admitted: list[int],
        token_ids: list[list[int]],
        logits_to_keep: list[int],
        trees: list[tuple[list[int], list[int]]] | None,
    ) -> list[torch.Tensor]:
        """The one pass over the admitted sessions (`chosen`, at indices `admitted` of the
        call's lists): a padded tree pass, a solo pass for one session, else a padded pass;
        a static pass (`use_static_passes`) where it takes them all."""
        tokens = [token_ids[i] for i in admitted]
        if len(admitted) > 1 and self.static is not None:
            sizes = [len(run) + (len(trees[i][0]) if trees is not None else 0) for run, i in zip(tokens, admitted)]
            if self.static.fits([(session.cache, size) for session, size in zip(chosen, sizes)]):
                return static_batch(self, self.static, chosen, tokens, admitted, logits_to_keep, trees)
        if trees is not None:
            return padded_tree_pass(self, chosen, tokens, [trees[i] for i in admitted])
        if len(admitted) == 1:
            return [self._forward_admitted(chosen[0], tokens[0], logits_to_keep[admitted[0]])]
        return padded_pass(self, chosen, tokens, [logits_to_keep[i] for i in admitted])

    def decode_batch(self, sessions: list[KVSession], steps: list[int]) -> tuple[DecodeBatch, list[Exception | None]]:
        """Sessions (distinct ids, each with a cache, empty for a prompt) that will run
        steps[b] tokens in all, a few in the first pass and one in each after, in one batch kept
        from pass to pass (DecodeBatch), which others may join between passes.

        Each session is admitted to the KV budget for its tokens up front, as `forward_batch`
        admits a pass; one that does not fit is ended and gets its exception (item b of the
        second list), and stays out of the batch. → (the batch, per session its failure or None)
        """
        batch = DecodeBatch(self)
        with self.sessions.sharing(session.session_id for session in sessions):  # none evicts a later one
            return batch, [batch.join(session, count) for session, count in zip(sessions, steps)]


def kv_bytes_per_token(model) -> int:
    """Key + value bytes one token adds to a DynamicCache: 2 · layers · KV heads · head dim ·
    element size (the cache holds activations, float32 for an int8-quantised model)."""
    layers, heads, head_dim = kv_geometry(model.config)
    return 2 * layers * heads * head_dim * torch.empty((), dtype=model.dtype).element_size()
