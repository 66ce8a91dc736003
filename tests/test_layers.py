"""One-way layers: no import cycles and no import against the declared layer order.

Every module of ``sparrow_jax`` and ``pallas_kernels`` is parsed with ``ast``; imports at
module level and inside functions (deferred imports) both count. A module may import
modules of its own layer or of lower layers only, and the module graph has no cycle.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sparrow_jax", "pallas_kernels")

# Lowest first. A module belongs to the longest prefix listed; same-layer imports are allowed.
LAYERS: tuple[tuple[str, ...], ...] = (
    # utilities; run.specs: the typed run config, a leaf that every layer may name in type hints
    ("sparrow_jax", "sparrow_jax.io", "sparrow_jax.parallel", "sparrow_jax.run.specs"),
    # kernels see only the decode contract (input checks, the jnp reference)
    ("sparrow_jax.attention.contract", "sparrow_jax.attention.cpu_kernel", "pallas_kernels"),
    ("sparrow_jax.attention",),
    ("sparrow_jax.models",),
    ("sparrow_jax.data",),
    ("sparrow_jax.rollout",),
    ("sparrow_jax.sft",),  # the warm-up before RL and the run's model source
    ("sparrow_jax.cost_model",),
    ("sparrow_jax.mismatch",),
    ("sparrow_jax.rl",),
    ("sparrow_jax.run",),  # entry: config -> typed specs -> everything
)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported project module: line of the first such import}."""
    edges: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        found: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(name, path.name == "__init__.py", node)
                # ``from pkg import sub`` imports the submodule when one exists.
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names]
            for t in targets:
                while t and t not in modules:  # ``import a.b.c`` of a non-module attribute path
                    t = t.rpartition(".")[0]
                if t and t != name:
                    found.setdefault(t, node.lineno)
        edges[name] = found
    return edges


def layer_of(module: str) -> int:
    best, level = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    if level is None:
        raise AssertionError(f"module {module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return level


def layer_violations(edges: dict[str, dict[str, int]], modules: dict[str, Path]) -> list[str]:
    bad = []
    for src, targets in sorted(edges.items()):
        for dst, line in sorted(targets.items()):
            if layer_of(dst) > layer_of(src):
                bad.append(f"{src} -> {dst} ({modules[src].relative_to(ROOT)}:{line}): "
                           f"layer {layer_of(src)} imports layer {layer_of(dst)}")
    return bad


def import_cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return modules, import_edges(modules)


def test_every_module_has_a_layer(graph):
    modules, _ = graph
    for m in modules:
        layer_of(m)


def test_no_import_against_the_layer_order(graph):
    modules, edges = graph
    bad = layer_violations(edges, modules)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycles(graph):
    _, edges = graph
    cycles = import_cycles(edges)
    lines = [" <-> ".join(c) + "  edges: " + ", ".join(f"{a} -> {b}" for a in c for b in edges[a] if b in c)
             for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(lines)


def test_checker_finds_a_cycle_and_a_layer_violation():
    """The checks themselves: a deferred upward import is both a layer violation and a cycle."""
    edges = {"sparrow_jax.models.forward": {"sparrow_jax.attention.decode": 1},
             "sparrow_jax.attention.decode": {"sparrow_jax.models.forward": 7}}
    paths = {m: ROOT / (m.replace(".", os.sep) + ".py") for m in edges}
    assert import_cycles(edges) == [sorted(edges)]
    bad = layer_violations(edges, paths)
    assert len(bad) == 1 and bad[0].startswith("sparrow_jax.attention.decode -> sparrow_jax.models.forward")
