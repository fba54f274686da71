"""How the model drafter drafts a step (DraftStepper, the base of draft_service.runner's
DraftRunner): a call's session opened and rolled back, a pass's logits turned into a token
and the exact distribution it was drawn from, copies by prompt lookup, the confidence stop,
a reduced or another tokenizer's vocabulary. Which calls share which passes is
draft_service.batched's; trees are draft_service.trees'."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from draft_service.drafter import Proposal, ProposeCall, check_confidence, stops_on_confidence
from draft_service.ngram import Lookup, check_call_sizes, copied_proposal, copy_tail
from draft_service.vocab_bridge import VocabBridge
from specdec.engine.calls import ModelDescription, Stopwatch, check_sequence
from specdec.engine.kv import batchable_cache
from specdec.engine.memory import MemoryShare
from specdec.engine.modeling import LoadedModel
from specdec.engine.prefix_cache import DEFAULT_PREFIX_BLOCK_TOKENS
from specdec.engine.runner import ModelRunner
from specdec.engine.sessions import KVSession
from specdec.errors import InvalidArgument, ResourceExhausted
from specdec.sampling.probs import RowSupport, logits_to_probs, one_hot_at, row_argmax, sample, support_of, top_k_parts
from specdec.sampling.transfer import fetch, to_device

PROPOSAL_MODES = ("sample", "greedy")
# The service's top-k: sampled rows ship sparse, 2 KiB a token, not 0.6 MB dense (bench.draft_truncation: its cost).
PROPOSAL_TOP_K = 256


@dataclass
class _Drafting:
    """A proposal under way: its session holds the committed tokens and the drafts so far."""

    call: ProposeCall
    session: KVSession
    feed: list[int]  # tokens the cache has not seen yet: [N]
    deterministic: bool
    generator: np.random.Generator  # the call's draws (seeded with its whole seed)
    clock: Stopwatch
    limit: int  # the drafts it may make: num_tokens, fewer where the KV budget holds fewer (_room)
    token_ids: list[int] = field(default_factory=list)  # [k]
    rows: list[torch.Tensor] = field(default_factory=list)  # k × [V]
    supports: list[RowSupport | None] = field(default_factory=list)  # k × (its non-zero entries, or None)
    runner_up_ids: list[int] = field(default_factory=list)
    runner_up_probs: list[float] = field(default_factory=list)
    processed: int = 0
    batch_size: int = 1
    failed: bool = False
    min_confidence: float = 0.0
    unsure: bool = False  # the last token was drawn with less than min_confidence
    looked_up: bool = False  # the tokens were copied by prompt lookup: no pass, one-hot rows

    @property
    def guessing(self) -> bool:
        """This step's token is a guess, not a draw (ProposeRequest.guess_first)."""
        return self.call.guess_first and not self.token_ids


class DraftStepper(ModelRunner):
    """Proposals follow the request's sampling settings, then the draft's own policy:
    `proposal_mode="greedy"` proposes the draft's argmax (one-hot), `proposal_top_k` truncates
    (0: the full distribution, shipped dense). The service runs the defaults; tests set others.
    Either only changes how often the target accepts, never what the output distribution is,
    because the target sees the exact distribution each token came from.

    `head_ids` ([N] int64, ascending) means the model's output head was restricted to those
    token ids (see `modeling.restrict_output_head`): its logits are [N], and every proposal
    distribution is zero outside `head_ids`, which the sparse wire form carries exactly.

    `bridge` (draft_service.vocab_bridge) makes it a draft for a target with another
    tokenizer: calls and proposals speak the target's ids, the model its own; `head_ids` are
    then the shared tokens, and each head row proposes the target id `bridge.caller_ids` gives.

    `lookup` = (min_n, max_n) makes it a hybrid drafter: a call whose sequence ends in an
    n-gram (n from max_n down to min_n) that occurred earlier proposes the tokens that followed
    it (draft_service.ngram.lookup), at the cost of a search instead of K forward passes; any
    other call drafts with the model. Why this stays exact: which source proposes is decided
    from the session's sequence alone, before the target's coins exist, and a looked-up token
    travels with the distribution it was drawn from, one-hot at itself, so the target accepts
    it with exactly its own probability of that token and otherwise samples its residual.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        max_sessions: int,
        session_ttl_s: float,
        max_speculative_tokens: int,
        proposal_mode: str = "sample",
        proposal_top_k: int = PROPOSAL_TOP_K,
        head_ids: torch.Tensor | None = None,
        max_kv_bytes: int | MemoryShare = 0,
        min_confidence: float = 0.0,
        lookup: Lookup | None = None,
        prefix_cache_bytes: int = 0,
        prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS,
        bridge: VocabBridge | None = None,
    ):
        super().__init__(
            loaded,
            max_sessions,
            session_ttl_s,
            max_speculative_tokens,
            max_kv_bytes,
            prefix_cache_bytes,
            prefix_block_tokens,
        )
        self.lookup = lookup
        self.looked_up_proposals = 0  # hybrid: proposals copied by prompt lookup
        check_confidence(min_confidence)
        self.min_confidence = min_confidence
        self.confidence_stops = 0  # proposals cut short by a low-confidence token
        self.head_ids = None if head_ids is None else head_ids.to(loaded.device)  # [N]
        self.bridge = bridge
        if bridge is not None and (head_ids is None or not torch.equal(head_ids.cpu(), bridge.draft_ids)):
            raise ValueError("a bridged draft's output head must be cut to the shared tokens (bridge.draft_ids)")
        # What each head row proposes, in the caller's ids: [N], or None (row i proposes id i).
        self.head_caller_ids = self.head_ids if bridge is None else bridge.caller_ids.to(loaded.device)
        self._host_caller_ids = None if self.head_caller_ids is None else self.head_caller_ids.cpu()  # for supports
        self.stopped_proposals = 0  # calls cut short because the caller cancelled
        if proposal_mode not in PROPOSAL_MODES:
            raise ValueError(f"proposal_mode must be one of {PROPOSAL_MODES}; got {proposal_mode!r}")
        if proposal_top_k < 0:
            raise ValueError(f"proposal_top_k must be >= 0 (0 = the full distribution); got {proposal_top_k}")
        self.proposal_mode = proposal_mode
        self.proposal_top_k = proposal_top_k

    def describe(self) -> ModelDescription:
        description = super().describe()
        if self.bridge is not None:  # it speaks the target's ids
            caller = self.bridge.caller
            description = dataclasses.replace(
                description,
                vocab_size=caller.vocab_size,
                tokenizer_fingerprint=caller.tokenizer_fingerprint,
                eos_token_ids=caller.eos_token_ids,
                vocab_bridge=self.bridge.figures,
            )
        if self.lookup is None:
            return description
        return dataclasses.replace(description, model_id=f"{description.model_id}+{self.lookup.label}", copies=True)

    @property
    def output_vocab_size(self) -> int:
        """Width of the distributions proposals ship: the caller's vocabulary when bridged."""
        return self.loaded.vocab_size if self.bridge is None else self.bridge.caller_vocab_size

    def end_session(self, session_id: str, keep: bool = True) -> bool:
        """The caller is done with the session: a lookup that keeps sequences learns it,
        unless `keep` is False (an unused branch: no output)."""
        session = self.sessions.peek(session_id)
        if session is not None and self.lookup is not None and keep:
            self.lookup.learn(session)
        return super().end_session(session_id, keep)

    def _decodable(self, drafting: _Drafting) -> bool:
        """Whether the call's next tokens can run in a decode batch's pass beside the others'
        one each: at most a round's (K accepted, the bonus, the last proposal not yet run; a
        short prompt too, whose pass would cost the batch a pass of its own), in a cache that
        pads and splits. A longer prompt or a re-prefill runs a pass of its own first, and so
        does a session still in the prefix cache's blocks (a prompt, or one started from cached
        blocks): a padded pass would leave entries the cache cannot keep as a fresh prefill's."""
        session = drafting.session
        if self.sessions.prefix is not None and session.aligned_tokens == session.cached_tokens:
            return False
        return len(drafting.feed) <= self.max_speculative_tokens + 2 and batchable_cache(session.cache)

    @staticmethod
    def _tokens_left(drafting: _Drafting) -> int:
        """The tokens the call's session will add to its cache in a decode batch: what it feeds
        now, then one for each draft after the next."""
        return len(drafting.feed) + drafting.limit - len(drafting.token_ids) - 1

    def _open(self, call: ProposeCall, drafts: int):
        """Checks the call's tokens and length (with `drafts` more to come), rolls its session
        back to `keep_tokens` plus the new tokens, and returns (session, the tokens its cache
        lacks, whether proposals are deterministic, the call's generator, its stopwatch)."""
        clock = Stopwatch()
        keep, new_tokens, positions = self._own_ids(call)
        self.check_tokens(new_tokens, "new_tokens")
        check_sequence(keep, new_tokens)  # before the call touches a live session of that id
        ids, limit = self._host_caller_ids, call.vocab_limit
        if limit and ids is not None and not bool((ids < limit).any()):  # chains and trees alike (`_below`)
            raise InvalidArgument(f"vocab_limit {limit} leaves the draft no token to propose")
        if self.bridge is not None and keep + len(new_tokens) + drafts > self.loaded.max_context:
            # The caller counts its own tokens, which this draft spells with more: a request near
            # the draft's context is this request's limit, not a fault of the node (the caller runs
            # its rounds target-only, and other requests keep this draft).
            raise ResourceExhausted(
                f"the sequence is {keep + len(new_tokens)} tokens in the draft's own vocabulary, and with {drafts} "
                f"drafts exceeds its context of {self.loaded.max_context}"
            )
        self.check_length(keep + len(new_tokens) + drafts)
        session = self.sessions.for_call(call.session_id, keep, call.epoch, call.fork_from, call.cache_namespace)
        pending = self.sessions.extend(session, keep, new_tokens)
        session.committed_tokens = keep + len(new_tokens)
        session.caller_positions = positions
        deterministic = call.params.greedy or self.proposal_mode == "greedy"
        return session, pending, deterministic, np.random.default_rng(call.seed), clock

    def _own_ids(self, call: ProposeCall) -> tuple[int, list[int], list[int] | None]:
        """The call's keep_tokens and new_tokens in the model's ids, and the session's caller
        positions after it (KVSession.caller_positions; None unless bridged)."""
        if self.bridge is None:
            return call.keep_tokens, call.new_tokens, None
        source = self.sessions.peek(call.fork_from or call.session_id)
        if source is None or source.caller_positions is None:
            # Unknown: opened afresh (keep_tokens 0), or refused by the store (NOT_FOUND).
            new_tokens, after = self.bridge.to_draft(call.new_tokens, call.keep_tokens)
            return call.keep_tokens, new_tokens, [0, *after]
        held = source.caller_positions  # the caller's tokens; the proposals after them are one each
        length = self._caller_length(source)
        if not 0 <= call.keep_tokens <= length:
            raise InvalidArgument(
                f"keep_tokens={call.keep_tokens} is outside the session's sequence of {length} tokens; "
                f"it must be in [0, {length}]"
            )
        kept = held[: call.keep_tokens + 1]
        kept += [held[-1] + step for step in range(1, call.keep_tokens + 2 - len(kept))]  # kept proposals
        new_tokens, after = self.bridge.to_draft(call.new_tokens, kept[-1])
        return kept[-1], new_tokens, kept + after

    def _model_id(self, head_row: int) -> int:
        """The id a head row stands for in the model's own vocabulary (what the next pass runs)."""
        return head_row if self.head_ids is None else int(self.head_ids[head_row])

    def _caller_id(self, head_row: int) -> int:
        """The id a head row proposes, as the caller names it."""
        return head_row if self.head_caller_ids is None else int(self.head_caller_ids[head_row])

    def _caller_support(self, support: RowSupport | None) -> RowSupport | None:
        """A row's non-zero entries over head rows (or None: unknown) over the caller's ids."""
        if support is None or self._host_caller_ids is None:
            return support
        return RowSupport(self._host_caller_ids[support.ids], support.values)

    def _caller_length(self, session: KVSession) -> int:
        """The session's sequence length as its caller counts it (proposals included)."""
        if session.caller_positions is None:
            return len(session.tokens)
        return len(session.caller_positions) - 1 + len(session.tokens) - session.caller_positions[-1]

    def _begin(self, call: ProposeCall) -> _Drafting:
        """Checks the call and rolls its session back to `keep_tokens` plus the new tokens."""
        check_call_sizes(call, self.max_speculative_tokens, copies=self.lookup is not None)
        min_confidence = self.min_confidence if call.min_confidence is None else check_confidence(call.min_confidence)
        drafts = max(call.num_tokens, call.copy_limit) if self.lookup is not None else call.num_tokens
        session, pending, deterministic, generator, clock = self._open(call, drafts)
        limit = self._room(session, pending, call.num_tokens)
        drafting = _Drafting(
            call, session, pending, deterministic, generator, clock, limit, min_confidence=min_confidence
        )
        if self.lookup is not None and call.copy_limit:
            # The cache lags the sequence by the pending tokens and any copied ones; the
            # session's next call runs whichever of them it keeps.
            copied, _ = copy_tail(session, call, self.lookup, None if self.bridge is None else self.bridge.to_caller)
            if copied or not call.num_tokens:  # a copy-only call that found none proposes nothing
                drafting.token_ids, drafting.deterministic, drafting.looked_up = copied, True, True
                self.looked_up_proposals += bool(copied)
        return drafting

    def _room(self, session: KVSession, feed: list[int], wanted: int) -> int:
        """The drafts a call may make: `wanted`, fewer where the KV budget holds fewer for this
        session alone (its cache, the `feed` and each draft but the last, which the next call
        runs), and at least 1 when `wanted` is, so that a feed that does not fit is refused
        by its own pass, before any draw.

        Why this is decided here, before the first draw: a budget refused mid-proposal (the
        session outgrowing it on draft j) fails the call only if no confidence stop came
        first, so which proposals survive would depend on their own draws, and the target
        would verify only those that stopped early (issue 65: a = 0.51 instead of 0.70 in its
        example). A cap fixed by the call is a stopping time, like K itself."""
        budget = self.sessions.max_kv_bytes
        if not budget or not wanted:
            return wanted
        room = (budget - session.kv_bytes) // self.kv_bytes_per_token  # entries the session may add
        return max(1, min(wanted, room - len(feed) + 1))

    def _done(self, drafting: _Drafting) -> bool:
        """All K drawn, the last one drawn with too little confidence, or the caller cancelled
        after the first (polled between steps).

        Stopping on confidence keeps the output exact: the decision is a function of the
        draft's own distributions and draws so far, which the target's coins do not depend
        on, so the proposal length is a stopping time of the draft's process. Each proposed
        token is verified against the distribution it was drawn from, given exactly the
        prefix before it, whatever the length; after the last one the target's bonus sample
        is drawn from its own distribution as in any round (as HF's
        `assistant_confidence_threshold` and llama.cpp's `--draft-p-min` do).
        """
        step = len(drafting.token_ids)
        if step >= drafting.limit or drafting.looked_up:
            return True
        if drafting.unsure:
            self.confidence_stops += 1
            return True
        if step and drafting.call.should_stop():
            self.stopped_proposals += 1
            return True
        return False

    def _step(self, drafting: _Drafting, logits: torch.Tensor, batch_size: int) -> None:
        """Draws the next token from the draft's distribution at the last fed position. What
        the host needs of it (whether the logits are finite, the token, its probability, the
        runner-ups, the support) crosses from the device in one transfer (`fetch`).

        logits: [N] (N = V without a reduced head)
        """
        total = logits.sum()  # [] finite unless some logit is not (check_logits)
        checked = logits
        if drafting.call.vocab_limit:
            logits = self._below(logits, drafting.call.vocab_limit)
        guess = drafting.guessing
        parts: torch.Tensor | None = None
        if drafting.deterministic or guess:
            row = ranked_row(logits, drafting.call.guess_rank if guess else 0)  # []
            head_probs = one_hot_at(logits, row.reshape(1))  # [N]
            belief = torch.softmax(logits, dim=-1)  # [N] the draft's own view: to rank hedges and stop on confidence
        else:
            head_probs, parts = top_k_parts(logits_to_probs(logits, drafting.call.params), self.proposal_top_k)
            row = sample(head_probs[None], drafting.generator)[0]  # []
            belief = head_probs
        top = belief.topk(min(drafting.call.runner_ups + 1, belief.numel()))
        fetched = fetch(total, row, belief[row], top.indices, top.values, *(() if parts is None else (parts,)))
        if not math.isfinite(fetched[0][0]):
            self.check_logits(checked, drafting.call.session_id)
        chosen = int(fetched[1][0])
        support: RowSupport | None  # the shipped row's non-zero entries, where known
        if drafting.deterministic or guess:
            support = RowSupport.one_hot(chosen)
        else:
            support = None if parts is None else support_of(fetched[5])
        runner_ups = self._others([int(i) for i in fetched[3]], fetched[4], chosen, drafting.call.runner_ups)
        self._take(drafting, chosen, fetched[2][0], runner_ups, head_probs, support, batch_size)

    def _take(
        self,
        drafting: _Drafting,
        row: int,
        drawn_prob: float,
        runner_ups: list[tuple[int, float]],
        head_probs: torch.Tensor,
        support: RowSupport | None,
        batch_size: int,
    ) -> None:
        """Records head row `row` as the next proposal: `drawn_prob` is the draft's probability
        of it (its belief in its own argmax when greedy, the drawn token's probability when
        sampling), `head_probs` [N] the distribution it was drawn from, `support` that
        distribution's non-zero head rows."""
        drafting.processed += len(drafting.feed)
        drafting.batch_size = max(drafting.batch_size, batch_size)
        drafting.unsure = stops_on_confidence(
            drawn_prob, drafting.min_confidence, runner_up_guess=drafting.guessing and drafting.call.guess_rank > 0
        )
        drafting.token_ids.append(self._caller_id(row))
        for other, prob in runner_ups:
            drafting.runner_up_ids.append(other)
            drafting.runner_up_probs.append(prob)
        drafting.rows.append(self._over_vocab(head_probs))  # [V]
        if not drafting.deterministic:
            drafting.supports.append(self._caller_support(support))
        token = self._model_id(row)
        drafting.session.tokens.append(token)
        drafting.feed = [token]

    def _finish(self, drafting: _Drafting) -> Proposal:
        # The last proposal is in the sequence but not yet in the cache; the next call runs it
        # if it is kept, or crops it away for free if it is not.
        if drafting.looked_up:
            proposal = copied_proposal(drafting.token_ids, drafting.session, drafting.clock.ms())
            return dataclasses.replace(proposal, sequence_length=self._caller_length(drafting.session))
        return Proposal(
            token_ids=drafting.token_ids,
            probs=torch.stack(drafting.rows),
            deterministic=drafting.deterministic,
            processed_tokens=drafting.processed,
            sequence_length=self._caller_length(drafting.session),
            compute_ms=drafting.clock.ms(),
            runner_up_ids=drafting.runner_up_ids,  # empty for a one-token head
            runner_up_probs=drafting.runner_up_probs,
            batch_size=drafting.batch_size,
            supports=drafting.supports or None,
        )

    def _below(self, logits: torch.Tensor, limit: int) -> torch.Tensor:
        """logits: [..., N] with the rows of ids >= `limit` masked: the draft's distribution gives
        them probability 0, and that distribution is what it samples from and sends. Which rows
        those are is decided on the host (the caller's ids: the limit is its vocabulary's)."""
        ids, width = self._host_caller_ids, logits.shape[-1]
        host = torch.arange(width) >= limit if ids is None else ids >= limit  # [N], never all (`_open`)
        if not bool(host.any()):
            return logits
        outside = to_device(host, logits.device)
        return logits.masked_fill(outside, float("-inf"))  # [..., N]

    def _others(self, top_ids: list[int], top_probs: list[float], row: int, count: int) -> list[tuple[int, float]]:
        """The first `count` of a row's top head rows (best first, one more than `count`) that are
        not `row` itself, as (the caller's token id, probability)."""
        ranked = [(self._caller_id(other), prob) for other, prob in zip(top_ids, top_probs) if other != row]
        return ranked[:count]

    def _over_vocab(self, head_probs: torch.Tensor) -> torch.Tensor:
        """[N] over the head's ids → [V] over the whole (caller's) vocabulary, zeros elsewhere."""
        if self.head_caller_ids is None:
            return head_probs
        probs = torch.zeros(self.output_vocab_size, dtype=head_probs.dtype, device=head_probs.device)  # [V]
        return probs.index_copy_(0, self.head_caller_ids, head_probs)


def ranked_row(logits: torch.Tensor, rank: int) -> torch.Tensor:
    """The head row of the (rank + 1)-th largest logit (0: the argmax); the last row there is
    where the head has fewer rows. logits: [N] → [] (on the logits' device)"""
    if not rank:
        return row_argmax(logits)
    return logits.topk(min(rank + 1, logits.numel())).indices[-1]
