"""The response's GenerationStats carries every figure the coordinator counts, and nothing
it does not: the copy to protobuf is built from the message's fields by name."""

from __future__ import annotations

import dataclasses

from coordinator.metrics import GenerationStats
from coordinator.servicer import STATS_FIELDS, stats_to_pb
from coordinator.state import RoundRecord, Source
from coordinator.text import Delta
from specdec.v1 import coordinator_pb2


def figures() -> set[str]:
    """GenerationStats' public fields and properties."""
    fields = {f.name for f in dataclasses.fields(GenerationStats) if not f.name.startswith("_")}
    properties = {name for name, value in vars(GenerationStats).items() if isinstance(value, property)}
    return fields | properties


def test_the_message_and_the_dataclass_list_the_same_figures():
    assert set(STATS_FIELDS) == figures()


def test_every_field_is_copied():
    stats = GenerationStats()
    for number, field in enumerate(dataclasses.fields(GenerationStats), start=1):
        if field.name.startswith("_"):
            continue
        current = getattr(stats, field.name)
        value = [number, number + 1] if isinstance(current, list) else type(current)(number)
        setattr(stats, field.name, value)
    message = stats_to_pb(stats)
    for field in coordinator_pb2.GenerationStats.DESCRIPTOR.fields:
        expected, got = getattr(stats, field.name), getattr(message, field.name)
        if isinstance(expected, list):
            assert list(got) == expected, field.name
        else:
            assert got == expected or abs(got - expected) < 1e-3 * abs(expected), field.name
        assert expected, f"{field.name} was left at its zero value, so the test would not see it dropped"


def test_a_round_cut_short_counts_its_relaxed_and_copied_drafts_within_what_it_took():
    """A generation that ended inside a round (a stop string, EOS, max_new_tokens) counts only
    the drafts the output took: the relaxed-only and the copied ones among them too, so neither
    ever exceeds accepted_tokens."""
    stats = GenerationStats()
    # 6 copied drafts, all accepted, those at 1, 2, 4 and 5 by the relaxed rule alone; the
    # output took 3 of the round's tokens: drafts 0..2.
    stats.observe(RoundRecord(Source.DRAFT, 6, 6, True, False, True, 0, (1, 2, 4, 5), 0, True, Delta(), 3))
    assert (stats.accepted_tokens, stats.relaxed_accepted_tokens, stats.copied_accepted) == (3, 2, 3)
    whole = GenerationStats()
    whole.observe(RoundRecord(Source.DRAFT, 6, 6, True, False, True, 0, (1, 2, 4, 5), 0, False, Delta(), 7))
    assert (whole.accepted_tokens, whole.relaxed_accepted_tokens, whole.copied_accepted) == (6, 4, 6)
