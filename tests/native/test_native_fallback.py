"""fx_engine.runtime.native where the kernels cannot be used: these run on every machine (the
kernel tests in test_native.py skip where the kernels do not build)."""

from __future__ import annotations

from fx_engine.core.nn import Numerics


def test_build_failure_falls_back_to_mlx_ops(tmp_path, tiny_dir) -> None:  # noqa: ANN001
    """A machine where the kernels cannot be built (here: a compiler that always fails)
    gets a one-line warning and a working engine on MLX's ops; the failure is remembered
    and not retried by the next process."""
    import os
    import subprocess
    import sys

    cxx = tmp_path / "broken-c++"
    cxx.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    cxx.chmod(0o755)
    env = dict(os.environ, CXX=str(cxx), FX_ENGINE_CACHE=str(tmp_path / "cache"),
               FX_ENGINE_NATIVE="auto")
    code = ("import fx_engine; m = fx_engine.load(%r); "
            "print('native', m.params.numerics.native); "
            "print(fx_engine.generate(m, 'hello', max_tokens=3).usage.completion_tokens)") % str(tiny_dir)
    for attempt in range(2):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        assert "native False" in r.stdout and r.stdout.strip().endswith("3")
        assert "native CPU kernels unavailable" in r.stderr
        compiling = "compiling native CPU kernels" in r.stderr
        assert compiling == (attempt == 0)  # the second process does not try again
    assert list((tmp_path / "cache").glob("native/*/FAILED"))


def test_numerics_native_is_static() -> None:
    assert Numerics(native=True) != Numerics(native=False)  # part of the compile key


def test_a_fallback_build_is_recorded_and_reported(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """When the machine's first choice of flags fails to compile and a more portable build
    succeeds, the build says so (a log line, its BUILD file) and native.status() reports
    it: a compile error in the -march=native variant must not pass unnoticed as a slower
    generic build."""
    from fx_engine.runtime.native import build

    monkeypatch.setenv("FX_ENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_flag_sets", lambda: [["-march=native"], ["-march=x86-64-v3"], []])
    monkeypatch.setattr(build, "_paths", lambda: {"ext_suffix": ".so"})
    monkeypatch.setattr(build, "build_key", lambda cxx: "k")
    tried, broken = [], [True]

    def compile_(cxx, paths, arch, out) -> None:  # noqa: ANN001
        tried.append(arch)
        if arch == ["-march=native"] and broken[0]:
            raise build._CompileError("compiling kernels.cpp failed (-march=native):\nqmatmul.h:463: error: oops")
        out.write_bytes(b"built")

    monkeypatch.setattr(build, "_compile", compile_)
    monkeypatch.setattr(build, "_check", lambda path: None)
    logs: list[str] = []
    target = build.build(log=logs.append)
    assert tried == [["-march=native"], []]  # a compile error goes straight to the generic build
    assert target.read_bytes() == b"built"
    why = build.fallback(target)
    assert why is not None and "-march=native" in why
    assert any("-march=native build failed" in m and "generic" in m for m in logs)
    assert "qmatmul.h:463: error: oops" in (target.parent / "BUILD").read_text()
    # a build of the first choice records no fallback
    monkeypatch.setattr(build, "build_key", lambda cxx: "k2")
    broken[0] = False
    ok = build.build(log=logs.append)
    assert build.fallback(ok) is None and build.fallback(None) is None


def test_the_native_build_uses_this_machines_vector_extensions() -> None:
    """On an x86-64 machine with AVX-512 (or AVX2 + FMA) the loaded native build is that
    ISA's, not a fallback: the portable build gives the same results, so only this test
    notices a compile error in the machine's own variant (it did once: every kernel ran
    ~5x slower and every other test passed)."""
    import os
    import platform

    import pytest

    from fx_engine.runtime import native

    if platform.machine() not in ("x86_64", "AMD64") or os.environ.get("FX_ENGINE_NATIVE_ARCH"):
        pytest.skip("x86-64 with the default flags only")
    if native.ensure(quiet=True) is None:
        pytest.skip("no native kernels on this machine")
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    why = native.status()["fallback"]
    if why is not None and "failed their check" in why:
        pytest.skip(f"this machine cannot run its own ISA's build ({why}): the fallback is right")
    assert why is None, why  # a compile error in this machine's variant
    if "avx512f" in flags:
        assert native.isa() == "avx512"
    elif {"avx2", "fma"} <= flags:
        assert native.isa() == "avx2"


def test_info_prints_a_fallback_build(monkeypatch) -> None:  # noqa: ANN001
    """`fx-engine info`'s native line names a fallback build and why (nothing otherwise)."""
    import pytest

    from fx_engine import cli
    from fx_engine.runtime import native

    if native.ensure(quiet=True) is None:
        pytest.skip("no native kernels on this machine")
    real = native.status
    assert "fallback" not in cli._native_line() or real()["fallback"]
    monkeypatch.setattr(native, "status", lambda: {**real(), "fallback": "-march=native: compiling kernels.cpp failed"})
    line = cli._native_line()
    assert "fallback            -march=native: compiling kernels.cpp failed" in line
