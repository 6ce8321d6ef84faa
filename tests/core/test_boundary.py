"""The core/shell boundary, checked: fx_engine/core/ is pure.

Every core module (an AST check of its source): imports only the core itself, MLX, numpy,
attrs, jaxtyping and pure parts of the standard library; opens no files and reads no
environment or clock; draws randomness only from PRNG keys it is given (every
`mx.random.<draw>(...)` call passes `key=`). Importing the core sets nothing up (no BLAS
preload, no malloc tuning, no shell module imported).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "fx_engine" / "core"
ALLOWED_IMPORTS = {
    "__future__", "typing", "typing_extensions", "collections", "collections.abc", "math",
    "numbers", "operator", "functools", "itertools", "types", "dataclasses", "enum", "abc", "re", "difflib",
    "weakref", "threading",  # tree.py: the compile wrapper's per-thread cache (a memo)
    "attrs", "jaxtyping", "numpy", "mlx", "mlx.core",
}
FORBIDDEN_NAMES = {"open", "input", "print", "eval", "exec", "__import__", "breakpoint"}
FORBIDDEN_ATTRS = {("os", "environ"), ("os", "getenv"), ("np", "random"), ("time", "time")}
PRNG_FREE = {"key", "split"}  # mx.random functions that draw nothing


def _core_modules() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(CORE.parent.parent)
    out = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name not in ALLOWED_IMPORTS and not a.name.startswith("fx_engine.core"):
                    out.append(f"{where}: imports {a.name}")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
                target = base / (node.module or "").replace(".", "/")
                if CORE not in (target, *target.parents):
                    out.append(f"{where}: relative import leaves the core ({node.module})")
            elif node.module not in ALLOWED_IMPORTS and not (
                    node.module == "fx_engine.core" or node.module.startswith("fx_engine.core.")):
                out.append(f"{where}: imports from {node.module}")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in FORBIDDEN_NAMES:
                out.append(f"{where}: calls {f.id}()")
            chain = []
            while isinstance(f, ast.Attribute):
                chain.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                chain.append(f.id)
            chain.reverse()
            if chain[:2] == ["mx", "random"] and len(chain) == 3 and chain[2] not in PRNG_FREE:
                if not any(k.arg == "key" for k in node.keywords):
                    out.append(f"{where}: mx.random.{chain[2]}() without key=")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in FORBIDDEN_ATTRS:
                out.append(f"{where}: uses {node.value.id}.{node.attr}")
    return out


@pytest.mark.parametrize("path", _core_modules(), ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_is_pure(path: Path) -> None:
    assert _violations(path) == []


def test_the_checker_catches_what_it_should(tmp_path: Path) -> None:
    """The check itself, on a module that breaks every rule (so it cannot pass vacuously)."""
    bad = CORE / "_boundary_probe_tmp.py"
    bad.write_text(
        "import os\nimport time\nimport secrets\nfrom fx_engine.engine import engine\n"
        "from ..loading import weights\nimport mlx.core as mx\nimport numpy as np\n"
        "x = os.environ['A']\ny = open('f')\nz = mx.random.normal((2,))\n"
        "w = mx.random.normal((2,), key=mx.random.key(0))\nv = np.random.rand(2)\n"
    )
    try:
        found = "\n".join(_violations(bad))
    finally:
        bad.unlink()
    for what in ("imports os", "imports time", "imports secrets", "imports from fx_engine.engine",
                 "relative import leaves the core", "uses os.environ", "calls open()",
                 "mx.random.normal() without key=", "uses np.random"):
        assert what in found, what
    assert found.count("without key=") == 1


def test_importing_the_core_sets_nothing_up() -> None:
    """Process set-up belongs to the shell's entry points: importing every core module
    preloads no BLAS, tunes no malloc and imports no shell package."""
    mods = sorted({".".join(p.relative_to(CORE.parent.parent).with_suffix("").parts).removesuffix(".__init__")
                   for p in _core_modules()})
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in mods)
        + "from fx_engine.runtime import blas, malloc\n"
        "shell = sorted(m for m in sys.modules if m.startswith('fx_engine.') and not "
        "m.startswith(('fx_engine.core', 'fx_engine.runtime')))\n"
        "print(malloc.active(), blas.active()['name'].startswith('reference'), shell)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == "False True []", out.stdout + out.stderr


def test_nothing_outside_the_family_modules_names_a_family() -> None:
    """Family-specific classes are named only in fx_engine/core/models/ (where families
    compose each other's blocks and the registry lists them): the rest of the engine goes
    through the registry (`family_of`, `forward`, `cache_layout`, ...)."""
    import re

    from fx_engine.core.models import FAMILIES

    names = {n for fam in FAMILIES for n in (fam.config_type.__name__, fam.params_type.__name__)}
    pattern = re.compile(r"\b(" + "|".join(sorted(names)) + r")\b")
    models = CORE / "models"
    users = {str(p.relative_to(CORE.parent)): sorted(set(pattern.findall(p.read_text())))
             for p in CORE.parent.rglob("*.py") if models not in p.parents}
    assert {k: v for k, v in users.items() if v} == {}


def test_old_import_paths_are_the_moved_modules() -> None:
    """Code written against the flat layout keeps working: the old paths are the same
    module objects (not copies), and their names keep their real module's spec."""
    import importlib

    import fx_engine

    for old, new in fx_engine._MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
        assert importlib.import_module(new).__spec__.name == new
    for old, new in (("fx_engine.models.phi3", "fx_engine.core.models.phi3"),
                     ("fx_engine.models.llama", "fx_engine.core.models.llama"),
                     ("fx_engine.native.plan", "fx_engine.runtime.native.plan")):
        assert importlib.import_module(old) is importlib.import_module(new), old
    from fx_engine.steps import decode_step_compiled
    from fx_engine.core.steps import decode_step_compiled as moved

    assert decode_step_compiled is moved
    assert fx_engine.blas is importlib.import_module("fx_engine.runtime.blas")


@pytest.mark.parametrize("package", ["engine", "loading", "server", "testing", "tracing"])
def test_importing_a_shell_package_sets_the_process_up_first(package: str) -> None:
    """A program that imports a shell package directly (the pytest plugin, the Engine,
    the server app) gets the optimized BLAS: the package runs setup() before mlx loads."""
    code = (f"import fx_engine.{package}\nfrom fx_engine.runtime import blas, malloc\n"
            "print(malloc.active() or __import__('sys').platform != 'linux', "
            "not blas.active()['name'].startswith('unknown'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == "True True", out.stdout + out.stderr
    assert "imported before" not in out.stderr
