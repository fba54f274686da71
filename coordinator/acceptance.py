"""How a round's drafts are accepted: the rule its mode names (exact, or the lossy relaxed
opt-in), dispatched in one place (`CHAIN_RULES`), what each committed token's
log-probabilities are, and the shape a Verify reply must have for the round it answers.
Pure; no I/O."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.pair import PairInfo
from coordinator.requests import Job
from coordinator.state import Round, check_reply
from specdec.sampling.chain import RoundOutcome, decide_round
from specdec.sampling.relaxed import AcceptanceMode
from specdec.sampling.tree_sampling import TreeOutcome, decide_tree
from specdec.v1 import common_pb2, target_pb2

# A chain round's evidence, as decide_round takes it: [K] target probs, [K] draft probs, [K]
# coins, [K] recovered tokens, and the bonus token.
Chain = tuple[Sequence[float], Sequence[float], Sequence[float], Sequence[int], int]


def decide(
    round_: Round,
    verification: target_pb2.VerifyResponse,
    uniforms: list[float],
    mode: AcceptanceMode = AcceptanceMode.EXACT,
) -> RoundOutcome | TreeOutcome:
    """The round's accepted drafts and the token after them: tree rejection sampling for a
    tree (verified exactly only), a chain's by the rule of its `mode` (`round_mode`)."""
    proposed = len(round_.draft_token_ids)
    if round_.parents:  # multi-step speculative sampling (specdec.sampling.tree_sampling)
        return decide_tree(
            verification.draft_token_target_probs,
            round_.draft_token_draft_probs,
            uniforms[:proposed],
            round_.parents,
            verification.recovered_token_ids,
        )
    chain: Chain = (
        verification.draft_token_target_probs,
        round_.draft_token_draft_probs,
        uniforms[:proposed],
        verification.recovered_token_ids,
        verification.bonus_token_id,
    )
    return CHAIN_RULES[mode](chain, verification)


def _exact(chain: Chain, verification: target_pb2.VerifyResponse) -> RoundOutcome:
    return decide_round(*chain)


def _relaxed(chain: Chain, verification: target_pb2.VerifyResponse) -> RoundOutcome:
    """The exact rule, or the target's relaxed test on each draft (lossy: specdec.sampling.relaxed)."""
    return decide_round(*chain, relaxed_accepts=verification.relaxed_accepts)


# A chain round's acceptance rule by its mode: the one place a new mode is added (with what
# its verify carries, `verify_fields`, and what its reply must hold, `check_verification`).
CHAIN_RULES = {AcceptanceMode.EXACT: _exact, AcceptanceMode.RELAXED: _relaxed}


def committed_logprobs(
    outcome: RoundOutcome | TreeOutcome, verification: target_pb2.VerifyResponse
) -> list[common_pb2.TokenLogprobs]:
    """Each committed token's log-probabilities, in the order commit_round takes the tokens
    (the round's, then its steps'); [] where the call carried none. An accepted draft's come
    from its parent position (its own logprob, that position's top tokens), the token after
    them from the last position reached, whose own token it is."""
    if not verification.row_logprobs:
        return []
    if isinstance(outcome, TreeOutcome):
        positions, drafts = [0, *outcome.path], [node - 1 for node in outcome.path]
    else:
        positions, drafts = list(range(outcome.num_accepted + 1)), list(range(outcome.num_accepted))
    rows = verification.row_logprobs
    accepted = [
        common_pb2.TokenLogprobs(
            logprob=verification.draft_token_logprobs[draft],
            top_token_ids=rows[position].top_token_ids,
            top_logprobs=rows[position].top_logprobs,
        )
        for draft, position in zip(drafts, positions)
    ]
    return [*accepted, rows[positions[-1]], *verification.step_logprobs]


def round_mode(job: Job, round_: Round) -> AcceptanceMode:
    """The rule the round's drafts are verified under: the request's for a chain with drafts;
    exact for a tree (verified exactly only) and for a round without drafts (K = 0), which
    has nothing to relax."""
    return job.acceptance_mode if round_.draft_token_ids and not round_.parents else AcceptanceMode.EXACT


def check_verification(
    address: str,
    pair: PairInfo,
    round_: Round,
    verification: target_pb2.VerifyResponse,
    step_seeds: int,
    mode: AcceptanceMode,
    job: Job,
) -> None:
    """A Verify reply of the shape the round asked for (`step_seeds`: the further steps it
    asked for), or MalformedReply: a node never corrupts output."""
    proposed = len(round_.draft_token_ids)
    check_reply(address, "draft_token_target_probs", len(verification.draft_token_target_probs), proposed)
    # A tree's: one recovered token per node and the root.
    expected_recovered = proposed + 1 if round_.parents else proposed
    check_reply(address, "recovered_token_ids", len(verification.recovered_token_ids), expected_recovered)
    if mode is AcceptanceMode.RELAXED:  # a target that ignored VerifyRequest.relaxed sends none
        check_reply(address, "relaxed_accepts", len(verification.relaxed_accepts), proposed)
    # Fewer steps only after a stop token: a target that ignored the seeds would shift
    # the seed stream, and a seed would no longer give one output.
    steps, asked = verification.step_token_ids, step_seeds
    last = [verification.bonus_token_id, *steps][-1]
    if len(steps) > asked or (len(steps) < asked and last not in pair.eos_token_ids):
        check_reply(address, "step_token_ids", len(steps), asked)
    if job.top_logprobs is not None:  # a target that ignored return_logprobs sends none
        check_reply(address, "row_logprobs", len(verification.row_logprobs), proposed + 1)
        check_reply(address, "draft_token_logprobs", len(verification.draft_token_logprobs), proposed)
        check_reply(address, "step_logprobs", len(verification.step_logprobs), len(steps))
