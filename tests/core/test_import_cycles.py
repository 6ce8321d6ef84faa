"""No import cycles among fx_engine's modules (issue 43: "no import circles; a test in the
suite fails on one").

The rule, checked statically (the source is parsed with `ast`, nothing is imported):

* An edge A -> B for every `import B`, `from B import name` and relative import in module
  A, where B is a module of fx_engine. `from P import name` is an edge to the submodule
  P.name when there is one, else to P itself (the name is P's attribute). Importing P.name
  also runs P's __init__ first, but that is not an edge: `from P import sub` works while P
  is still half-initialized, and every package would otherwise be in a cycle with its own
  modules.
* Imports at module level (in class bodies and in module-level `if` / `try` / `with`
  blocks too) are *eager* edges. Imports inside `if TYPE_CHECKING:` are no edge at all
  (they never run). Imports inside a function, and `importlib.import_module("...")` calls
  there with a literal name, are *lazy* edges. (Imports whose name is computed at run time
  are not seen.)
* There is no cycle at all, eager or lazy: an import moved into a function to break a
  cycle hides the circle from the interpreter, it does not remove it. A lazy import that
  closes a cycle and is truly needed goes into LAZY_ALLOWED, with its reason; the list is
  meant to stay (nearly) empty. A lazy import that closes no cycle (one made lazy to keep
  start-up fast, say) is fine and needs no entry.

One test per group (each subpackage of fx_engine, and fx_engine's own top-level modules):
a group fails on every cycle through one of its modules, and the message lists each cycle
as a path, lazy edges marked.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections import deque
from pathlib import Path

import pytest

#: (importer, imported) lazy edges allowed to close a cycle, each with its reason.
LAZY_ALLOWED: dict[tuple[str, str], str] = {}

PACKAGE = "fx_engine"
ROOT = Path(importlib.util.find_spec(PACKAGE).submodule_search_locations[0])
TOP = "(top level)"  # the group of fx_engine's own modules (fx_engine/__init__.py, cli.py, ...)


# ---- the detector (also run on a synthetic package by the self-tests below)

def _modules(root: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every .py file of the package at `root`."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = [package, *f.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> list[tuple[ast.AST, bool]]:
    """Every import statement (and literal importlib.import_module call) of a module,
    with whether it is lazy (inside a function); none from `if TYPE_CHECKING:` blocks."""
    found: list[tuple[ast.AST, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, lazy))
            return
        if isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.orelse:
                visit(child, lazy)
            return
        if (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
                and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
                == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            found.append((node, lazy))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    for stmt in tree.body:
        visit(stmt, False)
    return found


def import_graph(root: Path, package: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(eager, lazy): each module's fx_engine modules imported at module level, and those
    imported only inside functions (see the module docstring)."""
    mods = _modules(root, package)
    eager: dict[str, set[str]] = {m: set() for m in mods}
    lazy: dict[str, set[str]] = {m: set() for m in mods}

    def known(name: str) -> str | None:  # the module itself, or the package it is an attribute of
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in mods.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node, is_lazy in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.Call):  # importlib.import_module("...")
                targets = [known(node.args[0].value)]
            else:
                if node.level:  # relative: from the module's package, `level - 1` up
                    base = here[: len(here) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for a in node.names:
                    sub = f"{source}.{a.name}"
                    targets.append(sub if sub in mods else known(source))
            for t in targets:
                if t is not None:
                    (lazy if is_lazy else eager)[mod].add(t)
        lazy[mod] -= eager[mod]
    return eager, lazy


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with a cycle (Tarjan's, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph.get(v, ()):
                    out.append(sorted(comp))
    return sorted(out)


def _shortest_cycle(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a path back to it."""
    start, inside = comp[0], set(comp)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & inside):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")  # (a component always has one)


def import_cycles(root: Path, package: str,
                  allowed: dict[tuple[str, str], str] | None = None) -> list[tuple[list[str], str]]:
    """Every import cycle of the package (see the module docstring): (its modules, one
    cycle through them written out, lazy edges marked `-(lazy)->`)."""
    eager, lazy = import_graph(root, package)
    graph = {m: eager[m] | {t for t in lazy[m] if (m, t) not in (allowed or {})} for m in eager}
    out = []
    for comp in _components(graph):
        path = _shortest_cycle(graph, comp)
        text = path[0] + "".join(f" {'-(lazy)->' if b in lazy[a] else '->'} {b}"
                                 for a, b in zip(path, path[1:]))
        out.append((comp, text))
    return out


def _group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (ROOT / parts[1]).is_dir()) else TOP


@functools.lru_cache(maxsize=None)
def _package_cycles() -> tuple[tuple[tuple[str, ...], str], ...]:
    return tuple((tuple(c), t) for c, t in import_cycles(ROOT, PACKAGE, LAZY_ALLOWED))


GROUPS = sorted({_group(m) for m in _modules(ROOT, PACKAGE)})


# ---- the package's own modules

@pytest.mark.parametrize("group", GROUPS)
def test_no_import_cycle(group):
    cycles = [(c, t) for c, t in _package_cycles() if any(_group(m) == group for m in c)]
    assert not cycles, f"{len(cycles)} import cycle(s) through {PACKAGE}.{group}:\n" + "\n".join(
        f"  {t}\n    (all of: {', '.join(c)})" for c, t in cycles)


def test_allowed_lazy_imports_are_still_there_and_needed():
    """An entry of LAZY_ALLOWED names a lazy import that exists and closes a cycle (an
    entry that no longer does is removed, so that the list stays honest)."""
    eager, lazy = import_graph(ROOT, PACKAGE)
    full = {m: eager[m] | lazy[m] for m in eager}
    for (a, b), reason in LAZY_ALLOWED.items():
        assert reason and b in lazy.get(a, ()), f"{a} -> {b}: no such lazy import"
        assert any(a in c and b in c for c in _components(full)), f"{a} -> {b}: closes no cycle"


# ---- the detector itself, on a synthetic package

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
        if "/" in name and not (root / name).parent.joinpath("__init__.py").exists():
            (root / name).parent.joinpath("__init__.py").write_text("")
    return root


def test_detector_finds_a_module_level_cycle(tmp_path):
    root = _package(tmp_path, {"a.py": "from pkg import b\n",
                               "b.py": "import pkg.c\n",
                               "c.py": "from .a import thing\n",
                               "d.py": "from pkg.a import thing\n"})  # into the cycle, not on it
    [(modules, path)] = import_cycles(root, "pkg")
    assert modules == ["pkg.a", "pkg.b", "pkg.c"]
    assert path == "pkg.a -> pkg.b -> pkg.c -> pkg.a"


def test_detector_finds_a_cycle_closed_by_a_lazy_import_unless_allowed(tmp_path):
    root = _package(tmp_path, {"app.py": "def f():\n    from pkg.sub import x\n",
                               "sub/__init__.py": "",
                               "sub/x.py": "from ..app import f\n"})
    [(modules, path)] = import_cycles(root, "pkg")
    assert modules == ["pkg.app", "pkg.sub.x"]
    assert path == "pkg.app -(lazy)-> pkg.sub.x -> pkg.app"
    assert import_cycles(root, "pkg", {("pkg.app", "pkg.sub.x"): "needed because ..."}) == []


def test_detector_ignores_type_checking_and_other_packages(tmp_path):
    root = _package(tmp_path, {
        "a.py": "from typing import TYPE_CHECKING\nimport json\nif TYPE_CHECKING:\n"
                "    from pkg import b\nelse:\n    import os\n",
        "b.py": "import pkg.a\ndef f():\n    import importlib\n"
                "    return importlib.import_module('pkg.c')\n",
        "c.py": "class C:\n    from pkg import b\n"})
    eager, lazy = import_graph(root, "pkg")
    assert eager["pkg.a"] == set() and lazy["pkg.a"] == set()
    assert eager["pkg.b"] == {"pkg.a"} and lazy["pkg.b"] == {"pkg.c"}
    assert eager["pkg.c"] == {"pkg.b"}  # a class body runs at import time
    [(modules, path)] = import_cycles(root, "pkg")  # b -(lazy)-> c -> b
    assert modules == ["pkg.b", "pkg.c"] and "-(lazy)->" in path


def test_detector_reads_a_package_attribute_as_an_edge_to_the_package(tmp_path):
    root = _package(tmp_path, {"__init__.py": "from pkg.core import run\n",
                               "core.py": "from pkg import VERSION\n"})
    [(modules, _)] = import_cycles(root, "pkg")
    assert modules == ["pkg", "pkg.core"]
