"""Every coordinator mode's seeded outputs, held to a digest committed in tests/data: a change
to the round's structure (issue 66's single writer, its seams) must leave each mode's output
for each seed, and the rounds that made it, as they were.

The table services of test_mode_distributions (exact lookup tables: the same on any CPU) serve
400 seeded sampled generations per mode. Per mode the digest covers the outputs in seed order
and, in any order, each generation's K per round. A change meant to alter them (a new default,
another use of a random stream) rewrites the file with SPECDEC_WRITE_SEEDED_OUTPUTS=1, and the
diff says which modes it touched.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.heavy.test_mode_distributions import MODES, sample_mode, tokenizer_dir  # noqa: F401 (a fixture)

SEEDS = 400
DIGESTS = Path(__file__).resolve().parents[1] / "data" / "seeded_outputs.json"
WRITE = os.environ.get("SPECDEC_WRITE_SEEDED_OUTPUTS") == "1"


def digest(outputs: list[tuple[int, ...]], stats: list) -> dict[str, str]:
    rounds = sorted(tuple(s.k_per_round) for s in stats)
    return {
        "outputs": hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16],
        "k_per_round": hashlib.sha256(json.dumps(rounds).encode()).hexdigest()[:16],
    }


@pytest.fixture(scope="module")
def digests():
    found = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    written: dict[str, dict[str, str]] = {}
    yield found, written
    if WRITE and written:
        # Merged into the file as it is now, under a lock: each xdist worker writes its own modes.
        with DIGESTS.open("a+") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            file.seek(0)
            merged = {**json.loads(file.read() or "{}"), **written}
            file.seek(0)
            file.truncate()
            file.write(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")


@pytest.mark.parametrize("name", sorted(MODES))
async def test_a_modes_seeded_outputs_are_as_committed(tokenizer_dir, digests, name):  # noqa: F811
    committed, written = digests
    outputs, stats, _ = await sample_mode(tokenizer_dir, MODES[name], SEEDS)
    found = digest(outputs, stats)
    if WRITE:
        committed[name] = written[name] = found
    assert found == committed.get(name), (
        f"{name}: seeded outputs or their rounds changed; if meant, rerun with SPECDEC_WRITE_SEEDED_OUTPUTS=1"
    )
