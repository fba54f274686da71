"""The target model side: score the draft tokens in one forward pass and sample what the
coordinator needs for exact rejection sampling; concurrent sessions can share that pass."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

import torch

from specdec.engine.batching import batch_groups, call_waves, start_each, stopping, untraced_if_refused
from specdec.engine.calls import Stopwatch, check_trees
from specdec.engine.features import FeatureTap, check_feature_layers, decoder_parts
from specdec.engine.runner import ModelRunner
from specdec.errors import InvalidArgument
from specdec.sampling.probs import SamplingParams, rows_on
from specdec.sampling.together import together_pays, verify_outputs_together
from specdec.sampling.tree_sampling import MAX_TREE_NODES, ancestors
from target_service.verification import (
    Admitted,
    Verification,
    VerifyCall,
    conclude_chain,
    conclude_tree,
    needs_draft_probs,
    next_step,
)

logger = logging.getLogger(__name__)


class TargetRunner(ModelRunner):
    needs_draft_probs = staticmethod(needs_draft_probs)

    def verify_one(self, call: VerifyCall) -> Verification:
        """One session's round, in a forward pass of its own (two when it carries a prefill)."""
        admitted = self._admit(call)
        return self._conclude(admitted, self._forward_round(admitted), batch_size=1)

    def verify_then_steps(
        self,
        first: VerifyCall,
        seeds: list[int],
        stop_token_ids: Collection[int],
        yield_now: Callable[[], bool],
    ) -> tuple[Verification, list[Verification]]:
        """`verify_one(first)` and then `verify_steps` after it, in one job of the model thread:
        a target-only call's first token and its steps without a trip to the event loop. Where
        `yield_now()` already says so after the first token, no step runs (the caller runs them),
        as when the steps were a job of their own behind it."""
        result = self.verify_one(first)
        if yield_now():
            return result, []
        return result, self.verify_steps(first, result, seeds, stop_token_ids, yield_now)

    def verify_steps(
        self,
        first: VerifyCall,
        after: Verification,
        seeds: list[int],
        stop_token_ids: Collection[int],
        yield_now: Callable[[], bool],
    ) -> list[Verification]:
        """Target-only steps after `after` in one job of the model thread, each the
        `verify_one` call a step makes alone (`first` feeding the last token, with the step's
        seed): the same passes and tokens, without a trip to the event loop between them.
        Stops after `seeds`, before feeding a stop token, or once `yield_now()` says another
        call waits (the caller runs the rest); runs at least one step unless stopped."""
        steps: list[Verification] = []
        last = after
        for seed in seeds:
            if last.bonus_token_id in stop_token_ids or steps and yield_now():
                break
            last = self.verify_one(next_step(first, last, seed))
            steps.append(last)
        return steps

    def _forward_round(self, admitted: Admitted) -> torch.Tensor:
        if admitted.call.parents:
            return self._forward_tree_round(admitted)
        if not admitted.call.feature_layers:
            return self._forward_chain_round(admitted)
        tap = FeatureTap(self.model, admitted.call.feature_layers)
        with tap.recording():
            logits = self._forward_chain_round(admitted)
        admitted.features = tap.rows().to(self.model.dtype)  # [N, F]
        return logits

    def _forward_tree_round(self, admitted: Admitted) -> torch.Tensor:
        """Logits [N + 1, V] of the last committed token (the root) and the N tree nodes, in
        one pass with a tree mask (specdec.engine.tree_pass); committed tokens before the root run
        first, as in a chain round. The nodes stay cached behind the committed sequence until
        the next call keeps the accepted path (KVSession.tree)."""
        call, pending = admitted.call, admitted.pending
        if len(pending) > 1:
            self.forward(admitted.session, pending[:-1], logits_to_keep=1)
        return self.forward_tree(admitted.session, pending[-1:], call.draft_token_ids, list(call.parents))

    def _forward_chain_round(self, admitted: Admitted) -> torch.Tensor:
        """Logits [K + 1, V] of the last committed token and the K drafts.

        Committed tokens before those (a prompt, a re-prefill) run first in a pass of their
        own, which is then the same pass whatever K is; the scored pass holds only the last
        committed token and the drafts, which the per-row attention computes exactly as
        one-token passes would (specdec.engine.attention). So a K = 4 run and a K = 0 run of the same
        request see bitwise the same logits on CPU. A per-token exact runner computes every
        token alike however its passes are cut: the whole round is one pass (a long prompt,
        ModelRunner._prefill_blocks' passes), as in a decoding loop's first step.
        """
        scored = len(admitted.call.draft_token_ids) + 1
        if len(admitted.pending) > scored and not self.per_token_exact:
            try:  # the budget check sees the whole round, as in a batched pass
                self.sessions.make_room(
                    admitted.session, len(admitted.pending) * self.kv_bytes_per_token, self.kv_bytes_per_token
                )
            except BaseException:
                self.sessions.end(admitted.session.session_id)
                raise
            self.forward(admitted.session, admitted.pending[:-scored], logits_to_keep=1)
            return self.forward(admitted.session, admitted.pending[-scored:], logits_to_keep=scored)
        return self.forward(admitted.session, admitted.pending, logits_to_keep=scored)

    def verify_batch(self, calls: list[VerifyCall]) -> list[Verification | Exception]:
        """Several sessions' rounds in as few forward passes as padding allows (usually one).

        Item i is what `verify_one(calls[i])` would return, or the exception it would raise:
        a bad call or unknown session fails alone. Two calls for the same session run one
        after the other, in order."""
        results: list[Verification | Exception | None] = [None] * len(calls)
        for wave in call_waves([(call.session_id,) for call in calls]):
            with self.sessions.sharing(calls[index].session_id for index in wave):  # none evicted for another
                admitted = start_each(wave, lambda index: self._admit(calls[index]), results)
                for entry in [entry for entry in admitted if entry[1].call.feature_layers]:
                    # Its features are read off its own pass (FeatureTap); it runs alone.
                    self._verify_group([entry], False, results)
                    admitted.remove(entry)
                # Chains and trees share passes among their own kind (a tree pass needs a 4D mask).
                for trees in (False, True):
                    kind = [entry for entry in admitted if bool(entry[1].call.parents) == trees]
                    # A chain's pending tokens hold its drafts; a tree's nodes come after them.
                    sizes = [len(item.pending) + (len(item.call.draft_token_ids) if trees else 0) for _, item in kind]
                    for group in batch_groups(sizes, self.max_padding_ratio):
                        self._verify_group([kind[position] for position in group], trees, results)
        return [untraced_if_refused(result) for result in results]  # type: ignore[misc]

    def _verify_group(
        self, members: list[tuple[int, Admitted]], trees: bool, results: list[Verification | Exception | None]
    ) -> None:
        """One pass for `members` (alone: exactly as verify_one); each result or error into `results`.
        A member whose caller left stops its prefill between passes (`stopping`), the others go on."""
        with stopping(self, {item.session.session_id: item.call.should_stop for _, item in members}):
            self._pass_group(members, trees, results)

    def _pass_group(
        self, members: list[tuple[int, Admitted]], trees: bool, results: list[Verification | Exception | None]
    ) -> None:
        if len(members) == 1:
            index, item = members[0]
            try:
                results[index] = self._conclude(item, self._forward_round(item), batch_size=1)
            except Exception as exc:  # noqa: BLE001 - handed back to that caller alone
                results[index] = exc
            return
        outputs = self.forward_batch(
            [item.session for _, item in members],
            [item.pending for _, item in members],
            [len(item.call.draft_token_ids) + 1 for _, item in members],
            [(item.call.draft_token_ids, list(item.call.parents)) for _, item in members] if trees else None,
        )
        together = self._conclude_together(members, outputs)
        for (index, item), logits in zip(members, outputs):
            if index in together:
                results[index] = together[index]
                continue
            if isinstance(logits, Exception):
                results[index] = logits
                continue
            try:
                results[index] = self._conclude(item, logits, batch_size=len(members))
            except Exception as exc:  # noqa: BLE001 - handed back to that caller alone
                results[index] = exc

    def _conclude_together(
        self, members: list[tuple[int, Admitted]], outputs: list[torch.Tensor | Exception]
    ) -> dict[int, Verification]:
        """The chains of one pass with the same settings, concluded together where it pays (specdec.sampling.
        together). Calls with penalties, relaxed acceptance, logprobs, distributions or features to return,
        and a group that fails together (a NaN: each call's check names it), are concluded alone."""
        groups: dict[SamplingParams, list[tuple[int, Admitted, torch.Tensor]]] = {}
        for (index, item), logits in zip(members, outputs):
            call = item.call
            alone = call.parents or call.params.penalizes or call.relaxed is not None or call.return_distributions
            if not (isinstance(logits, Exception) or alone or call.top_logprobs is not None or call.feature_layers):
                groups.setdefault(call.params, []).append((index, item, logits))
        concluded: dict[int, Verification] = {}
        paying = {params: group for params, group in groups.items() if together_pays([t for *_, t in group])}
        for params, group in paying.items():
            calls = [item.call for _, item, _ in group]
            try:
                stacked = torch.cat([logits for *_, logits in group])  # [R, V]
                rows = [rows_on(call.draft_probs, stacked.device) for call in calls if not params.greedy]
                drafts = torch.cat(rows) if rows else torch.empty(0)  # [Σ K, V]
                seeds = [call.seed for call in calls]
                drawn = verify_outputs_together(
                    params, stacked, drafts, [call.draft_token_ids for call in calls], seeds
                )
            except Exception:  # noqa: BLE001 - each call concluded alone, its error its own
                logger.warning("%d calls of one pass drawn alone: together failed", len(calls), exc_info=True)
                drawn = None
            for (index, item, _), outputs_of_call in zip(group, drawn or ()):
                concluded[index] = item.verification(
                    len(members),
                    draft_token_target_probs=outputs_of_call.draft_token_target_probs.tolist(),
                    recovered_token_ids=outputs_of_call.recovered_token_ids.tolist(),
                    bonus_token_id=outputs_of_call.bonus_token_id,
                    target_probs=None,
                )
        return concluded

    def _admit(self, call: VerifyCall) -> Admitted:
        """Checks the call, then rolls its session back to `keep_tokens` and appends its tokens."""
        num_draft = len(call.draft_token_ids)
        depth = num_draft
        if call.parents:
            if call.params.penalizes:
                raise InvalidArgument(
                    "penalties are set with draft_parents: a tree's nodes would need a history each; send a chain"
                )
            if call.relaxed is not None:
                raise InvalidArgument(
                    "relaxed is set with draft_parents: token trees are verified exactly only; send a chain, or "
                    "leave relaxed unset"
                )
            check_trees(self.trees, self.loaded.model_id)
            depth = self._check_tree(call)
        elif num_draft > self.max_speculative_tokens:
            raise InvalidArgument(
                f"{num_draft} draft tokens exceed the maximum of {self.max_speculative_tokens} per call"
            )
        if not call.new_tokens:
            raise InvalidArgument("new_tokens is empty; each call must append at least one committed token")
        if call.feature_layers:
            if call.parents:
                raise InvalidArgument("feature_layers is set with draft_parents: features come with a chain only")
            check_feature_layers(call.feature_layers, len(decoder_parts(self.model)[1]))
        if call.params.logit_bias and call.params.logit_bias[-1][0] >= self.loaded.vocab_size:
            raise InvalidArgument(
                f"logit_bias names token {call.params.logit_bias[-1][0]}; the vocabulary has "
                f"{self.loaded.vocab_size} ids"
            )
        if not call.greedy_fast_path and call.draft_probs.shape != (num_draft, self.loaded.vocab_size):
            raise InvalidArgument(
                f"draft distributions have shape {tuple(call.draft_probs.shape)}; expected ({num_draft}, "
                f"{self.loaded.vocab_size})"
            )
        self.check_tokens(call.new_tokens, "new_tokens")
        self.check_tokens(call.draft_token_ids, "draft tokens")
        self.check_length(call.keep_tokens + len(call.new_tokens) + depth)
        clock = Stopwatch()
        session = self.sessions.open(call.session_id, call.keep_tokens, call.cache_namespace)
        # A tree's nodes never join the sequence: the pass caches them behind it (KVSession.tree).
        if call.parents:
            pending = self.sessions.extend(session, call.keep_tokens, call.new_tokens)
        else:
            pending = self.sessions.extend(
                session, call.keep_tokens, call.new_tokens + call.draft_token_ids, scored=num_draft + 1
            )
        return Admitted(call, session, pending, clock)

    @staticmethod
    def _check_tree(call: VerifyCall) -> int:
        """The tree's depth, after checking its shape."""
        if len(call.parents) != len(call.draft_token_ids):
            raise InvalidArgument(
                f"{len(call.parents)} draft_parents for {len(call.draft_token_ids)} draft tokens: one each"
            )
        if len(call.parents) > MAX_TREE_NODES:
            raise InvalidArgument(f"a tree of {len(call.parents)} nodes exceeds the maximum of {MAX_TREE_NODES}")
        try:
            return max(len(path) for path in ancestors(call.parents))
        except ValueError as exc:
            raise InvalidArgument(f"draft_parents: {exc}") from None

    def _conclude(self, admitted: Admitted, logits: torch.Tensor, batch_size: int) -> Verification:
        """The call's Verification from its pass's logits (target_service.verification), after
        the finiteness check on their sum, which crossed with the outputs."""
        conclude = conclude_tree if admitted.call.parents else conclude_chain
        verification, total = conclude(admitted, logits, batch_size)
        self.check_logits(logits, admitted.call.session_id, total)
        return verification
