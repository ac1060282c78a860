"""No import circles in strata/: no module imports, directly or through others, a module that
imports it back; and each package imports only what its docstring's `May import:` line allows.
Every import statement counts, those inside functions and under TYPE_CHECKING too: a circle
that only laziness keeps from failing still ties two files together."""
from __future__ import annotations

import ast
import re
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
    assert len(graph) > 100 and graph["strata.kernels.quant.float_triton"]   # the graph was read
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


# The layers: each of strata's packages (and top-level modules) and each of the coordinator's
# and the kernels' sub-packages says in its docstring what it may import, on one line
# "May import: a, b" (names under strata/, "nothing" for none). A module obeys its own line where
# it states one (kernels' fused, moe and moe_triton sit above kernels.quant, kernels' other
# modules below it), else the nearest package above it that says so.
# A package named allows its sub-packages too, except from inside it: there it means the modules
# directly in it that state no line of their own (the coordinator's shared nouns), and each
# sibling is named.
RULE = re.compile(r"^May import: (.+)$", re.M)


def read_rules(package: Path) -> dict[str, set[str]]:
    """room -> the rooms it may import, from the `May import:` lines ("coordinator.engine")."""
    rules = {}
    for path in package.rglob("*.py"):
        found = RULE.findall(ast.get_docstring(ast.parse(path.read_text())) or "")
        parts = path.relative_to(package).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if found and name:
            rules[name] = set() if found[0] == "nothing" else set(found[0].split(", "))
    return rules


def room(name: str, rules: dict[str, set[str]]) -> str | None:
    """The nearest module or package at or above `name` (dotted, under the root) that states a
    rule."""
    parts = name.split(".") if name else []
    return next((".".join(parts[:i]) for i in range(len(parts), 0, -1)
                 if ".".join(parts[:i]) in rules), None)


def allows(rules: dict[str, set[str]], a: str, b: str) -> bool:
    """Whether room a may import room b."""
    return any(b == name or (b.startswith(name + ".") and not f"{a}.".startswith(name + "."))
               for name in rules[a])


def rule_errors(rules: dict[str, set[str]]) -> list[str]:
    """Names that state no rule, a sub-package allowed outside its parent what its parent is
    not, and rooms that may import each other (a circle of packages)."""
    errors = [f"rooms that may import each other: {c}"
              for c in circles({name: names & set(rules) for name, names in rules.items()})]
    for name, names in sorted(rules.items()):
        errors += [f"{name} names {n}, which states no rule" for n in sorted(names - set(rules))]
        parent = room(name.rpartition(".")[0], rules)
        if parent is not None:
            outside = {n for n in names if n != parent and not n.startswith(parent + ".")}
            errors += [f"{name} may import {n}, which {parent} may not"
                       for n in sorted(outside - rules[parent])]
    return errors


def forbidden(package: Path) -> list[str]:
    """The imports across rooms that the importer's rule does not allow, as "a -> b"."""
    rules, graph = read_rules(package), import_graph(package)
    out = []
    for a, targets in graph.items():
        for b in targets:
            ra, rb = room(a.partition(".")[2], rules), room(b.partition(".")[2], rules)
            if ra is not None and ra != rb and (rb is None or not allows(rules, ra, rb)):
                out.append(f"{a} -> {b}")
    return sorted(out)


def test_each_package_imports_only_what_its_docstring_allows():
    rules = read_rules(ROOT / "strata")
    top = {p.stem for p in (ROOT / "strata").iterdir()
           if p.suffix == ".py" and p.stem != "__init__" or (p / "__init__.py").exists()}
    assert top - set(rules) == set(), "a package of strata states no `May import:` line"
    assert {"coordinator.api", "coordinator.engine", "coordinator.speculation",
            "coordinator.stages"} <= set(rules) and rules["trace"] == set()
    assert room("coordinator.api.page", rules) == "coordinator.api"
    assert room("coordinator.slots", rules) == "coordinator"
    assert room("kernels.quant.ops", rules) == "kernels.quant"
    assert room("kernels.rope", rules) == "kernels" and room("kernels.moe", rules) == "kernels.moe"
    assert "kernels.quant" in rules["kernels.fused"] and rules["kernels.quant"] == {"kernels"}
    assert rule_errors(rules) == []
    wrong = forbidden(ROOT / "strata")
    assert not wrong, f"imports that the packages' `May import:` lines forbid: {wrong}"


def test_an_import_a_docstring_forbids_is_reported(tmp_path):
    pkg = tmp_path / "pkg"
    for name, doc in [("", ""), ("low", "May import: nothing"), ("top", "Top.\nMay import: low"),
                      ("top/engine", "May import: top"), ("top/api", "May import: top.engine, top"),
                      ("other", "May import: top, low")]:
        (pkg / name).mkdir(parents=True, exist_ok=True)
        (pkg / name / "__init__.py").write_text(f'"""{doc}"""\n')
    (pkg / "top" / "nouns.py").write_text("import pkg.low.a\n")              # allowed
    (pkg / "top" / "api" / "b.py").write_text("from pkg.top.engine import c\n")   # allowed
    (pkg / "top" / "engine" / "c.py").write_text("from pkg.top import nouns\n"     # allowed
                                                 "def f():\n    from pkg.top.api import b\n")
    (pkg / "low" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from pkg.top import nouns\n")
    (pkg / "other" / "d.py").write_text("import pkg.top.api.b\n")   # a sub-package from outside
    (pkg / "top" / "upper.py").write_text('"""May import: top.api, top"""\n'   # its own rule
                                          "import pkg.top.api.b\nimport pkg.top.nouns\n")
    rules = read_rules(pkg)
    assert rules["top.api"] == {"top.engine", "top"} and rules["low"] == set()
    assert rules["top.upper"] == {"top.api", "top"} and room("top.upper", rules) == "top.upper"
    assert rule_errors(rules) == []
    assert forbidden(pkg) == ["pkg.low.a -> pkg.top.nouns", "pkg.top.engine.c -> pkg.top.api.b"]
    (pkg / "top" / "engine" / "__init__.py").write_text('"""May import: top, other"""\n')
    assert rule_errors(read_rules(pkg)) == ["top.engine may import other, which top may not"]
    (pkg / "low" / "__init__.py").write_text('"""May import: other"""\n')
    assert rule_errors(read_rules(pkg))[0] == ("rooms that may import each other: "
                                               "['low', 'other', 'top']")
