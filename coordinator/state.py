"""What the coordinator tracks per request: its record of each service's session, and a
round's drafts as the draft sent them (checked, so a malformed reply fails the request rather
than the output)."""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coordinator.text import Delta
from specdec.errors import InvalidArgument, SpecDecError
from specdec.rpc import wire
from specdec.sampling.tree_sampling import check_parents
from specdec.v1 import draft_pb2

if TYPE_CHECKING:
    from coordinator.clients import ServiceClient
    from coordinator.replica import Replica


@dataclass
class SessionView:
    """The coordinator's record of one service's session."""

    session_id: str
    synced: int = 0  # leading tokens of the committed sequence the service holds
    modeled: int = 0  # of those, at least the ones its model has run (a copy runs none): rounds.prefill_outweighs
    opened: bool = False
    calls: Iterator[int] = field(default_factory=lambda: itertools.count(1))  # numbers Propose calls (epochs)
    last_epoch: int = 0  # of the newest regular call sent
    min_confidence: float | None = None  # the request's draft confidence stop (None: the service's)
    vocab_limit: int = 0  # the draft proposes only ids below this (0: no limit; see PairInfo)
    replica: Replica | None = None  # where the session lives (coordinator.pools); None: nowhere yet
    reserved: int = 0  # KV bytes it may grow to, counted on its replica while there (Replica.room)
    lost: bool = False  # its replica failed a call: the session moves at the next round if it can
    moves: int = 0  # times it moved to another replica
    namespace: str = ""  # the request's cache namespace (Job.cache_namespace), sent with every call
    own_sequence_only: bool = False  # the draft copies from this request's text alone (a seeded sampled one)
    runner_ups: int = 0  # the draft's likeliest other tokens to send per position, to hedge on (0: one)

    @property
    def client(self) -> ServiceClient:
        assert self.replica is not None, "a session on no replica makes no call"
        return self.replica.client

    @property
    def address(self) -> str:
        return self.replica.address if self.replica is not None else "no replica"

    def passes_ms(self, fallback: tuple[float, ...]) -> tuple[float, ...]:
        """Its replica's calibrated passes (Replica.passes_ms), else `fallback`."""
        return self.replica.passes_ms(fallback) if self.replica is not None else fallback

    def draft_fields(self) -> dict:
        """ProposeRequest keywords every call on this session carries (min_confidence is
        optional, and unset means the service's default)."""
        fields: dict = {
            "vocab_limit": self.vocab_limit,
            "cache_namespace": self.namespace,
            "own_sequence_only": self.own_sequence_only,
            "runner_ups": self.runner_ups,
        }
        if self.min_confidence is not None:
            fields["min_confidence"] = self.min_confidence
        return fields


@dataclass
class DraftRefusals:
    """When to ask a draft that refused this request (RESOURCE_EXHAUSTED) again.

    A draft refuses when its sessions are all taken, which other requests ending will undo, or
    when this request's context alone exceeds its KV budget, which only grows. So the request
    runs target-only rounds and asks again after 4, 8, 16, ... (at most 64) of them: a freed
    slot is found within a few rounds of freeing, and a request too long for the draft costs
    one refused call (no model work) per back-off. A call the draft takes starts the back-off
    over.
    """

    FIRST_ROUNDS = 4
    MAX_ROUNDS = 64

    retry_at: int = 0  # the first round index at which the draft is asked again
    in_a_row: int = 0

    def refused(self, round_index: int) -> None:
        self.in_a_row += 1
        self.retry_at = round_index + min(self.FIRST_ROUNDS << (self.in_a_row - 1), self.MAX_ROUNDS)

    def accepted(self) -> None:
        self.in_a_row = 0

    def allow(self, round_index: int) -> bool:
        return round_index >= self.retry_at


class Source(enum.Enum):
    """Where a round's drafts came from (the round span's `specdec.round.drafts_from`)."""

    DRAFT = "draft"  # the round's own Propose call, drafted by the model
    COPY = "copy"  # the round's own Propose call, copied by prompt lookup
    PREDRAFT = "predraft"  # the pre-draft of the round before, kept because its guess was right
    HEDGE = "hedge"  # a hedge of the round before, kept because the round ended as it assumed
    CATCH_UP = "catch-up"  # none: a target-only step while the draft catches up
    FALLBACK = "fallback"  # none: the draft was down, refused or skipped
    NONE = "none"  # none: K = 0

    @property
    def in_draft_session(self) -> bool:
        """Whether the request's draft session holds the round's drafts (so it stays in step)."""
        return self in (Source.DRAFT, Source.COPY, Source.PREDRAFT, Source.HEDGE)


@dataclass
class Round:
    """A round's drafts as the draft sent them, and where they came from."""

    source: Source = Source.NONE
    draft_token_ids: list[int] = field(default_factory=list)
    draft_token_draft_probs: list[float] = field(default_factory=list)
    distributions: list = field(default_factory=list)
    # Per draft, the draft's likeliest other tokens and their probabilities, best first, for
    # hedging: [K][R]; empty when the draft sent none.
    runner_up_ids: list[list[int]] = field(default_factory=list)
    runner_up_probs: list[list[float]] = field(default_factory=list)
    copied: bool = False  # copied by the draft's prompt lookup, not drafted by its model
    parents: list[int] = field(default_factory=list)  # a token tree's parent nodes; empty: a chain
    foreign: tuple[int, ...] = ()  # positions of drafts a bridged draft does not share (round_from)

    def truncated(self, k: int, start: int = 0) -> Round:
        end = start + k
        return Round(
            self.source,
            self.draft_token_ids[start:end],
            self.draft_token_draft_probs[start:end],
            self.distributions[start:end],
            self.runner_up_ids[start:end],
            self.runner_up_probs[start:end],
            self.copied,
            foreign=tuple(position - start for position in self.foreign if start <= position < end),
        )  # chains only: the coordinator never pre-drafts or hedges a tree


@dataclass(frozen=True)
class Settled:
    """What a round's branch call left, read once the round's outcome was known
    (`coordinator.branches.Branches.settle`); `commit_round` applies it."""

    ready: Round | None = None  # the next round's drafts (source: pre-draft or hedge), or None
    draft_view: SessionView | None = None  # a used fork: the request's draft session from now on
    draft_synced: int | None = None  # what the request's draft session holds now, where a branch was used
    synced_at_least: int | None = None  # a pre-draft that ran but missed: its session holds at least this
    failed: bool = False  # the call, or its pre-draft, failed: the next round drafts afresh
    refused: bool = False  # of those, RESOURCE_EXHAUSTED: the draft cannot hold the request now
    rescued: bool | None = None  # a hedged round's rejection: whether a hedge assumed it (None: no rejection)
    # A catch-up's pre-draft: whether its own guess (the draft's likeliest token) was the step's
    # token, the one trial of the draft such a round makes (None: not a catch-up, or it failed).
    guessed: bool | None = None
    slack_ms: float | None = None  # how long before the verify the pre-draft's call replied (PredraftDepth)
    predraft_full: bool = True  # that pre-draft took k + 1 steps (PredraftDepth.steps)
    # A pre-drafting call of two rows or more: (rows, steps, ms from its send to its reply), for
    # the coordinator's row cost (coordinator.overlap.RowCost, learned as the request ends).
    timing: tuple[int, int, float] | None = None
    features_end: int = 0  # the call delivered the request's pending features before this position


@dataclass(frozen=True)
class RoundRecord:
    """A committed round, as its observers (GenerationStats, the span) read it."""

    source: Source
    proposed: int
    accepted: int
    bonus: bool  # it ended in a bonus token, not a recovered one
    tree: bool
    copied: bool
    foreign: int  # drafts a bridged draft does not share with the target
    relaxed_positions: tuple[int, ...]  # of the accepted drafts, those the exact rule rejected
    steps: int  # further target-only steps committed
    finished: bool
    delta: Delta  # the text and tokens the round added, to send
    # Of its own tokens (the accepted drafts, then the next token), those the output took: fewer
    # where the generation ended inside the round (EOS, a stop string, max_new_tokens).
    emitted: int


def round_from(
    proposal: draft_pb2.ProposeResponse,
    k: int,
    address: str,
    vocab_size: int,
    source: Source = Source.DRAFT,
    proposable: bytes = b"",
) -> Round:
    """The drafts of a Propose reply (or a branch's: `source`), checked against what was asked.
    `proposable`: PairInfo.draft_proposable, the ids a draft with its own tokenizer shares."""
    if len(proposal.token_ids) > k:
        raise MalformedReply(
            f"service at {address} proposed {len(proposal.token_ids)} tokens for K={k}; the reply is malformed"
        )
    check_reply(address, "distributions", len(proposal.distributions), len(proposal.token_ids))
    runner_up_ids, runner_up_probs = _runner_ups(proposal, address)
    try:
        draft_probs = [wire.token_probability(d, t) for d, t in zip(proposal.distributions, proposal.token_ids)]
    except InvalidArgument as exc:
        raise MalformedReply(f"draft service at {address} sent a malformed distribution: {exc}") from None
    foreign: list[int] = []  # positions of tokens a bridged draft does not share with the target
    for position, (token, prob) in enumerate(zip(proposal.token_ids, draft_probs)):
        # u * 0 < target_prob would accept the token with probability 1, and NaN would never
        # accept it: either way the output would stop being the target's distribution.
        if not 0 <= token < vocab_size:
            raise MalformedReply(
                f"draft service at {address} proposed token {token} at position {position}, outside the target's "
                f"vocabulary [0, {vocab_size}); the reply is malformed"
            )
        if not 0.0 < prob <= 1.0 + 1e-5:
            raise MalformedReply(
                f"draft service at {address} proposed token {token} at position {position} with "
                f"probability {prob} under the distribution it sent with it; a drafter can only propose tokens "
                "its distribution gives mass, so the reply is malformed"
            )
        # A target id the bridged draft does not share (a bug, or a hostile draft) is verified
        # with the distribution it came with, like any draft. Discarding the round instead
        # would make which rounds survive depend on the draws (issue 65: with q = (a .5, f .5)
        # and p = (a .2, b .6, f .2), (a .3, b .6, f .1) would come out).
        if proposable and not (token >> 3 < len(proposable) and proposable[token >> 3] >> (token & 7) & 1):
            foreign.append(position)
    if proposal.parents:
        check_reply(address, "parents", len(proposal.parents), len(proposal.token_ids))
        try:
            check_parents(proposal.parents)
        except ValueError as exc:
            raise MalformedReply(f"draft service at {address} sent a malformed tree: {exc}") from None
    return Round(
        Source.COPY if source is Source.DRAFT and proposal.copied else source,
        list(proposal.token_ids),
        draft_probs,
        list(proposal.distributions),
        runner_up_ids,
        runner_up_probs,
        proposal.copied,
        list(proposal.parents),
        tuple(foreign),
    )


def _runner_ups(proposal: draft_pb2.ProposeResponse, address: str) -> tuple[list[list[int]], list[list[float]]]:
    """A reply's runner-ups per position ([K][R]): optional, but whole if sent, the same
    number R for every position (an older draft sends one each, whatever was asked)."""
    ids, probs, proposed = proposal.runner_up_token_ids, proposal.runner_up_probs, len(proposal.token_ids)
    if not (ids or probs):
        return [], []
    each = len(ids) // proposed if proposed else 0
    if not 1 <= each <= wire.MAX_RUNNER_UPS or len(ids) != each * proposed or len(probs) != len(ids):
        raise MalformedReply(
            f"service at {address} sent {len(ids)} runner_up_token_ids and {len(probs)} runner_up_probs for "
            f"{proposed} proposed tokens; expected as many of each, 1 to {wire.MAX_RUNNER_UPS} per token; the "
            "reply is malformed"
        )
    return (
        [list(ids[i : i + each]) for i in range(0, len(ids), each)],
        [list(probs[i : i + each]) for i in range(0, len(probs), each)],
    )


class MalformedReply(SpecDecError):
    """A draft's reply that cannot be verified exactly (a token outside the target's
    vocabulary or without mass under its own distribution), or a node's reply of the wrong
    shape: it fails the request, counted in specdec_malformed_replies. A node never corrupts
    output."""


def check_reply(address: str, field_name: str, got: int, expected: int) -> None:
    """A node that answers with the wrong shape fails the request; it never corrupts output."""
    if got != expected:
        raise MalformedReply(
            f"service at {address} returned {got} {field_name} for K={expected}; the reply is malformed"
        )


@dataclass(frozen=True)
class RetryWindow:
    """How long a call to an unavailable target is retried: `for_s` from its first failure (as
    long as a service may take to restart; a generation may be older than that), never past
    `until` (loop time: in time to tell the client before its deadline)."""

    for_s: float
    until: float = math.inf

    def give_up(self, now: Callable[[], float]) -> Callable[[int], bool]:
        """`retry_unavailable`'s give_up for one call, its window opened at its first failure."""
        opened: list[float] = []

        def check(attempts: int) -> bool:
            if not opened:
                opened.append(now())
            return now() >= min(opened[0] + self.for_s, self.until)

        return check
