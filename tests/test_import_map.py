"""The import map of the package: no import circles (function-level imports included), and the library
core (functional, kernels, positional, patches) imports nothing from the workshop (tools, CLI) nor the
package face."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ("functional", "kernels", "positional", "patches")


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "patches":  # installed as torchembed.patches
        parts = ["torchembed", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_map() -> dict[str, set[str]]:
    """``module -> the package modules it imports`` (``from torchembed import kernels`` is an edge to
    ``torchembed.kernels``, not to the package face)."""
    files = [p for p in (ROOT / "torchembed").rglob("*.py") if "patches" not in p.relative_to(ROOT / "torchembed").parts[:1]]
    files += list((ROOT / "patches").rglob("*.py"))
    trees = {_module(p): ast.parse(p.read_text()) for p in files}
    graph = {}
    for name, tree in trees.items():
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in trees}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torchembed"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in trees else node.module)
        graph[name] = {d for d in deps if d in trees and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_map_has_no_circles():
    graph = import_map()
    assert len(graph) > 40 and "torchembed.patches.core" in graph and "torchembed.tools.zoo" in graph
    assert cycles(graph) == []


def test_the_core_imports_nothing_from_the_workshop_or_the_face():
    graph = import_map()
    core = [m for m in graph if m.split(".")[1:2] and m.split(".")[1] in CORE]
    assert len(core) > 25
    bad = [(m, d) for m in core for d in graph[m] if d.startswith("torchembed.tools") or d in ("torchembed", "torchembed.cli")]
    assert bad == []


def test_cycles_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
