"""No import cycles among the project's modules: each module's imports, wherever they sit
(top level, inside a function, under TYPE_CHECKING), form a graph with no loop. A cycle hidden
in a function-level import still couples two modules both ways and breaks when one moves."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specdec", "coordinator", "draft_service", "target_service", "bench", "scripts")
GENERATED = ROOT / "specdec" / "v1"


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if GENERATED in path.parents:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `path` imports: `from a import b` counts as a.b when that is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                for alias in node.names
            ]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_project_has_no_import_cycle():
    modules = project_modules()
    graph = {name: imports_of(path, modules) - {name.rsplit(".", 1)[0]} for name, path in modules.items()}
    assert len(modules) > 40, "the walk found too few modules; PACKAGES is out of date"
    assert cycles(graph) == [], "import cycles (move the shared code to a module both can import)"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# specdec's layers, lowest first. A module may import its own layer and those before it, never
# one after: the sampling math knows nothing of torch models, the engine nothing of gRPC, and
# the developer tools (client, launcher, real models, tiny test models) sit outside the
# runtime. The generated stubs (specdec.v1) belong with the gRPC side.
LAYERS = ("specdec.errors", "specdec.sampling", "specdec.engine", "specdec.config", "specdec.rpc", "specdec.tools")
LAYER_OF_PREFIX = {"specdec.v1": "specdec.rpc"}
# Runtime packages above specdec: they may use every layer but the tools.
RUNTIME = ("coordinator", "draft_service", "target_service")


def layer(module: str) -> int | None:
    for prefix, owner in LAYER_OF_PREFIX.items():
        if module == prefix or module.startswith(prefix + "."):
            module = owner
    for index, name in enumerate(LAYERS):
        if module == name or module.startswith(name + "."):
            return index
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up a layer, and runtime modules that import the tools."""
    found = []
    for module, imported in sorted(graph.items()):
        own = layer(module)
        for other in sorted(imported):
            theirs = layer(other)
            if own is not None and theirs is not None and theirs > own:
                found.append(f"{module} ({LAYERS[own]}) imports {other} ({LAYERS[theirs]})")
            elif module.startswith(RUNTIME) and theirs == LAYERS.index("specdec.tools"):
                found.append(f"{module} (runtime) imports {other} (a developer tool)")
    return found


def test_specdec_layers_import_only_downwards():
    modules = project_modules()
    graph = {name: imports_of(path, modules) for name, path in modules.items()}
    unplaced = [name for name in modules if name.startswith("specdec.") and layer(name) is None]
    assert unplaced == [], f"specdec modules outside every layer: {unplaced}"
    assert layer_violations(graph) == []


def test_the_layer_check_finds_a_planted_violation():
    planted = {
        "specdec.sampling.probs": {"specdec.engine.runner"},
        "specdec.engine.runner": {"specdec.rpc.wire", "specdec.errors"},
        "coordinator.engine": {"specdec.tools.launch", "specdec.rpc.serving"},
        "specdec.rpc.wire": {"specdec.v1.common_pb2", "specdec.sampling.probs"},
    }
    assert layer_violations(planted) == [
        "coordinator.engine (runtime) imports specdec.tools.launch (a developer tool)",
        "specdec.engine.runner (specdec.engine) imports specdec.rpc.wire (specdec.rpc)",
        "specdec.sampling.probs (specdec.sampling) imports specdec.engine.runner (specdec.engine)",
    ]
