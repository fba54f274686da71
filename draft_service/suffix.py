"""The suffix drafter's lookup: continuations of the session's suffix found in its own sequence
and in the sequences of earlier sessions, with no model pass (SuffixDecoding, arXiv 2411.04975).

Real traffic repeats itself across requests: an agent re-runs one task on new inputs, a user
asks for an edit of an answer, code carries the same boilerplate. Prompt lookup (the hybrid
drafter) sees only the current request; this lookup keeps a bounded store of what every
finished session of the same cache namespace held (its prompt and its output) and proposes
from it too.

How it proposes, as SuffixDecoding's suffix tree does, over an index instead of a tree:
1. It finds every earlier position where the session's last `min_match` tokens occur (an
   index by n-gram over the store, a scan over the session), then how far each match
   reaches back (at most `max_match` tokens). The longest matches are the candidates.
2. From those it walks forward: each step takes the candidates' most frequent next token,
   keeps only the candidates that agree, and multiplies a score by that token's share.
3. It stops where the score falls below `min_prob`, or at `max_factor` × the match length:
   a long match earns a long proposal, a short one a short proposal (the per-request length
   SuffixDecoding derives from its match). No candidate: no proposal, and the model drafts.

Exact, as every drafter is: which tokens are proposed depends on the session's sequence and the
store alone, never on the target's coins, and each travels one-hot, the distribution it was
drawn from, so the target accepts it with exactly its own probability of that token.

Isolation: the store's index is per namespace (ProposeRequest.cache_namespace), so a session is
only ever proposed text of its own namespace; its budget is shared, so any namespace's new text
pushes out the oldest, whoever's. Not thread-safe: the model thread drives it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec.engine.sessions import KVSession

# SuffixDecoding's defaults (Arctic Inference: max_spec_factor 1.0, min_token_prob 0.1, tree
# depth 24); the shortest match is prompt lookup's shortest n-gram.
DEFAULT_MIN_MATCH = 2
DEFAULT_MAX_MATCH = 24
DEFAULT_MAX_FACTOR = 1.0
DEFAULT_MIN_PROB = 0.1
MAX_CANDIDATES = 64  # the most recent occurrences of an n-gram a lookup weighs (per source)


class SuffixStore:
    """Earlier sessions' sequences by namespace, at most `max_tokens` tokens over all of them
    (the oldest sequence goes first), with an index from each `key_tokens`-gram (by its hash)
    to where it ends, newest last, at most MAX_CANDIDATES each. A dropped sequence leaves the
    index with it, so the index stays within a bound set by `max_tokens`."""

    def __init__(self, max_tokens: int, key_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.key_tokens = key_tokens
        self.tokens = 0
        self._sequences: OrderedDict[int, tuple[str, np.ndarray]] = OrderedDict()  # number → (namespace, [L])
        # namespace → n-gram hash → (number << 32 | end) of its occurrences: a hash collision
        # only adds a candidate, which the caller's match check drops.
        self._index: dict[str, dict[int, list[int]]] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._sequences)

    def _keys(self, sequence: np.ndarray):
        """(n-gram hash, end) for every n-gram a token follows in `sequence`."""
        n = self.key_tokens
        for end, key in enumerate(map(tuple, sliding_window_view(sequence[:-1], n).tolist()), start=n - 1):
            yield hash(key), end

    def add(self, namespace: str, token_ids: list[int]) -> None:
        """Keeps a finished session's sequence (too long a one keeps its last `max_tokens`)."""
        sequence = np.asarray(token_ids[-self.max_tokens :], dtype=np.int64)
        if len(sequence) <= self.key_tokens:
            return
        while self._sequences and self.tokens + len(sequence) > self.max_tokens:
            self._drop()
        number, self._next = self._next, self._next + 1
        self._sequences[number] = (namespace, sequence)
        self.tokens += len(sequence)
        index = self._index.setdefault(namespace, {})
        for key, end in self._keys(sequence):
            entries = index.setdefault(key, [])
            entries.append(number << 32 | end)
            if len(entries) > MAX_CANDIDATES:
                del entries[0]

    def _drop(self) -> None:
        """Drops the oldest sequence and its index entries."""
        number, (namespace, sequence) = self._sequences.popitem(last=False)
        self.tokens -= len(sequence)
        index = self._index[namespace]
        for key in {key for key, _ in self._keys(sequence)}:
            entries = index.get(key)
            if entries is None:
                continue
            entries[:] = [entry for entry in entries if entry >> 32 != number]
            if not entries:
                del index[key]
        if not index:
            del self._index[namespace]

    def occurrences(self, namespace: str, key: tuple[int, ...]) -> list[tuple[np.ndarray, int]]:
        """(sequence, end) for the held occurrences of `key`'s hash in `namespace`, newest last."""
        entries = self._index.get(namespace, {}).get(hash(key), ())
        return [(self._sequences[entry >> 32][1], entry & 0xFFFFFFFF) for entry in entries]

    def clear(self) -> None:
        self._sequences.clear()
        self._index.clear()
        self.tokens = 0


class SuffixLookup:
    """The lookup of `--drafter suffix` (a `Lookup`, as draft_service.ngram.PromptLookup)."""

    def __init__(
        self,
        max_tokens: int,
        min_match: int = DEFAULT_MIN_MATCH,
        max_match: int = DEFAULT_MAX_MATCH,
        max_factor: float = DEFAULT_MAX_FACTOR,
        min_prob: float = DEFAULT_MIN_PROB,
    ) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"suffix match lengths need 1 <= min <= max; got {min_match} and {max_match}")
        self.store = SuffixStore(max_tokens, min_match)
        self.min_match = min_match
        self.max_match = max_match
        self.max_factor = max_factor
        self.min_prob = min_prob

    @property
    def label(self) -> str:
        return f"suffix[{self.store.max_tokens}]"

    def learn(self, session: KVSession) -> None:
        """A session its caller is done with: its committed sequence joins the store (not the
        proposals of its last call, which may have been rejected)."""
        self.store.add(session.namespace, session.tokens[: session.committed_tokens])

    def propose(self, session: KVSession, limit: int, own_sequence_only: bool = False) -> list[int]:
        """Up to `limit` tokens continuing the session's sequence; [] without a candidate.
        `own_sequence_only`: earlier sessions' sequences are not looked at."""
        tokens = np.asarray(session.tokens, dtype=np.int64)
        n = self.min_match
        if limit < 1 or len(tokens) <= n:
            return []
        key = tuple(tokens[-n:].tolist())
        candidates = self._own(tokens, n)
        if not own_sequence_only:
            candidates += self.store.occurrences(session.namespace, key)
        if not candidates:
            return []
        reach = [self._reach(tokens, sequence, end) for sequence, end in candidates]
        longest = max(reach)
        if longest < n:  # only hash collisions: no real match
            return []
        chosen = [candidate for candidate, length in zip(candidates, reach) if length == longest]
        return self._walk(chosen, min(limit, max(1, int(self.max_factor * longest))))

    def _own(self, tokens: np.ndarray, n: int) -> list[tuple[np.ndarray, int]]:
        """Earlier occurrences of the last n tokens in the session's own sequence (newest
        MAX_CANDIDATES), as (sequence, end)."""
        windows = sliding_window_view(tokens[:-1], n)  # [L - n, n]; excludes the suffix itself
        ends = np.flatnonzero((windows == tokens[-n:]).all(axis=1))[-MAX_CANDIDATES:] + n - 1
        return [(tokens, int(end)) for end in ends]

    def _reach(self, tokens: np.ndarray, sequence: np.ndarray, end: int) -> int:
        """How many tokens before and at `end` in `sequence` equal the session's last ones
        (at most max_match; at least min_match, since the index matched that many)."""
        span = min(self.max_match, end + 1, len(tokens))
        theirs = sequence[end + 1 - span : end + 1][::-1]  # [span], newest first
        ours = tokens[len(tokens) - span :][::-1]
        differ = np.flatnonzero(theirs != ours)
        return int(differ[0]) if differ.size else span

    def _walk(self, candidates: list[tuple[np.ndarray, int]], most: int) -> list[int]:
        """The candidates' most frequent continuation, token by token, while its share of the
        candidates still agreeing keeps the running score at or above min_prob."""
        proposal: list[int] = []
        score = 1.0
        while len(proposal) < most:
            step = len(proposal) + 1
            nexts = [(sequence, end) for sequence, end in candidates if end + step < len(sequence)]
            if not nexts:
                break
            counts = Counter(int(sequence[end + step]) for sequence, end in nexts)
            token, count = counts.most_common(1)[0]
            score *= count / len(nexts)
            if score < self.min_prob:
                break
            proposal.append(token)
            candidates = [(sequence, end) for sequence, end in nexts if int(sequence[end + step]) == token]
        return proposal
