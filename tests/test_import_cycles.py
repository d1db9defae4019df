"""No import cycles in ddpexp: every module depends only on modules below it.

The graph counts every import a module makes, wherever it stands: at module level, under
`TYPE_CHECKING`, or inside a function. A function-local import still says "this module needs that
one", so hiding a cycle inside a function does not break it. Importing `pkg.sub` is an edge to
`pkg.sub` only: a package's `__init__` is a module like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import REPO


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `package_dir`."""
    names = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file."""
    root = name.split(".")[0]
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def closest(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from pkg import sub` imports the module pkg.sub; `from pkg import name` only pkg
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == root and (hit := closest(target)) and hit != name:
                found.add(hit)
    return found


def cycles(package_dir: Path) -> list[list[str]]:
    """The import graph's strongly connected components with more than one module (Tarjan)."""
    known = module_names(package_dir)
    graph = {name: imported_modules(name, path, known) for name, path in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_ddpexp_has_no_import_cycle():
    found = cycles(REPO / "ddpexp")
    assert not found, "import cycles (each line: modules that import each other round a loop):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_walk_finds_cycles_hidden_in_functions_and_type_checking(tmp_path: Path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from .sub import high\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "high.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import low\n"
    )
    (pkg / "alone.py").write_text("import pkg.low\nfrom pkg.sub import high\n")
    assert cycles(pkg) == [["pkg.low", "pkg.sub.high"]]
    (pkg / "low.py").write_text("")
    assert cycles(pkg) == []
