"""`commit_round` is the one writer of a request's state (coordinator.rounds.RequestState):
every coordinator module is read, and a write to the request anywhere else fails here.

A write is an assignment (plain, augmented, to an item or an attribute) or a call of a
mutating method, on `state.<part>` or on a name bound to one, where `state` is a variable named
so or annotated RequestState. Some parts have owners of their own (RequestState's docstring):
the session views' fields, the stats, the random streams and the unused forks; rebinding any
part is commit_round's alone."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from coordinator.rounds import RequestState

COORDINATOR = Path(__file__).resolve().parents[2] / "coordinator"
WRITER = ("commit.py", "commit_round")
# Parts whose insides other modules own: views (upstream, branches), stats (observers), the
# random streams (draw_round, the hedges' seeds) and the forks the next branch call ends.
OWNED_ELSEWHERE = {"draft_view", "target_view", "stats", "streams", "unused_forks"}
MUTATORS = {
    "append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "push", "finish",
    "take_delta", "refused", "accepted", "observe", "observe_round", "observe_tree", "observe_rescue",
    "observe_choice", "choose", "choose_shape",
}  # fmt: skip
PARTS = {f.name for f in dataclasses.fields(RequestState)}


def _root(node: ast.AST) -> tuple[str, list[str]] | None:
    """(name, attribute path) of `name.a.b[...]`, or None."""
    path: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            path.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            return node.id, path[::-1]
        else:
            return None


def _state_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = {"state"}
    for arg in [*function.args.args, *function.args.kwonlyargs]:
        if arg.annotation is not None and "RequestState" in ast.unparse(arg.annotation):
            names.add(arg.arg)
    return names


def _part_written(target: ast.AST, states: set[str], aliases: dict[str, str]) -> str | None:
    """The request's part an assignment to `target` writes, or None."""
    root = _root(target)
    if root is None:
        return None
    name, path = root
    if name in states and path and path[0] in PARTS:
        part, inside = path[0], len(path) > 1 or isinstance(target, ast.Subscript)
    elif name in aliases:
        part, inside = aliases[name], True
    else:
        return None
    if inside and part in OWNED_ELSEWHERE:
        return None
    return part


def writes(source: str, module: str) -> list[tuple[str, str, int, str]]:
    """(module, function, line, what) for each write to a request's state in `source`."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        states = _state_names(function)
        aliases: dict[str, str] = {}  # local name -> the part it was bound to
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                bound = _root(node.value)
                if bound and bound[0] in states and bound[1] and bound[1][0] in PARTS:
                    aliases[node.targets[0].id] = bound[1][0]

        for node in ast.walk(function):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                targets = [node.func.value]
                if isinstance(node.func.value, ast.Name) and node.func.value.id in aliases:
                    targets = [ast.Attribute(value=node.func.value, attr="_", ctx=ast.Load())]
            for target in targets:
                if isinstance(target, ast.Name):
                    continue  # a local name (re)bound
                if isinstance(node, ast.Call):
                    target = ast.Attribute(value=target, attr="_", ctx=ast.Load())  # a call writes inside
                part = _part_written(target, states, aliases)
                if part is not None:
                    found.append((module, function.name, node.lineno, part))
    return found


def writers_allowed() -> set[tuple[str, str]]:
    """commit_round and the functions of its module it calls, as far as they go."""
    tree = ast.parse((COORDINATOR / WRITER[0]).read_text())
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    allowed, todo = set(), [WRITER[1]]
    while todo:
        name = todo.pop()
        if name in allowed or name not in functions:
            continue
        allowed.add(name)
        todo += [
            c.func.id for c in ast.walk(functions[name]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
        ]
    return {(WRITER[0], name) for name in allowed}


def test_commit_round_is_the_only_writer_of_a_requests_state():
    allowed = writers_allowed()
    assert ("commit.py", "_take_branches") in allowed, "the checker follows commit_round's calls"
    stray = [
        write
        for path in sorted(COORDINATOR.glob("*.py"))
        for write in writes(path.read_text(), path.name)
        if write[:2] not in allowed
    ]
    assert not stray, f"writes to a request's state outside commit_round: {stray}"


def test_the_check_finds_each_kind_of_write():
    """A mutant of each kind of write the engine once made outside commit_round."""
    mutants = {
        "state.ready = None": "ready",
        "state.round_index += 1": "round_index",
        "state.refusals.refused(3)": "refusals",
        "state.k_chooser.costs = costs": "k_chooser",
        "state.sequence.append(7)": "sequence",
        "state.draft_view = fork": "draft_view",
        "chooser = state.k_chooser\n    chooser.observe_rescue(True)": "k_chooser",
        "state.text.take_delta()": "text",
    }
    for line, part in mutants.items():
        assert [w[3] for w in writes(f"def elsewhere(state):\n    {line}\n", "engine.py")] == [part], line
    harmless = [
        "state.draft_view.synced = 0",  # the views' fields: upstream and branches too
        "state.stats.rounds += 1",  # an observer
        "state.unused_forks[:] = []",  # the branches' own
        "x = state.sequence[-1]",
        "seed = next_seed(state.streams.hedge)",
    ]
    for line in harmless:
        assert not writes(f"def elsewhere(state):\n    {line}\n", "engine.py"), line


def test_the_check_knows_a_request_by_its_annotation():
    source = "def elsewhere(request: RequestState):\n    request.copy_wait = 2\n"
    assert [w[3] for w in writes(source, "engine.py")] == ["copy_wait"]
