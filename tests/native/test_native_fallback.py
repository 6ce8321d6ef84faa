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
