"""No import circles in strata/: no module imports, directly or through others, a module that
imports it back. Every import statement counts, those inside functions and under
TYPE_CHECKING too: a circle that only laziness keeps from failing still ties two files
together."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (`from a.b import c` names a.b.c where that
    is a module, else a.b)."""
    files = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    target = target if target in files else node.module
                    if target in files and target != name:
                        graph[name].add(target)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in files} - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_strata_has_no_import_circles():
    graph = import_graph(ROOT / "strata")
    assert len(graph) > 100 and graph["strata.kernels.quant_triton"]   # the graph was read
    assert circles(graph) == []


def test_a_circle_through_a_lazy_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    import pkg.a\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.b"] == {"pkg.c"} and graph["pkg.d"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


# which of strata's packages each may import (README's and DESIGN's rule: launch -> coordinator
# -> protocol <- stage_worker -> kernels; the coordinator and the stage worker never import each
# other; model, trace and config_error are shared; the benchmarks and the trainer import the
# runtime and nothing of the runtime imports them)
RUNTIME = {"launch", "coordinator", "stage_worker", "protocol", "kernels", "model", "trace",
           "config_error"}
ALLOWED = {
    "launch": RUNTIME,
    "coordinator": {"protocol", "model", "trace", "config_error"},
    "stage_worker": {"protocol", "kernels", "model", "trace", "config_error"},
    "protocol": {"config_error"},
    "kernels": {"config_error"},
    "model": {"kernels", "config_error"},
    "trace": set(),
    "config_error": set(),
    "bench": RUNTIME | {"train"},
    "train": RUNTIME,
    "heads": set(),
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_each_package_imports_only_what_the_layers_allow():
    graph = import_graph(ROOT / "strata")
    crossing = {(_package(a), _package(b)) for a, targets in graph.items() for b in targets
                if _package(a) != _package(b) and _package(a) != "strata"}
    assert ("launch", "coordinator") in crossing          # the graph was read across packages
    wrong = sorted((a, b) for a, b in crossing if b not in ALLOWED.get(a, set()))
    assert not wrong, f"imports across packages that the layers forbid: {wrong}"
