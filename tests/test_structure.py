"""Package layout: no import cycles inside robo_post, and the layers point one way.

Imports are read from the source (module level and inside functions alike: a lazy
import hides a cycle from Python, not from the design).
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Source folder of each installed package (pyproject's package-dir).
PACKAGE_DIRS = {"robo_post": "robo_post", "robo_post.envs": "envs", "robo_post.fleet": "fleet"}


def _modules() -> dict[str, str]:
    """Module name -> file path for every module of robo_post (envs and fleet included)."""
    out = {}
    for package, folder in PACKAGE_DIRS.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            prefix = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            for name in filenames:
                if name.endswith(".py"):
                    out[prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"] = os.path.join(dirpath, name)
    return out


def _imports(path: str, module: str, known: set[str]) -> set[str]:
    """robo_post modules imported by ``path`` (``from pkg import name`` counts ``pkg.name`` when it is a module)."""
    tree = ast.parse(open(path).read())
    is_package = path.endswith("__init__.py")
    for node in ast.walk(tree):  # annotations-only imports never run
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known and n != module}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(p, m, known) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_module_list_covers_the_layers():
    graph = _graph()
    for module in ("robo_post.cli", "robo_post.models.flow", "robo_post.algos.registry", "robo_post.learner.drivers",
                   "robo_post.pipelines.run", "robo_post.store.store", "robo_post.envs.registry", "robo_post.fleet.client"):
        assert module in graph
    assert "robo_post.models.features" in graph["robo_post.models.encoders"]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_cycle_detection_finds_a_planted_cycle():
    graph = _graph()
    graph["robo_post.store.schema"] = graph["robo_post.store.schema"] | {"robo_post.cli"}
    assert any("robo_post.cli" in c and "robo_post.store.schema" in c for c in _cycles(graph))


@pytest.mark.parametrize("lower, upper", [
    ("robo_post.models", "robo_post.algos"),
    ("robo_post.models", "robo_post.learner"),
    ("robo_post.store", "robo_post.models"),
    ("robo_post.store", "robo_post.learner"),
    ("robo_post.algos", "robo_post.learner"),
    ("robo_post.learner", "robo_post.pipelines"),
    ("robo_post.algos", "robo_post.pipelines"),
])
def test_layers_point_one_way(lower, upper):
    bad = {m: sorted(d for d in deps if d == upper or d.startswith(upper + "."))
           for m, deps in _graph().items() if m == lower or m.startswith(lower + ".")}
    assert {m: d for m, d in bad.items() if d} == {}
