"""What the draft and target runners share: a loaded model, its sessions, and an incremental
forward pass that runs only the tokens the session's KV cache has not seen."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
from transformers import DynamicCache

from specdec.engine import attention
from specdec.engine.batching import MAX_PADDING_RATIO, padded_cache, result_or_error, row_cache
from specdec.engine.calls import ModelDescription, check_context, check_token_ids
from specdec.engine.costs import (
    CALIBRATION_CONTEXT,
    CALIBRATION_MAX_TOKENS,
    PassCosts,
    batch_grid,
    calibrate,
    fastest,
)
from specdec.engine.fingerprint import served_weights
from specdec.engine.kv import plain_cache
from specdec.engine.modeling import LoadedModel, with_cache
from specdec.engine.pace import Pacer
from specdec.engine.prefix_cache import DEFAULT_PREFIX_BLOCK_TOKENS, PrefixCache
from specdec.engine.sessions import CachedTree, KVSession, SessionStore, batchable_cache
from specdec.engine.tree_pass import tree_attention_mask, tree_forward, tree_position_ids
from specdec.errors import ModelOutputError
from specdec.sampling.tree_sampling import ancestors

T = TypeVar("T")

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

    def __init__(
        self,
        loaded: LoadedModel,
        max_sessions: int,
        session_ttl_s: float,
        max_speculative_tokens: int,
        max_kv_bytes: int = 0,
        prefix_cache_bytes: int = 0,
        prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.weights = served_weights(self.model)  # as served: quantised, its head cut (the loader's done)
        self.max_speculative_tokens = max_speculative_tokens
        prefix = None
        if prefix_cache_bytes:
            if not batchable_cache(DynamicCache(config=self.model.config)):
                raise ValueError(
                    f"--prefix-cache-bytes needs a model whose KV cache is plain full attention; {loaded.model_id} "
                    "has sliding-window or other layers, whose entries a block cannot be cut from"
                )
            prefix = PrefixCache(prefix_block_tokens, prefix_cache_bytes)
        self.sessions = SessionStore(
            max_sessions, session_ttl_s, lambda: DynamicCache(config=self.model.config), max_kv_bytes, prefix
        )
        # Under tensor parallelism each rank caches 1/N of the KV heads; budgets count this rank's share.
        self.kv_bytes_per_token = kv_bytes_per_token(self.model) // loaded.tensor_parallel_size
        # Tokens run through the model since start; tests use it to prove prefixes are reused.
        self.processed_tokens_total = 0
        # Passes that ran more than one session (forward_batch), the sessions they ran, the most at once.
        self.batched_forwards = 0
        self.batched_sessions_total = 0
        self.max_batch_size_seen = 0
        self.pass_costs: PassCosts | None = None  # set by calibrate_costs
        self.max_batch_size = 1  # most sessions a batched pass serves (--max-batch-size; set by the loader)
        # --pass-cost-profile: every pass is held to an accelerator's time (specdec.engine.pace).
        self.pacer: Pacer | None = None

    def calibrate_costs(self, keep_all_logits: bool, context_tokens: int = CALIBRATION_CONTEXT) -> PassCosts:
        """Times passes over 1..max_speculative_tokens + 1 new tokens (at most
        CALIBRATION_MAX_TOKENS) on top of a cached context, on this process's own hardware, dtype
        and threads (see specdec.engine.costs).

        `keep_all_logits`: the target scores every new token (K + 1 logits); the draft only
        needs the last one. The scratch session lives outside the store and no counter moves.
        """
        context_tokens = max(1, min(context_tokens, self.loaded.max_context - self.max_speculative_tokens - 2))
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(
            0, self.loaded.vocab_size, (context_tokens + self.max_speculative_tokens + 1,), generator=generator
        ).tolist()
        session = KVSession("calibration", cache=DynamicCache(config=self.model.config))
        processed = self.processed_tokens_total
        with torch.inference_mode():
            self._forward_admitted(session, ids[:context_tokens], logits_to_keep=1)

            def run_pass(n: int) -> None:
                self._forward_admitted(
                    session, ids[context_tokens : context_tokens + n], logits_to_keep=n if keep_all_logits else 1
                )
                self._synchronize()
                session.model_cache().crop(-n)

            self.pass_costs = None  # the timed passes are not live traffic
            costs = calibrate(run_pass, min(self.max_speculative_tokens + 1, CALIBRATION_MAX_TOKENS))
            batch_ms = self._calibrate_batches(session, ids[context_tokens:], len(costs), keep_all_logits)
        self.processed_tokens_total = processed
        self.pass_costs = PassCosts(costs, context_tokens, batch_ms=batch_ms)
        logger.info(
            "forward pass cost over a %d-token context, by new tokens: %s",
            context_tokens,
            ", ".join(f"{n + 1}: {ms:.1f} ms" for n, ms in enumerate(costs)),
        )
        if batch_ms:
            logger.info(
                "batched pass cost, sessions x new tokens: %s",
                ", ".join(f"{b}x{n}: {ms:.1f} ms" for b, n, ms in batch_ms),
            )
        return self.pass_costs

    def _calibrate_batches(
        self, session: KVSession, new_ids: list[int], max_new_tokens: int, keep_all_logits: bool
    ) -> tuple[tuple[int, int, float], ...]:
        """Times batched passes (costs.batch_grid) of copies of the calibration session, each
        on the same cached context. None under tensor parallelism or for caches that cannot be
        batched: the coordinator then costs a batch as one pass over all its tokens."""
        if self.max_batch_size < 2 or self.loaded.tensor_parallel_size > 1 or not batchable_cache(session.cache):
            return ()
        timed = []
        for sessions, n in batch_grid(self.max_batch_size, max_new_tokens):
            rows = [KVSession(f"calibration-{i}", cache=copy.deepcopy(session.cache)) for i in range(sessions)]

            def run_batch(rows=rows, n=n) -> None:
                self._forward_padded(rows, [new_ids[:n]] * len(rows), [n if keep_all_logits else 1] * len(rows))
                self._synchronize()
                for row in rows:
                    row.model_cache().crop(-n)

            run_batch()  # warm-up: the first pass of a new shape
            timed.append((sessions, n, fastest(run_batch)))
        return tuple(timed)

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
            emulation_overruns=self.pacer.overruns if self.pacer else 0,
            trees=True,  # both model runners score token trees (forward_tree)
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

    def check_logits(self, logits: torch.Tensor, session_id: str) -> None:
        """logits: [..., V]. NaN or +inf fails the call (ModelOutputError); -inf is a masked id.

        On the hot path: one sum (finite unless some entry is not) decides; the elementwise
        checks, each building a mask over the logits and about 30 times dearer, run only then."""
        if math.isfinite(float(logits.sum())):
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

        → logits [1 + R, V] with new tokens (the root's row first), else [R, V]; float32
        """
        ran = len(token_ids) - first_node + 1
        try:
            self.sessions.make_room(session, (len(new_tokens) + ran) * self.kv_bytes_per_token, self.kv_bytes_per_token)
            new_tokens = self._prefill_blocks(session, new_tokens, 1)[0] if new_tokens else new_tokens
            with self._paced(len(new_tokens) + ran, session.cached_tokens):
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
        """Every solo pass computes each token exactly as any other pass would: per-row
        attention over every row and per-token (int8) Linear layers (specdec.engine.attention).
        Then every entry such a pass leaves is one a prefix cache may keep, and no prefill
        needs cutting into blocks."""
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
            logits = self._forward_admitted(session, token_ids[block_start - start : block_start - start + size], 1)
            session.aligned_tokens = block_start + size
        return token_ids[max(end - start, 0) :], logits

    def _forward_admitted(self, session: KVSession, token_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        started = time.perf_counter()
        start = session.cached_tokens
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.loaded.device)  # [1, N]
        cache_position = torch.arange(start, start + len(token_ids), device=self.loaded.device)  # [N]
        with self._paced(len(token_ids), start):
            out = self.model(
                input_ids=input_ids,
                **with_cache(self.model, session.cache),
                cache_position=cache_position,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
            self._synchronize()
        self.processed_tokens_total += len(token_ids)
        if self.per_token_exact and session.aligned_tokens == start:
            session.aligned_tokens = start + len(token_ids)  # a solo pass: exact, however it was cut
        logits = out.logits[0].float()  # [min(logits_to_keep, N), V]
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
            if trees is not None:
                return [
                    result_or_error(self.forward_tree, session, tokens, *tree)
                    for session, tokens, tree in zip(sessions, token_ids, trees)
                ]
            return [result_or_error(self.forward, *item) for item in zip(sessions, token_ids, logits_to_keep)]
        results: list[torch.Tensor | Exception | None] = [None] * len(sessions)
        token_ids = list(token_ids)  # the blocks run ahead (_prefill_blocks) shorten an item
        admitted: list[int] = []
        pending_bytes = 0
        for index, (session, tokens) in enumerate(zip(sessions, token_ids)):
            extra_bytes = (len(tokens) + (len(trees[index][0]) if trees is not None else 0)) * self.kv_bytes_per_token
            if (refused := self._make_room(session, extra_bytes, pending_bytes)) is not None:
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
        if not admitted:
            return results  # type: ignore[return-value]
        chosen = [sessions[i] for i in admitted]
        try:
            if trees is not None:
                outputs = self._forward_padded_tree(
                    chosen, [token_ids[i] for i in admitted], [trees[i] for i in admitted]
                )
            elif len(admitted) == 1:
                outputs = [self._forward_admitted(chosen[0], token_ids[admitted[0]], logits_to_keep[admitted[0]])]
            else:
                outputs = self._forward_padded(
                    chosen, [token_ids[i] for i in admitted], [logits_to_keep[i] for i in admitted]
                )
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

    def _forward_padded(
        self, sessions: list[KVSession], token_ids: list[list[int]], logits_to_keep: list[int]
    ) -> list[torch.Tensor]:
        """One pass over B sessions. Row b of the padded sequence is

            [pad × (P - P_b)] [past_b: P_b cached] [new_b: N_b tokens] [pad × (N - N_b)]

        with P = max P_b and N = max N_b. Pads are masked out as keys; pad queries (at the end)
        still see their row's real tokens, so no attention row is empty (no NaN to leak).
        """
        device = self.loaded.device
        past = [session.cached_tokens for session in sessions]  # [B]
        new = [len(tokens) for tokens in token_ids]  # [B]
        batch, max_past, max_new = len(sessions), max(past), max(new)
        input_ids = torch.zeros(batch, max_new, dtype=torch.long, device=device)  # [B, N]; pad id 0 is never attended
        attention_mask = torch.zeros(batch, max_past + max_new, dtype=torch.long, device=device)  # [B, P + N]
        for row, tokens in enumerate(token_ids):
            input_ids[row, : new[row]] = torch.tensor(tokens, dtype=torch.long)
            attention_mask[row, max_past - past[row] : max_past + new[row]] = 1
        position_ids = (torch.tensor(past)[:, None] + torch.arange(max_new)).to(device)  # [B, N]
        kept = [min(keep, n) for keep, n in zip(logits_to_keep, new)]  # [B]
        width = max(kept)
        # Row b keeps its last `width` real positions (clamped at 0 for short rows: only its
        # last kept[b] are read), so the vocab-wide head runs on B · width positions, not B · N.
        logit_positions = (
            (torch.tensor(new)[:, None] - width + torch.arange(width)).clamp(min=0).to(device)
        )  # [B, width]
        # An accelerator's batched pass, its sessions' real tokens; the caches' padding and
        # splitting inside it, as device memory traffic (specdec.engine.pace).
        with self._paced(sum(new), sum(past)):
            cache = padded_cache(sessions, past, max_past, self.model.config)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **with_cache(self.model, cache),
                cache_position=torch.arange(max_past, max_past + max_new, device=device),
                use_cache=True,
                logits_to_keep=logit_positions,
            )
            for row, session in enumerate(sessions):
                session.cache = row_cache(cache, row, max_past - past[row], max_past + new[row])
            self._synchronize()
        self.processed_tokens_total += sum(new)
        self.batched_forwards += 1
        self.batched_sessions_total += batch
        self.max_batch_size_seen = max(self.max_batch_size_seen, batch)
        logits = out.logits  # [B, width, V]
        return [logits[row, width - kept[row] :].float() for row in range(batch)]  # each [kept_b, V]

    def _make_room(self, session: KVSession, extra_bytes: int, pending_bytes: int) -> Exception | None:
        """Makes room in the KV budget for `session` to grow by `extra_bytes`, beside the
        `pending_bytes` that the other sessions of the same pass add. A session that does not
        fit is ended, and its exception returned for its caller alone."""
        try:
            self.sessions.make_room(session, extra_bytes, self.kv_bytes_per_token, pending_bytes)
        except Exception as exc:  # noqa: BLE001 - handed back to that caller alone
            self.sessions.end(session.session_id)
            return exc
        return None

    def decode_batch(self, sessions: list[KVSession], steps: list[int]) -> tuple[DecodeBatch, list[Exception | None]]:
        """Sessions (distinct ids, each with a cache, empty for a prompt) that will run
        steps[b] tokens in all, a few in the first pass and one in each after, in one batch kept
        from pass to pass (DecodeBatch), which others may join between passes.

        Each session is admitted to the KV budget for its tokens up front, as `forward_batch`
        admits a pass; one that does not fit is ended and gets its exception (item b of the
        second list), and stays out of the batch. → (the batch, per session its failure or None)
        """
        batch = DecodeBatch(self)
        return batch, [batch.join(session, count) for session, count in zip(sessions, steps)]

    def _forward_padded_tree(
        self, sessions: list[KVSession], token_ids: list[list[int]], trees: list[tuple[list[int], list[int]]]
    ) -> list[torch.Tensor]:
        """One pass over B sessions' token trees. Row b is laid out as in `_forward_padded`,
        its new tokens followed by its N_b nodes; the 4D mask gives each row its left pad, its
        past, its new tokens (causal) and, for a node, its ancestors (specdec.engine.tree_pass). Each
        session keeps its past, new tokens and every node, as `forward_tree` leaves it."""
        past = [session.cached_tokens for session in sessions]  # [B]
        runs = [tokens + nodes for tokens, (nodes, _) in zip(token_ids, trees)]
        batch, max_past, width = len(sessions), max(past), max(len(run) for run in runs)
        dtype = next(self.model.parameters()).dtype
        dtype = dtype if dtype.is_floating_point else torch.float32
        input_ids = torch.zeros(batch, width, dtype=torch.long)  # [B, Q]; pads never attended
        mask = torch.full((batch, 1, width, max_past + width), torch.finfo(dtype).min, dtype=dtype)  # [B, 1, Q, P + Q]
        positions = torch.zeros(batch, width, dtype=torch.long)  # [B, Q]
        keep = max(len(nodes) for nodes, _ in trees) + 1
        logit_positions = torch.zeros(batch, keep, dtype=torch.long)  # [B, 1 + max N_b]
        for row, (tokens, (_, parents)) in enumerate(zip(token_ids, trees)):
            length = len(runs[row])
            input_ids[row, :length] = torch.tensor(runs[row])
            paths = ancestors(parents)
            row_mask = tree_attention_mask(paths, past[row], len(tokens), dtype)[0, 0]  # [Q_b, P_b + Q_b]
            mask[row, 0, :length, max_past - past[row] : max_past + length] = row_mask
            mask[row, 0, length:, max_past - past[row] : max_past + 1] = 0.0  # pad queries: no empty row
            positions[row, :length] = tree_position_ids(paths, past[row], len(tokens))[0]
            rows = torch.arange(len(tokens) - 1, length)  # the root and the nodes: [1 + N_b]
            logit_positions[row, : len(rows)] = rows
        with self._paced(sum(len(run) for run in runs), sum(past)):  # the caches' traffic inside, as above
            cache = padded_cache(sessions, past, max_past, self.model.config)
            out = self._tree_pass(input_ids, mask, positions, cache, logit_positions)
            for row, (session, run) in enumerate(zip(sessions, runs)):
                session.cache = row_cache(cache, row, max_past - past[row], max_past + len(run))
        results = []
        for row, (session, (nodes, parents)) in enumerate(zip(sessions, trees)):
            length = len(runs[row])
            session.tree = CachedTree(len(session.tokens), tuple(nodes), tuple(parents), len(nodes))
            results.append(out.logits[row, : len(nodes) + 1].float())  # [1 + N_b, V]
        self.processed_tokens_total += sum(len(run) for run in runs)
        self.batched_forwards += 1
        self.batched_sessions_total += batch
        self.max_batch_size_seen = max(self.max_batch_size_seen, batch)
        return results

    def _tree_pass(self, input_ids, mask, positions, cache, logit_positions):
        """The model over a batch of token trees (laid out by `_forward_padded_tree`)."""
        device = self.loaded.device
        out = self.model(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            **with_cache(self.model, cache),
            use_cache=True,
            logits_to_keep=logit_positions.to(device),
        )
        self._synchronize()
        return out


def kv_bytes_per_token(model) -> int:
    """Key + value bytes one token adds to a DynamicCache: 2 · layers · KV heads · head dim ·
    element size (the cache holds activations, float32 for an int8-quantised model)."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=model.dtype).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * element


class DecodeBatch:
    """Sessions stepping together in one padded batch kept from pass to pass
    (ModelRunner.decode_batch), which sessions join and leave between passes: iteration-level
    batching, as Orca and vLLM schedule. Row b holds, column by column,

        [pad …] [past_b: its cache when it joined] [each pass since: its tokens, right-padded to the pass's widest row]

    and `_mask` [B, W] marks its real entries, so pads (before a past; after a row's tokens in
    a pass where another row ran more) are never attended as keys. A pass's pad queries see
    their row's real entries, so no attention row is empty (no NaN to leak). Positions count
    each row's real entries only.

    A session's cache is padded in once, at the first pass after it joins, and split back
    once, when it leaves (`leave`, `close`): a pass of `forward_batch` copies every session's
    cache in and out instead, a copy per layer and session on each side of every pass.
    Joining, and dropping the rows that left, run inside the next pass's emulated time
    (specdec.engine.pace), as a device's memory traffic would; a split runs on the host.
    """

    def __init__(self, runner: ModelRunner):
        self._runner = runner
        self.sessions: list[KVSession] = []  # [B] the rows, in order
        self._lengths: list[int] = []  # [B] real entries each row holds: its next position
        self._cache: DynamicCache | None = None  # per layer [B, H, W, D]; None before the first pass
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=runner.loaded.device)  # [B, W]: 1 at real entries
        self._joining: list[KVSession] = []  # padded in at the next pass
        self._left: set[int] = set()  # rows split back already, dropped at the next pass
        self._reserved: dict[str, int] = {}  # KV bytes each session was admitted to grow by
        self._failed = False

    def join(self, session: KVSession, new_tokens: int) -> Exception | None:
        """Admits `session` (one with a cache, empty for a prompt; no other session of the
        batch has its id) to grow by `new_tokens` in this batch, beside what the batch's other
        sessions were admitted for, as `forward_batch` admits a pass; it joins at the next
        pass. One that does not fit is ended and its exception returned, for its caller alone."""
        extra_bytes = new_tokens * self._runner.kv_bytes_per_token
        failure = self._runner._make_room(session, extra_bytes, sum(self._reserved.values()))
        if failure is None:
            self._joining.append(session)
            self._reserved[session.session_id] = extra_bytes
        return failure

    @torch.inference_mode()
    def step(self, feeds: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """One pass: every session in the batch (by id) runs its tokens, at least one each.
        → each one's logits [V] at its last token (float32). A failed pass ends every session
        of the batch and raises."""
        runner, device = self._runner, self._runner.loaded.device
        members = [session for row, session in enumerate(self.sessions) if row not in self._left] + self._joining
        if self._failed or sorted(feeds) != sorted(s.session_id for s in members) or not all(feeds.values()):
            raise AssertionError("a decode batch steps each of its sessions, one token or more, until a pass fails")
        new = sum(len(tokens) for tokens in feeds.values())
        try:
            context = sum(session.cached_tokens for session in self._joining) + sum(
                length for row, length in enumerate(self._lengths) if row not in self._left
            )
            with runner._paced(new, context):
                self._regroup()
                rows = [feeds[session.session_id] for session in self.sessions]  # B × [N_b]
                batch, width = len(rows), max(len(tokens) for tokens in rows)
                input_ids = torch.zeros(
                    batch, width, dtype=torch.long, device=device
                )  # [B, N]; pad id 0 is never attended
                block = torch.zeros(batch, width, dtype=torch.long, device=device)  # [B, N]: 1 at real tokens
                for row, tokens in enumerate(rows):
                    input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
                    block[row, : len(tokens)] = 1
                positions = (torch.tensor(self._lengths)[:, None] + torch.arange(width)).to(device)  # [B, N]
                start = self._mask.shape[1]
                self._mask = torch.cat([self._mask, block], dim=1)  # [B, W + N]
                last = torch.tensor([[len(tokens) - 1] for tokens in rows], device=device)  # [B, 1]
                out = runner.model(
                    input_ids=input_ids,
                    attention_mask=self._mask,
                    position_ids=positions,
                    **with_cache(runner.model, self._cache),
                    cache_position=torch.arange(start, start + width, device=device),
                    use_cache=True,
                    logits_to_keep=last,
                )
                runner._synchronize()
        except BaseException:
            self._failed = True
            for session in [*self.sessions, *self._joining]:  # a half-updated batch cannot be split back
                runner.sessions.end(session.session_id)
            raise
        self._lengths = [length + len(tokens) for length, tokens in zip(self._lengths, rows)]
        runner.processed_tokens_total += new
        runner.batched_forwards += 1
        runner.batched_sessions_total += batch
        runner.max_batch_size_seen = max(runner.max_batch_size_seen, batch)
        logits = out.logits[:, -1].float()  # [B, V]
        return {session.session_id: logits[row] for row, session in enumerate(self.sessions)}

    def _regroup(self) -> None:
        """Drops the rows that left and the columns no row holds any more, then pads in the
        sessions that joined (widening every row on the left where a newcomer's past is longer)."""
        layers = [] if self._cache is None else _tensors(self._cache)
        if self._left:
            kept = [row for row in range(len(self.sessions)) if row not in self._left]
            index = torch.tensor(kept, dtype=torch.long, device=self._mask.device)
            self._mask = self._mask.index_select(0, index)
            held = self._mask.any(dim=0)  # [W]
            first = int(held.int().argmax()) if bool(held.any()) else self._mask.shape[1]
            self._mask = self._mask[:, first:]
            layers = [
                (keys.index_select(0, index)[:, :, first:], values.index_select(0, index)[:, :, first:])
                for keys, values in layers
            ]
            self.sessions = [self.sessions[row] for row in kept]
            self._lengths = [self._lengths[row] for row in kept]
            self._left = set()
        if self._joining:
            past = [session.cached_tokens for session in self._joining]
            width = max(self._mask.shape[1], *past)
            if layers and width > self._mask.shape[1]:  # widen the rows already here
                grow = width - self._mask.shape[1]
                self._mask = torch.nn.functional.pad(self._mask, (grow, 0))
                layers = [
                    (torch.nn.functional.pad(k, (0, 0, grow, 0)), torch.nn.functional.pad(v, (0, 0, grow, 0)))
                    for k, v in layers
                ]
            if any(past):
                pairs = _tensors(padded_cache(self._joining, past, width, self._runner.model.config))
            else:  # prompts: rows of pads only (none if nothing is cached yet: the pass makes it)
                pairs = [(_pad_rows(k, len(past), width), _pad_rows(v, len(past), width)) for k, v in layers]
            layers = (
                [(torch.cat([k, nk]), torch.cat([v, nv])) for (k, v), (nk, nv) in zip(layers, pairs)]
                if layers
                else pairs
            )
            mask = torch.zeros(len(past), width, dtype=torch.long, device=self._mask.device)
            for row, length in enumerate(past):
                mask[row, width - length :] = 1
            self._mask = torch.cat([self._mask, mask]) if self._mask.numel() else mask
            self.sessions += self._joining
            self._lengths += past
            self._joining = []
        self._cache = plain_cache(layers) if layers else DynamicCache(config=self._runner.model.config)

    @torch.inference_mode()
    def leave(self, session_id: str) -> None:
        """Hands the session its cache now: a copy of its row's real entries, its past and
        every token it ran (the batch's tensors are not kept alive by it). Its row is dropped at
        the next pass. One that joined and never ran leaves as it came; nothing to do after a
        failed pass (every session was ended)."""
        self._reserved.pop(session_id, None)
        if any(session.session_id == session_id for session in self._joining):
            self._joining = [session for session in self._joining if session.session_id != session_id]
            return
        row = next(row for row, session in enumerate(self.sessions) if session.session_id == session_id)
        if self._failed or row in self._left:
            return
        self._left.add(row)
        if self._cache is None:
            return
        real = self._mask[row].nonzero().squeeze(1)  # [L_b] the row's columns
        layers: list = self._cache.layers
        self.sessions[row].cache = plain_cache(
            (layer.keys[row : row + 1].index_select(2, real), layer.values[row : row + 1].index_select(2, real))
            for layer in layers
        )

    def close(self) -> None:
        """Every session still in the batch leaves (`leave`)."""
        for session in [*self.sessions, *self._joining]:
            self.leave(session.session_id)
        self._cache = None


def _pad_rows(like: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Zeros for `rows` rows of `width` entries, shaped as batch tensor `like` [B, H, W, D]."""
    return like.new_zeros(rows, like.shape[1], width, like.shape[3])


def _tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer of a cache of plain full-attention layers (batchable_cache)."""
    layers: list[Any] = cache.layers  # transformers types a layer as any cache kind's
    return [(layer.keys, layer.values) for layer in layers]
