import ast
from pathlib import Path

import pytest

from specdec.engine.openmp import SPIN_COUNT, limit_spinning

ROOT = Path(__file__).resolve().parents[2]


def test_limit_spinning_sets_a_short_spin_count_unless_the_operator_chose_one():
    environ: dict[str, str] = {}
    limit_spinning(environ)
    assert environ == {"GOMP_SPINCOUNT": SPIN_COUNT}
    for chosen in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "active"}):
        environ = dict(chosen)
        limit_spinning(environ)
        assert environ == chosen


@pytest.mark.parametrize("service", ["draft_service", "target_service", "coordinator"])
def test_each_service_limits_spinning_before_it_imports_anything_that_loads_torch(service):
    body = ast.parse((ROOT / service / "__main__.py").read_text()).body
    calls = [i for i, node in enumerate(body) if isinstance(node, ast.Expr) and "limit_spinning" in ast.unparse(node)]
    imports = [
        i for i, node in enumerate(body) if isinstance(node, ast.ImportFrom) and node.module != "specdec.engine.openmp"
    ]
    assert calls and imports and calls[0] < min(imports)
