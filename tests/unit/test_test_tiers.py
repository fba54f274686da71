"""The fast tier's skip list names real modules, so a renamed heavy module cannot slip into
`make test-fast` unnoticed (and a stale name cannot hide that the list no longer applies)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import HEAVY_MODULES, SERIAL_MODULES

TESTS = Path(__file__).resolve().parents[1]


def test_every_heavy_module_exists_and_says_why():
    for relative, reason in HEAVY_MODULES.items():
        assert (TESTS / relative).is_file(), f"tests/conftest.py lists {relative}, which does not exist"
        assert reason.strip(), f"{relative} needs a reason"


def test_every_serial_module_exists_says_why_and_is_heavy():
    """Serial modules run alone in `make test`; they are all heavy, so the fast tier (which
    runs on one worker) never needs the split."""
    for relative, reason in SERIAL_MODULES.items():
        assert (TESTS / relative).is_file(), f"tests/conftest.py lists {relative}, which does not exist"
        assert reason.strip() and relative in HEAVY_MODULES, relative


def test_the_fast_tier_keeps_the_sampling_math_and_in_process_services():
    kept = {"unit/test_sampling.py", "integration/test_generate.py", "integration/test_coordinator_modes.py"}
    assert not kept & set(HEAVY_MODULES)


def test_hypothesis_keeps_the_ci_example_counts_unless_asked():
    from hypothesis import settings

    if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci":
        assert settings.default.max_examples == 300
