"""The suffix drafter: it proposes what followed the session's suffix in its own sequence and
in earlier sessions of its namespace, as long as its match earns and its candidates agree; it
never proposes another namespace's text, nor any earlier session's to a seeded sampled request."""

from __future__ import annotations

import dataclasses

from draft_service import server as draft_server
from draft_service.config import DraftConfig
from draft_service.drafter import ProposeCall
from draft_service.suffix import SuffixLookup, SuffixStore
from specdec.engine.sessions import KVSession
from specdec.sampling.probs import SamplingParams
from tests.stack import model_service_config

GREEDY = SamplingParams()
TASK = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]  # an earlier request: a prompt and its output


def session(tokens, namespace=""):
    return KVSession("s", tokens=list(tokens), cache=None, namespace=namespace)


def learned(*sequences, namespace="", **kwargs) -> SuffixLookup:
    lookup = SuffixLookup(10_000, **kwargs)
    for sequence in sequences:
        lookup.learn(session(sequence, namespace))
    return lookup


def test_it_proposes_what_followed_the_suffix_in_an_earlier_session():
    lookup = learned(TASK)
    # A new request reaches "…43 44": an earlier session went on "45 46 …". The match is 5
    # tokens long, so the proposal may be 5 long (max_factor 1).
    assert lookup.propose(session([7, 40, 41, 42, 43, 44]), limit=8) == [45, 46, 47, 48, 49]
    # A 2-token match earns 2 tokens; the limit caps any proposal.
    assert lookup.propose(session([7, 43, 44]), limit=8) == [45, 46]
    assert lookup.propose(session([7, 40, 41, 42, 43, 44]), limit=3) == [45, 46, 47]
    assert lookup.propose(session([1, 2, 3]), limit=8) == []  # no match: the model drafts


def test_the_most_frequent_continuation_wins_and_disagreement_stops_it():
    lookup = learned([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], max_factor=4.0, min_prob=0.5)
    assert lookup.propose(session([0, 1, 2, 3]), limit=8) == [4, 5, 6]  # 2 of 3 sessions went on "4 5 6"
    split = learned([1, 2, 3, 4], [1, 2, 3, 7], [1, 2, 3, 8], max_factor=4.0, min_prob=0.5)
    assert split.propose(session([0, 1, 2, 3]), limit=8) == []  # a 1-in-3 share is below min_prob


def test_the_longest_match_decides_among_candidates():
    # "2 3" went on "4" once, but "1 2 3" (a longer match) went on "9 9".
    lookup = learned([5, 2, 3, 4, 4], [1, 2, 3, 9, 9], max_factor=1.0)
    assert lookup.propose(session([0, 1, 2, 3]), limit=8) == [9, 9]


def test_its_own_sequence_counts_as_prompt_lookup_does():
    lookup = learned()
    assert lookup.propose(session([5, 17, 99, 200, 31, 5, 17, 99]), limit=2) == [200, 31]


def test_a_namespace_never_sees_another_namespaces_text():
    lookup = learned(TASK, namespace="tenant-a")
    assert lookup.propose(session([7, 43, 44], namespace="tenant-b"), limit=8) == []
    assert lookup.propose(session([7, 43, 44]), limit=8) == []  # nor the shared namespace
    assert lookup.propose(session([7, 43, 44], namespace="tenant-a"), limit=8) == [45, 46]


def test_a_seeded_sampled_request_copies_only_from_itself():
    lookup = learned(TASK)
    assert lookup.propose(session([7, 43, 44]), limit=8, own_sequence_only=True) == []


def test_the_store_keeps_its_newest_tokens_within_its_bound_and_its_index_with_them():
    store = SuffixStore(max_tokens=25, key_tokens=2)
    for start in range(0, 50, 10):
        store.add(f"tenant-{start % 20}", list(range(start, start + 10)))
    assert store.tokens <= 25 and len(store) == 2
    assert store.occurrences("tenant-0", (1, 2)) == []  # dropped with its sequence
    assert [end for _, end in store.occurrences("tenant-0", (41, 42))] == [2]
    # The index holds the two sequences' n-grams and nothing of the dropped ones'.
    assert sum(len(keys) for keys in store._index.values()) == 2 * 8
    for start in range(100, 200, 10):  # every namespace's old text leaves, namespaces too
        store.add("other", list(range(start, start + 10)))
    assert set(store._index) == {"other"}


def test_the_suffix_drafter_learns_from_ended_sessions_and_copies_across_requests(tiny_pair):
    config = dataclasses.replace(model_service_config(DraftConfig, tiny_pair.draft), quantize="none")
    suffix = draft_server.load_runner(dataclasses.replace(config, drafter="suffix", ngram_min=2))
    assert suffix.describe().copies and "+suffix[" in suffix.describe().model_id
    first = [5, 17, 99, 200, 31, 40, 41, 42]
    drafted = suffix.propose_one(ProposeCall("a", 0, first, 2, GREEDY, 0, cache_namespace="t"))
    assert not drafted.copied  # nothing recurs yet: the model drafts
    suffix.end_session("a")
    again = suffix.propose_one(ProposeCall("b", 0, [1, 2, 99, 200, 31], 4, GREEDY, 0, cache_namespace="t"))
    assert again.copied and again.token_ids == [40, 41, 42] and again.processed_tokens == 0
    other = suffix.propose_one(ProposeCall("c", 0, [1, 2, 99, 200, 31], 4, GREEDY, 0, cache_namespace="u"))
    assert not other.copied
    # An unused branch's sequence is no output: ending it so teaches nothing.
    suffix.end_session("c", keep=False)
    assert len(suffix.lookup.store) == 1
    # What a session learns stops at what its caller sent: not its own last proposals.
    suffix.propose_one(ProposeCall("d", 0, [7, 8, 9, 10, 11], 3, GREEDY, 0, cache_namespace="v"))
    suffix.end_session("d")
    assert [tokens.tolist() for namespace, tokens in suffix.lookup.store._sequences.values() if namespace == "v"] == [
        [7, 8, 9, 10, 11]
    ]
