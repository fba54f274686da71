"""Issue 66's bounds on the code's shape, kept: no function over 60 lines in the round's
packages (coordinator/, specdec/engine/) and no product module over 450 lines. A function
that grows past it is split where its parts have names of their own; a module, where its
parts have owners of their own."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FUNCTION_LINES = 60
MODULE_LINES = 450
ROUND_PACKAGES = ("coordinator", "specdec/engine")
PRODUCT_PACKAGES = ("coordinator", "specdec", "draft_service", "target_service")
GENERATED = ROOT / "specdec" / "v1"


def _modules(packages: tuple[str, ...]) -> list[Path]:
    return sorted(
        path for package in packages for path in (ROOT / package).rglob("*.py") if GENERATED not in path.parents
    )


def test_no_function_in_the_round_packages_is_over_60_lines():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in _modules(ROUND_PACKAGES)
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > FUNCTION_LINES
    ]
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def test_no_product_module_is_over_450_lines():
    modules = _modules(PRODUCT_PACKAGES)
    assert len(modules) > 50  # the walk found the packages
    long = [
        f"{path.relative_to(ROOT)} ({lines} lines)"
        for path in modules
        if (lines := len(path.read_text().splitlines())) > MODULE_LINES
    ]
    assert not long, "modules over 450 lines:\n" + "\n".join(long)
