"""The built wheel (issue 44, item 6): `pip wheel .` ships every file the package needs at run
time (the native kernels' C++ sources and headers, which are compiled on the user's machine
at first use; the web chat page), installs into a fresh venv, and there `python -m fx_engine`
and `fx-engine info` work: the native kernels build from the wheel's own sources.

The fresh venv gets the wheel without its dependencies (this machine may have no network);
they come from the project's venv through a .pth line, which adds its site-packages as a
plain folder (its editable-install hook is not run), so `fx_engine` is the wheel's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _package_files() -> set[str]:
    """Every file of the fx_engine package in the source tree (no caches or build output)."""
    out = set()
    for p in (ROOT / "fx_engine").rglob("*"):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so", ".o"):
            out.add(p.relative_to(ROOT).as_posix())
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel . --no-deps` builds, from a copy of the sources (setuptools
    writes build/ next to them)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "fx_engine", src / "fx_engine",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-w", str(out)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and any(s in r.stdout + r.stderr for s in (
            "No matching distribution found for setuptools", "Could not find a version that satisfies")):
        pytest.skip("pip cannot fetch the build backend (setuptools) without network")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    [whl] = out.glob("fx_engine-*.whl")
    return whl


def test_the_wheel_holds_every_package_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = _package_files() - names
    assert not missing, f"not in the wheel: {sorted(missing)}"
    native = {n for n in names if n.startswith("fx_engine/runtime/native/")}
    assert "fx_engine/runtime/native/kernels.cpp" in native
    assert any(n.endswith(".h") for n in native)
    if (ROOT / "fx_engine/server/static").is_dir():
        assert any(n.startswith("fx_engine/server/static/") for n in names)
    assert "fx_engine/__main__.py" in names
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "fx-engine = fx_engine.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_wheel_installs_and_runs(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "zz_fx_engine_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {**os.environ, "FX_ENGINE_CACHE": str(tmp_path / "cache"),  # a fresh native build
           "FX_ENGINE_PROGRESS": "0"}
    env.pop("PYTHONPATH", None)
    where = subprocess.run([str(py), "-c", "import fx_engine; print(fx_engine.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert where.stdout.strip().startswith(site), where  # the wheel's, not the checkout's
    helped = subprocess.run([str(py), "-m", "fx_engine", "--help"], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=120)
    assert helped.returncode == 0 and "usage: fx-engine" in helped.stdout, helped.stderr
    info = subprocess.run([str(env_dir / "bin" / "fx-engine"), "info"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=600)
    assert info.returncode == 0, info.stderr[-3000:]
    native = next(line for line in info.stdout.splitlines() if line.startswith("native CPU kernels"))
    if shutil.which(os.environ.get("CXX") or "g++") or shutil.which("clang++"):
        assert " on, " in native and str(tmp_path / "cache") in native, native
