"""The tiers are folders: `make test-fast` runs unit/ and integration/; `make test` runs those
and heavy/ three tests at a time, then serial/ in its two lanes. A module that starts processes
cannot slip into the fast tier, and the Makefile selects by these folders."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
FAST = ("unit", "integration")
ALL = (*FAST, "heavy", "serial")
# What starts a process: the service launcher, the process stack, subprocess, multiprocessing
# (torch.distributed's gloo ranks are spawned through it).
PROCESS_MODULES = (
    "subprocess",
    "multiprocessing",
    "torch.multiprocessing",
    "specdec.tools.launch",
    "specdec.tools.testbed",
)
PROCESS_NAMES = {"ProcessStack", "spawn", "ServiceProcess", "launch", "testbed", "Testbed"}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}:{alias.name}" for alias in node.names)
    return names


def starts_processes(path: Path) -> set[str]:
    found = set()
    for name in imports_of(path):
        module, _, member = name.partition(":")
        if module in PROCESS_MODULES or member in PROCESS_NAMES:
            found.add(name)
    return found


def test_no_fast_module_starts_a_process():
    for tier in FAST:
        for path in sorted((TESTS / tier).glob("test_*.py")):
            assert not starts_processes(path), f"tests/{tier}/{path.name} starts processes: move it to tests/heavy"


def test_the_check_sees_a_process_import(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text("from tests.stack import ProcessStack\nimport multiprocessing as mp\n")
    assert starts_processes(planted) == {"tests.stack:ProcessStack", "multiprocessing"}


def test_every_tier_folder_says_what_it_holds():
    for tier in ALL:
        docstring = ast.get_docstring(ast.parse((TESTS / tier / "__init__.py").read_text()))
        assert docstring and "make test" in docstring, f"tests/{tier}/__init__.py must say which command runs it"


def test_the_makefile_selects_the_tiers_by_folder():
    makefile = (ROOT / "Makefile").read_text()
    recipes = {
        target: [line.strip() for line in body.splitlines() if "pytest" in line]
        for target, body in re.findall(r"^([\w-]+):[^\n]*\n((?:\t[^\n]*\n)+)", makefile, re.MULTILINE)
    }
    fast, full = recipes["test-fast"], recipes["test"]
    assert len(fast) == 1 and all(f"tests/{tier}" in fast[0] for tier in FAST)
    assert "tests/heavy" not in fast[0] and "tests/serial" not in fast[0]
    assert len(full) == 2, "make test: the parallel tiers, then the serial one"
    assert all(f"tests/{tier}" in full[0] for tier in (*FAST, "heavy")) and "tests/serial" not in full[0]
    assert "tests/serial" in full[1] and "--dist loadgroup" in full[1], "serial/: its lanes (tests/serial/conftest.py)"


def test_every_test_module_is_in_a_tier():
    stray = [
        os.path.relpath(path, TESTS)
        for path in TESTS.rglob("test_*.py")
        if path.parent.name not in ALL or path.parent.parent != TESTS
    ]
    assert not stray, f"test modules outside the tier folders run in no make target: {stray}"


def test_the_fast_tier_keeps_the_sampling_math_and_in_process_services():
    for kept in ("unit/test_sampling.py", "unit/test_rounds.py", "integration/test_generate.py"):
        assert (TESTS / kept).is_file(), kept
    assert (TESTS / "integration/test_coordinator_modes.py").is_file()


def test_hypothesis_keeps_the_ci_example_counts_unless_asked():
    from hypothesis import settings

    if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci":
        assert settings.default.max_examples == 300
