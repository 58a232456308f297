"""titanium's imports follow the layers of DESIGN.md, and no module imports one that imports it back.

Reads every module's imports (including those inside functions) from the source. Two graphs: packages (the first
level under titanium/: ``config``, ``rl``, ``trainer``...) against a table of layers, lowest first, where a package
may import its own layer and the ones below, plus the few edges the design forbids inside a layer; and modules,
where any cycle fails (a cycle is what forced function-level imports and "import the module, not the name"
workarounds before). Registries load their components by import path at run time: such a string is no import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "titanium"

LAYERS: list[tuple[str, set[str]]] = [
    ("contracts", {"__init__", "batch", "hooks", "errors", "files", "precision"}),
    ("config", {"config"}),
    ("inputs and models", {"data", "models", "metrics", "optim", "debug", "guards"}),
    ("converters and parallelism", {"peft", "quantize", "parallel", "moe_balance"}),
    ("builder and checkpoints", {"model_builder", "model_handles", "model_setup", "checkpoint", "fault_tolerance"}),
    ("engines", {"generation"}),
    ("rl", {"rl"}),
    ("objectives", {"objectives"}),
    ("loop", {"executors", "evaluation", "trainer"}),
    ("entry and tools", {"train", "preflight", "inputs", "tools"}),
]
"""DESIGN.md's layers, lowest first: a package imports only from its own layer or lower ones."""
FORBIDDEN = {("data", "models"), ("models", "parallel"), ("objectives", "parallel"), ("models", "objectives")}
"""Edges the design rules out although the layers would allow them: data never imports models (the chat template is
built by the loop from the model spec and handed over), objectives never import parallel."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("titanium", *path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every ``titanium.x.y`` a module names in an import (``from a.b import c`` names ``a.b`` and ``a.b.c``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == "titanium"}


def module_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {t for t in _imports(path) if t in modules and t != name} for name, path in modules.items()}


def package_graph() -> dict[str, set[str]]:
    def unit(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else "__init__"

    graph: dict[str, set[str]] = {}
    for module, targets in module_graph().items():
        graph.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
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


def layer_breaks(graph: dict[str, set[str]]) -> list[str]:
    level = {package: i for i, (_, packages) in enumerate(LAYERS) for package in packages}
    breaks = []
    for package, targets in sorted(graph.items()):
        assert package in level, f"titanium/{package} is in no layer of LAYERS: add it where it belongs"
        for target in sorted(targets):
            if level[target] > level[package] or (package, target) in FORBIDDEN:
                breaks.append(f"{package} ({LAYERS[level[package]][0]}) imports {target} ({LAYERS[level[target]][0]})")
    return breaks


def test_no_import_cycle_between_modules():
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_packages_import_only_their_layer_and_lower_ones():
    assert layer_breaks(package_graph()) == []


def test_config_is_a_leaf():
    assert package_graph()["config"] <= {"errors"}


def test_the_checks_find_an_injected_cycle_and_a_broken_layer():
    graph = module_graph()
    assert find_cycle(graph) is None
    graph["titanium.rl.rollout"].add("titanium.rl.source")  # (the source imports rollout: now a loop)
    cycle = find_cycle(graph)
    assert cycle is not None and {"titanium.rl.rollout", "titanium.rl.source"} <= set(cycle)
    packages = package_graph()
    packages["data"].add("objectives")
    assert "data (inputs and models) imports objectives (objectives)" in layer_breaks(packages)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
