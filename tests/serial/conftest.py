"""Two lanes for the serial tier (`make test` runs it with `-n 2 --dist loadgroup`): the K
chooser's module beside every other module one test at a time. Its services spend a tenth of a
core, and the target costs its chooser weighs are sleeps of 32 ms and more in slowed passes,
which a test beside it stretches by little; no two of the other modules' tests, which hold a
core or check a deadline, ever run side by side."""

from __future__ import annotations

import pytest

SLEEPING = {"test_k_chooser.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        lane = "sleeping" if item.path.name in SLEEPING else "one-at-a-time"
        item.add_marker(pytest.mark.xdist_group(lane))
