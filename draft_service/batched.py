"""Several sessions' proposals stepped together (DraftRunner.propose_batch): waves of calls
that may share passes (a session's calls in order; a fork after the call it copies), passes
over as many of them as padding allows, and a decode batch that calls leave as they finish and
join between its passes (iteration-level batching), each answered as soon as it is done.

How one step drafts (a pass's logits to a token and its distribution) is the runner's
(draft_service.runner); this module only decides which calls share which passes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from draft_service.drafter import Proposal, ProposeCall
from specdec.engine.attention import BATCHES
from specdec.engine.batched_pass import DecodeBatch
from specdec.engine.batching import batch_groups, call_waves, result_or_error, start_each, stopping, untraced_if_refused
from specdec.engine.rows import MAX_ROWS
from specdec.errors import SpecDecError
from specdec.sampling.probs import RowSupport, logits_to_probs, one_hot_at, row_argmax, sample, support_of, top_k_parts
from specdec.sampling.together import together_pays
from specdec.sampling.transfer import fetch

if TYPE_CHECKING:
    from draft_service.stepping import DraftStepper, _Drafting

Answer = Callable[[int, Proposal | Exception], None]
Join = Callable[[int], list[ProposeCall]]


class ProposalBatch:
    """One propose_batch: `calls` and their `results` by index (calls joined while it runs are
    appended to both), each result handed to `answer` as soon as it is known."""

    def __init__(
        self,
        runner: DraftStepper,
        propose_one: Callable[[ProposeCall], Proposal],
        calls: list[ProposeCall],
        answer: Answer | None,
        join: Join | None,
    ) -> None:
        self.runner = runner
        self.propose_one = propose_one  # a call that cannot share passes (a tree) runs alone
        self.calls = calls
        self.results: list[Proposal | Exception | None] = [None] * len(calls)
        self.answer = answer
        self.join = join

    def run(self) -> list[Proposal | Exception]:
        todo = list(range(len(self.calls)))
        while todo:  # calls that could not join the batch they arrived in run after it
            todo = self._waves(todo)
        return self.results  # type: ignore[return-value]

    def _waves(self, todo: list[int]) -> list[int]:
        """The calls `todo` indexes, in waves; → the joined calls to run next (the batch could
        not take them)."""
        calls = self.calls
        if any(calls[index].tree_widths for index in todo):
            # A tree grows by levels in passes with a tree mask, which a padded batch lacks.
            for index in todo:
                self._settle(index, result_or_error(self.propose_one, calls[index]))
            return []
        reads = [(calls[index].fork_from,) if calls[index].fork_from else () for index in todo]
        waves = call_waves([(calls[index].session_id,) for index in todo], reads)
        later: list[int] = []
        for number, wave in enumerate(waves):
            joins = self.join if number == len(waves) - 1 else None  # after every call already here
            later += self._run_wave([todo[i] for i in wave], joins)
        return later

    def _run_wave(self, wave: list[int], joins: Join | None) -> list[int]:
        """The calls `wave` indexes (distinct sessions), stepped in passes; → as `_waves`. While
        they start and step apart, none evicts another's session, or a parent it forks
        (SessionStore.sharing); a decode batch, which others join for as long as it runs, spares
        its members itself (DecodeBatch.join, SessionStore.hold)."""
        runner, calls = self.runner, self.calls
        with runner.sessions.sharing(
            name for index in wave for name in (calls[index].session_id, calls[index].fork_from)
        ):
            active = start_each(wave, lambda index: runner._begin(calls[index]), self.results)
            self._settle_failed(wave)
            while active := [item for item in active if not self._ended(*item)]:
                if all(runner._decodable(drafting) for _, drafting in active) and (
                    len(active) > 1 or joins is not None
                ):
                    break
                for group in batch_groups([len(drafting.feed) for _, drafting in active], runner.max_padding_ratio):
                    # A feed of more than MAX_ROWS (a prompt) runs alone, as it does alone: under
                    # SDPA where row-wise attention takes short passes and batches (int8_on_cpu).
                    long = [p for p in group if len(active[p][1].feed) > MAX_ROWS] if rows_batched(runner) else []
                    short = [position for position in group if position not in long]
                    for members in [[position] for position in long] + ([short] if short else []):
                        self._pass(active, members)
            else:
                return []
        return self._decode_together(active, joins)

    def _pass(self, active: list[tuple[int, _Drafting]], group: list[int]) -> None:
        """One pass over active[position] for each position in `group`, and a draw for each."""
        members = [active[position] for position in group]
        # A member whose caller left stops its prefill between passes, the others go on.
        with stopping(self.runner, {drafting.session.session_id: drafting.call.should_stop for _, drafting in members}):
            outputs = self.runner.forward_batch(
                [drafting.session for _, drafting in members],
                [drafting.feed for _, drafting in members],
                [1] * len(members),
            )
        stepped = []
        for (index, drafting), logits in zip(members, outputs):
            if isinstance(logits, Exception):
                self.results[index] = logits
                drafting.failed = True
            else:
                stepped.append((index, drafting, logits[-1]))
        step_all(self.runner, stepped, len(members), self.results)

    def _settle(self, index: int, result: Proposal | Exception) -> None:
        self.results[index] = untraced_if_refused(result)  # held while the batch runs (see there)
        if self.answer is not None:
            self.answer(index, result)

    def _settle_failed(self, indices: list[int]) -> None:
        """Answers the calls that failed to start (their exception is in `results`)."""
        for index in indices:
            result = self.results[index]
            if result is not None:
                self._settle(index, result)

    def _ended(self, index: int, drafting: _Drafting, leave: Callable[[], None] | None = None) -> bool:
        """Whether the call is over: failed (its exception in `results`), or done and its
        proposal in `results`; either is given to `answer`, after `leave()` (a decode batch
        handing its session's cache back, before its caller can call again)."""
        if not (drafting.failed or self.runner._done(drafting)):
            return False
        if leave is not None:
            try:
                leave()
            except SpecDecError as exc:  # its cache could not be handed back: ended, the call fails
                self._settle(index, exc)
                return True
        result = self.results[index] if drafting.failed else self.runner._finish(drafting)
        self._settle(index, cast(Proposal | Exception, result))
        return True

    def _decode_together(self, active: list[tuple[int, _Drafting]], join: Join | None) -> list[int]:
        """The calls' remaining steps in one DecodeBatch, each one token a session after its
        first (a round's tokens or a short prompt, `_decodable`): their caches are padded into
        a batch once and split back once, not at every step. A call that is done leaves the
        batch (its session's cache back) before it is answered, and calls from `join` enter it
        between passes. → the joined calls it could not take, to run after it (a call on a
        session still in the batch, a tree); from the first of them on, it takes no more, so it
        ends within K passes."""
        runner = self.runner
        batch, failures = runner.decode_batch(
            [drafting.session for _, drafting in active], [runner._tokens_left(drafting) for _, drafting in active]
        )
        members: dict[str, tuple[int, _Drafting]] = {}  # by session id
        for (index, drafting), failure in zip(active, failures):
            if failure is None:
                members[drafting.session.session_id] = (index, drafting)
            else:
                self._settle(index, failure)
        later: list[int] = []
        try:
            while True:
                for session_id, (index, drafting) in list(members.items()):
                    if self._ended(index, drafting, functools.partial(batch.leave, session_id)):
                        del members[session_id]
                if join is not None and not later:
                    for call in join(len(members)):
                        self.calls.append(call)
                        self.results.append(None)
                        if not self._admit(len(self.calls) - 1, members, batch):
                            later.append(len(self.calls) - 1)
                if not members:
                    return later
                logits = batch.step({session_id: drafting.feed for session_id, (_, drafting) in members.items()})
                stepped = [(index, drafting, logits[sid]) for sid, (index, drafting) in members.items()]
                step_all(runner, stepped, len(members), self.results)
        except Exception as exc:  # noqa: BLE001 - a failed pass ended every session of the batch
            for index, _ in members.values():
                self._settle(index, exc)
            return later
        finally:
            batch.close()

    def _admit(self, index: int, members: dict[str, tuple[int, _Drafting]], batch: DecodeBatch) -> bool:
        """Starts joined call `index` in the running decode batch: False if it must wait for
        the batch to end (its session, or the one it forks, is drafting in it; a tree). Its
        tokens run in the batch's next pass when `_decodable`; a longer prompt or a re-prefill
        runs in a pass of its own first."""
        call = self.calls[index]
        if call.tree_widths or call.session_id in members or call.fork_from in members:
            return False
        try:
            drafting = self.runner._begin(call)
        except Exception as exc:  # noqa: BLE001 - handed back to that caller alone
            self._settle(index, exc)
            return True
        while not self._ended(index, drafting):
            if self.runner._decodable(drafting):
                failure = batch.join(drafting.session, self.runner._tokens_left(drafting))
                if failure is None:
                    members[drafting.session.session_id] = (index, drafting)
                else:
                    self._settle(index, failure)
                return True
            self._pass([(index, drafting)], [0])
        return True


ARGMAX = "argmax"  # step_all: rows that take their argmax


def step_all(
    runner: DraftStepper, stepped: list[tuple[int, _Drafting, torch.Tensor]], batch_size: int, results: list
) -> None:
    """`DraftStepper._step` for each (index, drafting, logits [N]) of one pass. Rows drawn the same way
    are drawn together, a few tensor ops for the whole pass instead of a few per row: those
    that take their argmax (greedy, or a guessed first token), and sampled rows with the
    same settings (each with its own generator's next draw, as alone, cut to the draft's own
    top-k row by row). A row with a vocab limit runs alone; a row whose step fails gets its
    exception in `results` alone."""
    groups: dict[object, list[tuple[int, _Drafting, torch.Tensor]]] = {}
    for item in stepped:
        drafting = item[1]
        key: object = None  # alone
        if drafting.call.vocab_limit or drafting.guessing and drafting.call.guess_rank:
            pass
        elif drafting.deterministic or drafting.guessing:
            key = ARGMAX
        else:
            key = drafting.call.params
        groups.setdefault(key, []).append(item)
    for key, items in groups.items():
        # Sampled rows together only where that pays (on a CPU, small rows: 8 rows over Qwen's
        # 151,936 ids drew in 8.1 ms together against 4.8 ms alone on the 2-core AMD EPYC); argmax
        # rows always (8 such rows: 2.7 against 5.5 ms).
        together = key is ARGMAX or together_pays([logits for *_, logits in items])
        if key is not None and len(items) > 1 and together and step_together(runner, items, key is ARGMAX, batch_size):
            continue
        for index, drafting, logits in items:
            try:
                runner._step(drafting, logits, batch_size)
            except Exception as exc:  # noqa: BLE001 - handed back to that caller alone
                results[index] = exc
                drafting.failed = True


def step_together(
    runner: DraftStepper, items: list[tuple[int, _Drafting, torch.Tensor]], argmax: bool, batch_size: int
) -> bool:
    """`DraftStepper._step` for rows drawn alike (`step_all`): False, drawing nothing, when some logit
    is NaN or infinite, so that each row's own check names the bad one."""
    logits = torch.stack([row_logits for _, _, row_logits in items])  # [B, N]
    total = logits.sum()  # [] finite unless some logit is not
    generators = [drafting.generator for _, drafting, _ in items]
    states = [] if argmax else [generator.bit_generator.state for generator in generators]  # put back on a NaN
    parts: torch.Tensor | None = None
    if argmax:
        heads = row_argmax(logits)  # [B]
        head_probs = one_hot_at(logits, heads[:, None])  # [B, N]
        belief = torch.softmax(logits, dim=-1)  # [B, N] the draft's own view
    else:
        params = items[0][1].call.params
        head_probs, parts = top_k_parts(logits_to_probs(logits, params), runner.proposal_top_k)  # [B, N], [B, 2k + 1]
        belief = head_probs
        heads = sample(head_probs, generators)  # [B]
    count = max(drafting.call.runner_ups for _, drafting, _ in items)
    top = belief.topk(min(count + 1, belief.shape[-1]), dim=-1)  # [B, count + 1]
    # What the host needs, in one transfer from the device (transfer.fetch).
    finite, rows, drawn, top_ids, top_probs, *row_parts = fetch(
        total,
        heads,
        belief.gather(1, heads[:, None])[:, 0],
        top.indices,
        top.values,
        *(() if parts is None else (parts,)),
    )
    if not math.isfinite(finite[0]):
        for generator, state in zip(generators, states):
            generator.bit_generator.state = state
        return False
    width, span = top.indices.shape[1], 0 if parts is None else parts.shape[1]
    for b, ((_, drafting, _), row) in enumerate(zip(items, map(int, rows))):
        ids, probs = [int(i) for i in top_ids[b * width : (b + 1) * width]], top_probs[b * width : (b + 1) * width]
        runner_ups = runner._others(ids, probs, row, drafting.call.runner_ups)
        # The entries a sampled call sends: a guess's one id, a draw's top k (unknown without one).
        support: RowSupport | None = None
        if argmax and not drafting.deterministic:
            support = RowSupport.one_hot(row)
        elif parts is not None:
            support = support_of(row_parts[0][b * span : (b + 1) * span])
        runner._take(drafting, row, drawn[b], runner_ups, head_probs[b], support, batch_size)
    return True


def rows_batched(runner: DraftStepper) -> bool:
    """Rows of short passes and of padded batches attend row by row, a long lone pass under SDPA
    (attention.BATCHES: an int8 CPU draft's): a long run then runs alone, as it would alone."""
    return getattr(runner.model.config, "_attn_implementation", "") == BATCHES
