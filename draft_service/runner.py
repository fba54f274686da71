"""The model drafter: propose K tokens autoregressively, each with its exact distribution,
one session at a time, several sessions stepped together (draft_service.batched) or as a tree
(draft_service.trees). How a step drafts is draft_service.stepping's."""

from __future__ import annotations

from collections.abc import Callable

from draft_service.batched import ProposalBatch
from draft_service.drafter import Proposal, ProposeCall
from draft_service.stepping import DraftStepper
from draft_service.trees import propose_tree

__all__ = ["DraftRunner", "ProposeCall"]


class DraftRunner(DraftStepper):
    """The model drafter the draft service runs (its settings: DraftStepper)."""

    shares_passes = True  # a `Drafter` whose calls from several sessions can step in one pass

    def propose_one(self, call: ProposeCall) -> Proposal:
        """One session's proposal, in forward passes of its own."""
        if call.tree_widths:
            return self.propose_tree(call)
        drafting = self._begin(call)
        while not self._done(drafting):
            self._step(drafting, self.forward(drafting.session, drafting.feed, logits_to_keep=1)[-1], batch_size=1)
        return self._finish(drafting)

    def propose_batch(
        self,
        calls: list[ProposeCall],
        answer: Callable[[int, Proposal | Exception], None] | None = None,
        join: Callable[[int], list[ProposeCall]] | None = None,
    ) -> list[Proposal | Exception]:
        """Several sessions' proposals stepped together: each draft step runs every unfinished
        call in one pass (as few as padding allows: a long prompt's prefill gets its own).

        Item i is what `propose_one(calls[i])` would return (up to float rounding of the
        batched pass, and the tokens drawn from it: each call reports the distribution its
        tokens were drawn from, which is all exactness needs), or the exception it would raise.
        Calls on the same session run one after the other, in order; a fork listed before a
        call on its parent shares that call's passes (it copies the parent first), one listed
        after it waits for it.

        `answer(i, result)`, if given, is called as soon as call i's result is known, while the
        batch steps on for the others (CallBatcher, answers_early). `join(held)`, if given,
        hands over calls that arrived since the batch began (CallBatcher, joins; `held`: the
        calls in the running decode batch): they join it between its passes (iteration-level
        batching), so no call waits for a batch's longest call to end. The j-th call joined is
        item len(calls) + j of the result, and is answered through `answer`.
        """
        return ProposalBatch(self, self.propose_one, list(calls), answer, join).run()

    def propose_tree(self, call: ProposeCall) -> Proposal:
        """A token tree (draft_service.trees)."""
        return propose_tree(self, call)
