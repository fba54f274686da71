"""The response's GenerationStats carries every figure the coordinator counts, and nothing
it does not: the copy to protobuf is built from the message's fields by name."""

from __future__ import annotations

import dataclasses

from coordinator.metrics import GenerationStats
from coordinator.servicer import STATS_FIELDS, stats_to_pb
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
