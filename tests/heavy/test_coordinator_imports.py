"""What the coordinator loads at start-up: a process of its own, so the import is fresh."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_coordinator_starts_without_transformers_modeling_stack():
    """The coordinator reads tokenizers, never models: importing it must not pull in
    transformers' modeling stack (modeling_utils and what it loads: about 1.5 s of its 3.3 s
    start on a 2-core machine), which a constant or a type hint imported from the engine did."""
    code = "import sys, coordinator.server; print(sorted(m for m in sys.modules if m in HEAVY))"
    heavy = ["transformers.modeling_utils", "transformers.masking_utils", "transformers.integrations.sdpa_attention"]
    found = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {heavy!r}\n{code}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert found == "[]", f"importing coordinator.server loads {found}"
