"""Two lanes for the serial tier (`make test` runs it with `-n 2 --dist loadgroup`): the K
chooser's module, whose slowed passes are sleeps and whose services spend a tenth of a core,
beside every other module one at a time. No two tests that hold a core, or check a
deadline, run side by side."""

from __future__ import annotations

import pytest

SLEEPING = {"test_k_chooser.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        lane = "sleeping" if item.path.name in SLEEPING else "one-at-a-time"
        item.add_marker(pytest.mark.xdist_group(lane))
