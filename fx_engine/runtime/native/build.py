"""Build fx-engine's native kernels (kernels.cpp) on first use, once per machine.

Why at first use rather than at `pip install`: the extension must be compiled against the
exact MLX that is installed (its C++ headers and libmlx ship in the mlx wheel) and with
the nanobind ABI that MLX's own Python module uses, and it is worth compiling for the
machine's own CPU (-march=native). A build takes ~15-30 s on 2 cores; the result is
cached under `~/.cache/fx-engine/native/<key>/` (or $FX_ENGINE_CACHE/native), keyed on
the kernel source and this file (flags, check), MLX, nanobind, Python, compiler and CPU,
so a change to any of them rebuilds (older builds stay; delete the folder to reclaim them).

A new build is checked in a subprocess (import, run, compare with numpy) before it is
used, so a miscompiled or unsupported binary (e.g. an instruction the VM does not allow)
cannot crash the engine: the engine then runs MLX's own ops instead. A failed build is
remembered (`FAILED` beside it, with the reason) and not retried until the key changes or
FX_ENGINE_NATIVE=rebuild is set.

FX_ENGINE_NATIVE_ARCH=FLAGS (e.g. `-march=x86-64-v3`, plain AVX2 + FMA) builds for another
target than this CPU (its own cached build): how the kernels' paths for other CPUs are
measured and tested on one machine (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from fx_engine.progress import interactive, working

SOURCE = Path(__file__).with_name("kernels.cpp")


def sources() -> list[Path]:
    """Every file the build compiles: kernels.cpp and the kernel-family headers it
    includes (all part of the build's cache key)."""
    return [SOURCE, *sorted(SOURCE.parent.glob("*.h"))]


MODULE_NAME = "_fx_native"

_SMOKE = r"""
import sys, importlib.util
import numpy as np
import mlx.core as mx
spec = importlib.util.spec_from_file_location("_fx_native", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
rng = np.random.default_rng(0)
for bits in (4, 8):
    w = mx.array(rng.standard_normal((40, 96)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=32, bits=bits)
    x = mx.array(rng.standard_normal((37, 96)).astype(np.float32))
    ref = np.asarray(x) @ np.asarray(mx.dequantize(wq, s, b, group_size=32, bits=bits)).T
    for op in (mod.qmm, mod.qgemm):
        got = np.asarray(op(x, wq, s, b, 32, bits))
        assert np.allclose(got, ref, rtol=1e-4, atol=1e-4), (op, bits, np.abs(got - ref).max())
    a8 = np.asarray(mod.qmm_a8(x, wq, s, b, 32, bits))  # 8-bit activations: ~1% off
    assert np.abs(a8 - ref).max() < 0.05 * np.abs(ref).max(), ("qmm_a8", bits)
    deq = np.asarray(mod.dequantize(wq, s, b, 32, bits))
    assert np.array_equal(deq, np.asarray(mx.dequantize(wq, s, b, group_size=32, bits=bits))), bits
q = rng.standard_normal((2, 1, 4, 32)).astype(np.float32)
k = rng.standard_normal((2, 2, 40, 32)).astype(np.float32)
v = rng.standard_normal((2, 2, 40, 32)).astype(np.float32)
m = np.zeros((2, 1, 40), bool); m[0, 0, :17] = True; m[1, 0, :40] = True
out = np.asarray(mod.attend(mx.array(q), mx.array(k), mx.array(v), mx.array(m), 0.2))
for bi in range(2):
    for h in range(4):
        sc = (q[bi, 0, h] * 0.2) @ k[bi, h // 2].T
        sc = np.where(m[bi, 0], sc, -np.inf); p = np.exp(sc - sc.max()); p /= p.sum()
        assert np.allclose(out[bi, 0, h * 32:(h + 1) * 32], p @ v[bi, h // 2], atol=1e-4), (bi, h)
sm = np.asarray(mod.masked_softmax(mx.array(k[:, :, :3, :]), mx.array(m[:, :1, :32].repeat(3, 1))))
assert np.allclose(sm.sum(-1), 1.0, atol=1e-5)
print("ok")
"""


class BuildError(RuntimeError):
    pass


class _CompileError(BuildError):
    """The compiler rejected the source or its flags."""


class _Transient(BuildError):
    """The compiler or the check was killed by a signal (e.g. out of memory)."""


def cache_root() -> Path:
    root = os.environ.get("FX_ENGINE_CACHE")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fx-engine"
    return base / "native"


def _compiler() -> str | None:
    for c in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if c and shutil.which(c):
            return c
    return None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read(65536).splitlines() if ln.startswith(("flags", "model name", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _paths() -> dict[str, str]:
    import mlx.core as mx
    import nanobind

    # The folder of mlx.core itself (`mlx` is a namespace package: its __path__ may list
    # other folders named mlx on sys.path first).
    mlx_dir = Path(mx.__file__).resolve().parent
    return {
        "mlx_include": str(mlx_dir / "include"),
        "mlx_lib": str(mlx_dir / "lib"),
        "nb_include": nanobind.include_dir(),
        "nb_src": nanobind.source_dir(),
        "robin_map": str(Path(nanobind.include_dir()).parent / "ext" / "robin_map" / "include"),
        "py_include": sysconfig.get_paths()["include"],
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX") or ".so",
    }


def build_key(cxx: str) -> str:
    import mlx.core as mx
    import nanobind

    try:
        cc_version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        cc_version = cxx
    h = hashlib.sha256()
    for f in sources():  # name, length, contents: text moved between files changes the key
        data = f.read_bytes()
        h.update(f"{f.name}:{len(data)}\0".encode())
        h.update(data)
    for part in (Path(__file__).read_bytes(), mx.__version__.encode(), nanobind.__version__.encode(),
                 sys.version.encode(), cc_version.encode(), _cpu_id().encode(),
                 os.environ.get("FX_ENGINE_NATIVE_ARCH", "").encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _flag_sets() -> list[list[str]]:
    """-march=native first; a portable build if that binary fails its check."""
    forced = os.environ.get("FX_ENGINE_NATIVE_ARCH")
    if forced:
        return [forced.split()]
    if platform.machine() in ("x86_64", "AMD64"):
        return [["-march=native"], ["-march=x86-64-v3"], []]
    return [["-mcpu=native"], []]


def _compile(cxx: str, paths: dict[str, str], arch: list[str], out: Path) -> None:
    """Compile the kernels and nanobind's library at once (two compilers: the kernels take
    most of the time, the library's few seconds come free on a second core), then link."""
    flags = [
        cxx, "-O3", *arch, "-std=gnu++20", "-fPIC", "-fvisibility=hidden",
        "-fno-math-errno", "-ffp-contract=off", "-DNDEBUG", "-DNB_DOMAIN=mlx", "-DNB_COMPACT_ASSERTIONS",
        f"-I{paths['nb_include']}", f"-I{paths['robin_map']}", f"-I{paths['py_include']}",
        f"-I{paths['mlx_include']}",
    ]
    units = [SOURCE, Path(paths["nb_src"]) / "nb_combined.cpp"]
    objects = [out.with_name(f"{out.name}.{k}.o") for k in range(len(units))]
    link = [cxx, *arch, "-shared", *map(str, objects), f"-L{paths['mlx_lib']}", "-lmlx",
            f"-Wl,-rpath,{paths['mlx_lib']}", "-o", str(out)]
    if sys.platform == "darwin":
        link[link.index("-shared")] = "-bundle"
        link += ["-undefined", "dynamic_lookup"]
    procs: list[subprocess.Popen] = []
    try:
        for u, o in zip(units, objects):
            procs.append(subprocess.Popen([*flags, "-c", str(u), "-o", str(o)], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True))
        errs = [p.communicate(timeout=900)[1] for p in procs]
        for p, err in zip(procs, errs):
            _compiled(p.returncode, err, arch)
        r = subprocess.run(link, capture_output=True, text=True, timeout=900)
        _compiled(r.returncode, r.stderr, arch)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for o in objects:
            o.unlink(missing_ok=True)


FALLBACK = "fallback: this build replaces the failed"  # BUILD's line after a failed first choice


def fallback(path: Path | str | None) -> str | None:
    """Why the build at `path` is not the first choice of flags for this machine (the failed
    attempt's first line), or None. A compile error in the -march=native variant would
    otherwise pass unnoticed: the generic build runs every kernel, only slower."""
    if not path:
        return None
    try:
        text = (Path(path).parent / "BUILD").read_text()
    except OSError:
        return None
    if FALLBACK not in text:
        return None
    rest = text.split(FALLBACK, 1)[1].strip().splitlines()
    return " ".join(rest[:2]).strip() or "an earlier attempt failed"


def _compiled(returncode: int, stderr: str, arch: list[str]) -> None:
    if returncode < 0:
        raise _Transient(f"the compiler was killed by signal {-returncode}")
    if returncode != 0:
        raise _CompileError(f"compiling {SOURCE.name} failed ({' '.join(arch) or 'generic'}):\n{stderr[-4000:]}")


def _check(path: Path) -> None:
    env = dict(os.environ, FX_ENGINE_NATIVE="0")
    r = subprocess.run([sys.executable, "-c", _SMOKE, str(path)], capture_output=True, text=True,
                       env=env, timeout=300)
    if r.returncode < 0 and -r.returncode in (9, 15):  # killed from outside, not a crash
        raise _Transient(f"the check was killed by signal {-r.returncode}")
    if r.returncode != 0 or "ok" not in r.stdout:
        raise BuildError(f"the built kernels failed their check (exit {r.returncode}):\n"
                         f"{(r.stderr or r.stdout)[-2000:]}")


def build(*, force: bool = False, log=None) -> Path:
    """Return the path of a checked extension for this machine, building it if needed."""
    cxx = _compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++ or clang++)")
    try:
        paths = _paths()
    except ImportError as e:
        raise BuildError(f"cannot build native kernels: {e} (pip install nanobind)") from e
    d = cache_root() / build_key(cxx)
    d.mkdir(parents=True, exist_ok=True)
    target = d / (MODULE_NAME + paths["ext_suffix"])
    failed = d / "FAILED"
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if target.exists() and not force:
            return target
        if failed.exists() and not force:
            raise BuildError(f"an earlier build failed (FX_ENGINE_NATIVE=rebuild retries):\n{failed.read_text()}")
        errors = []
        candidates = _flag_sets()
        i = 0
        while i < len(candidates):
            arch = candidates[i]
            tmp = d / f"tmp-{os.getpid()}{paths['ext_suffix']}"
            try:
                what = f"compiling native CPU kernels ({' '.join(arch) or 'generic'}), once per machine"
                if log and not interactive():
                    log(f"fx-engine: {what}...")  # a log line; a terminal gets a live spinner
                with working(what) if log else contextlib.nullcontext():
                    _compile(cxx, paths, arch, tmp)
                _check(tmp)
                os.replace(tmp, target)
                failed.unlink(missing_ok=True)
                info = f"compiler: {cxx}\nflags: {' '.join(arch)}\nsource: {SOURCE}\n"
                if errors:  # a more portable build than this machine could run: say why
                    first = ' '.join(candidates[0]) or 'generic'
                    info += f"{FALLBACK} {first}:\n" + "\n\n".join(errors) + "\n"
                    if log:
                        log(f"fx-engine: the native kernels' {first} build failed "
                            f"({errors[0].strip().splitlines()[0]}); using the {' '.join(arch) or 'generic'} "
                            f"build instead, which is slower (details: {d / 'BUILD'})")
                (d / "BUILD").write_text(info)
                return target
            except (subprocess.TimeoutExpired, _Transient) as e:
                # A loaded machine or a killed compiler says nothing about this build:
                # not remembered, the next process tries again.
                tmp.unlink(missing_ok=True)
                raise BuildError(f"native kernel build interrupted ({e}); will retry next time") from e
            except (BuildError, subprocess.SubprocessError, OSError) as e:
                errors.append(str(e))
                tmp.unlink(missing_ok=True)
                # A compile error is not about the CPU flags: go straight to the generic
                # build; a binary that fails its check tries the next, more portable flags.
                i = len(candidates) - 1 if isinstance(e, _CompileError) and i < len(candidates) - 1 else i + 1
        failed.write_text("\n\n".join(errors))
        raise BuildError("\n\n".join(errors))


def import_extension(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise BuildError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
