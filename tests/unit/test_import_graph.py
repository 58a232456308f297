"""titanium's packages import each other without cycles, and config/ stays a leaf.

Reads every module's imports (including those inside functions) from the source, maps each to the
first-level package or module of titanium it names, and looks for a cycle in that graph. A cycle is
what forced function-level imports and "import the module, not the name" workarounds before.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "titanium"


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "titanium" and len(parts) > 1 else None


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        unit = rel.parts[0].removesuffix(".py")
        edges = graph.setdefault(unit, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                target = _unit(name)
                if target is not None and target != unit:
                    edges.add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_import_cycle_between_packages():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_config_is_a_leaf():
    assert import_graph()["config"] <= {"errors"}


def test_models_never_import_parallelism():
    assert "parallel" not in import_graph()["models"]


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
