"""The prompt-lookup drafter: model-free proposals copied from the session's own sequence.

When the output repeats its input (summaries quote the source, code edits copy the code),
the tokens after the most recent earlier occurrence of the sequence's last n tokens are a
good guess for what comes next, and finding them costs microseconds instead of a forward pass.
Proposals are deterministic, so they travel as one-hot distributions and the target accepts
each with exactly its own probability of that token (see specdec.sampling.probs.verify_outputs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from draft_service.drafter import Proposal, ProposeCall
from specdec.engine.batching import result_or_error
from specdec.engine.calls import ModelDescription, Stopwatch, check_context, check_sequence, check_token_ids
from specdec.engine.modeling import TokenizerInfo
from specdec.engine.sessions import KVSession, SessionStore
from specdec.errors import InvalidArgument


def check_call_sizes(call: ProposeCall, max_speculative_tokens: int, copies: bool) -> None:
    """num_tokens in [1, max], or 0 for a copy-only call (max_copied_tokens > 0) to a drafter
    that copies; max_copied_tokens, where it applies, in [0, max]."""
    copy_only = copies and bool(call.max_copied_tokens)
    if copies and call.max_copied_tokens is not None and not 0 <= call.max_copied_tokens <= max_speculative_tokens:
        raise InvalidArgument(
            f"max_copied_tokens must be in [0, {max_speculative_tokens}]; got {call.max_copied_tokens}"
        )
    if not (0 if copy_only else 1) <= call.num_tokens <= max_speculative_tokens:
        if copies:
            hint = " (0 only with max_copied_tokens > 0: a copy-only call)"
        else:
            hint = " (this drafter does not copy, so max_copied_tokens cannot make 0 valid)"
        raise InvalidArgument(f"num_tokens must be in [1, {max_speculative_tokens}]{hint}; got {call.num_tokens}")


class Lookup(Protocol):
    """Where a copying drafter finds tokens to copy: PromptLookup (the session's own sequence)
    or draft_service.suffix.SuffixLookup (that and earlier sessions' sequences)."""

    @property
    def label(self) -> str: ...

    def propose(self, session: KVSession, limit: int, own_sequence_only: bool = False) -> list[int]: ...

    def learn(self, session: KVSession) -> None: ...


class PromptLookup:
    """The session's own sequence: `lookup`, longest suffix n-gram first."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min <= max; got min {min_n}, max {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.label = f"lookup[{min_n}..{max_n}]"

    def propose(self, session: KVSession, limit: int, own_sequence_only: bool = False) -> list[int]:
        return lookup(np.asarray(session.tokens, dtype=np.int64), self.min_n, self.max_n, limit)

    def learn(self, session: KVSession) -> None:
        """Keeps nothing across sessions."""


def copy_tail(
    session: KVSession, call: ProposeCall, source: Lookup, caller_id: Callable[[int], int | None] | None = None
) -> tuple[list[int], Stopwatch]:
    """A lookup for `call` on its rolled-back session: up to `call.copy_limit` tokens,
    cut before the first id at or above the call's vocab_limit (the target could not embed
    it), appended to the session's sequence (ahead of any KV cache). Returns them and the
    call's clock, started here. `caller_id`: a bridged draft's map from its own ids to its
    caller's (draft_service.vocab_bridge), None for a token the caller cannot be proposed;
    the copy stops before such a token, and the ids returned are the caller's."""
    clock = Stopwatch()
    found = source.propose(session, call.copy_limit, call.own_sequence_only)
    token_ids: list[int] = []
    for token in found:
        proposed = token if caller_id is None else caller_id(token)
        if proposed is None or (call.vocab_limit and proposed >= call.vocab_limit):
            break
        token_ids.append(proposed)
    session.tokens.extend(found[: len(token_ids)])
    return token_ids, clock


def copied_proposal(token_ids: list[int], session: KVSession, compute_ms: float) -> Proposal:
    """A proposal copied by prompt lookup: one-hot rows (deterministic), no forward pass."""
    return Proposal(
        token_ids=token_ids,
        probs=None,
        deterministic=True,
        processed_tokens=0,
        sequence_length=len(session.tokens),
        compute_ms=compute_ms,
        copied=bool(token_ids),
    )


def lookup(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the most recent earlier occurrence of the
    longest suffix n-gram, n from `max_n` down to `min_n`; [] when no suffix recurs.

    tokens: [L] int64
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]  # [n]
        windows = sliding_window_view(tokens[: length - 1], n)  # [L - n, n]; excludes the suffix itself
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n  # < L, so at least one token follows
            return tokens[start : start + num_tokens].tolist()
    return []


class NgramDrafter:
    """A `Drafter` without a model."""

    shares_passes = False  # no forward pass to share: calls run one after the other

    def __init__(
        self,
        info: TokenizerInfo,
        max_sessions: int,
        session_ttl_s: float,
        max_speculative_tokens: int,
        min_n: int = 2,
        max_n: int = 4,
    ):
        self.info = info
        self.source = PromptLookup(min_n, max_n)
        self.max_speculative_tokens = max_speculative_tokens
        self.sessions = SessionStore(max_sessions, session_ttl_s, cache_factory=lambda: None)

    def propose_batch(
        self,
        calls: list[ProposeCall],
        answer: Callable[[int, Proposal | Exception], None] | None = None,
        join: Callable[[int], list[ProposeCall]] | None = None,
    ) -> list[Proposal | Exception]:
        """One after the other, in order: a lookup has no model pass to share. (`answer` and
        `join`, the batcher's early answers and late joiners, are not needed: the servicer
        batches no calls for a drafter that shares no passes, `Drafter.shares_passes`.)"""
        return [result_or_error(self.propose_one, call) for call in calls]

    def propose_one(self, call: ProposeCall) -> Proposal:
        """Sampling settings and seed do not matter: a lookup proposes the same tokens either way."""
        if call.tree_widths:
            raise InvalidArgument("the n-gram drafter proposes chains only; tree_widths needs a model drafter")
        check_call_sizes(call, self.max_speculative_tokens, copies=True)
        check_token_ids(call.new_tokens, self.info.vocab_size, "new_tokens")
        check_sequence(call.keep_tokens, call.new_tokens)  # before the call touches a live session of that id
        check_context(
            call.keep_tokens + len(call.new_tokens) + max(call.num_tokens, call.copy_limit), self.info.max_context
        )
        session = self.sessions.for_call(call.session_id, call.keep_tokens, call.epoch, call.fork_from)
        self.sessions.extend(session, call.keep_tokens, call.new_tokens)
        token_ids, clock = copy_tail(session, call, self.source)
        return copied_proposal(token_ids, session, clock.ms())

    def describe(self) -> ModelDescription:
        description = ModelDescription.of(self.info, "none", "cpu", len(self.sessions), self.max_speculative_tokens)
        return dataclasses.replace(
            description,
            model_id=f"ngram[{self.source.min_n}..{self.source.max_n}]:{self.info.model_id}",
            fork_sessions=self.sessions.forks(),
            max_sessions=self.sessions.max_sessions,
            copies=True,
        )

    def end_session(self, session_id: str, keep: bool = True) -> bool:
        return self.sessions.end(session_id)

    def expire_sessions(self) -> int:
        return self.sessions.expire()
