#!/usr/bin/env python
"""qgemm (the native float32 quantized product) per stored weight width, 4 / 5 / 6 / 8 bits,
on random weights of a few shapes and row counts: min over --runs rounds, µs per product.

With --arch FLAGS the kernels are first built for that target from this tree (e.g.
`--arch=-march=x86-64-v3`: plain AVX2 + FMA, as on an AVX2-only CPU) into a temporary
folder and measured in a child process; without it, this machine's own build. Compare two
trees (before / after a kernel change) by running each tree's copy of this tool in turn.

  python tools/bench_qgemm_widths.py --arch=-march=x86-64-v3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def stream(q, bits: int):  # noqa: ANN001
    """Rows of `bits`-bit integers as one little-endian bit stream each, in uint32 words."""
    import numpy as np

    n, k = q.shape
    one = ((q[..., None] >> np.arange(bits, dtype=np.uint64)) & np.uint64(1)).reshape(n, k * bits // 32, 32)
    return (one << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


def measure(mod, shapes: list[tuple[int, int]], rows: list[int], widths: list[int], runs: int) -> dict:  # noqa: ANN001
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    out = {}
    for n, k in shapes:
        gs = 32
        for bits in widths:
            wq = mx.array(stream(rng.integers(0, 1 << bits, (n, k)).astype(np.uint64), bits))
            s = mx.array(rng.standard_normal((n, k // gs)).astype(np.float32) * 0.01)
            b = mx.array(rng.standard_normal((n, k // gs)).astype(np.float32) * 0.01)
            for m in rows:
                x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
                mx.eval(mod.qgemm(x, wq, s, b, gs, bits))
                reps = max(1, int(2e7 // (n * k * max(m, 4))))
                best = float("inf")
                for _ in range(runs):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        mx.eval(mod.qgemm(x, wq, s, b, gs, bits))
                    best = min(best, (time.perf_counter() - t0) / reps * 1e6)
                out[f"{n}x{k} {bits}-bit M={m}"] = round(best, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default=None, help="compiler flags to build the kernels for (e.g. -march=x86-64-v3)")
    ap.add_argument("--shapes", default="1536x576,5632x2048", help="N x K of the weights")
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--widths", default="4,5,6,8")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--so", default=None, help=argparse.SUPPRESS)  # (the child: a built module)
    a = ap.parse_args()
    if a.arch and not a.so:
        from fx_engine.runtime.native import build

        cxx = build._compiler()
        if cxx is None:
            sys.exit("no C++ compiler")
        so = Path(tempfile.mkdtemp()) / ("_fx_native" + build._paths()["ext_suffix"])
        build._compile(cxx, build._paths(), a.arch.split(), so)
        args = [f"--arch={a.arch}", f"--shapes={a.shapes}", f"--rows={a.rows}", f"--widths={a.widths}",
                f"--runs={a.runs}", f"--so={so}"]
        r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                           env={**__import__("os").environ, "FX_ENGINE_NATIVE": "0"})
        if r.returncode:
            sys.exit(r.stderr[-3000:])
        result = json.loads(r.stdout)
    else:
        if a.so:
            import importlib.util

            spec = importlib.util.spec_from_file_location("_fx_native", a.so)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        else:
            import fx_engine

            fx_engine.setup()
            from fx_engine.runtime import native

            if native.ensure() is None:
                sys.exit(f"native kernels unavailable: {native.status()['error']}")
            mod = native
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
        result = {"arch": a.arch or "this machine's build",
                  "us": measure(mod, shapes, [int(v) for v in a.rows.split(",")],
                                [int(v) for v in a.widths.split(",")], a.runs)}
        if a.so:
            print(json.dumps(result))
            return
    text = json.dumps(result, indent=1)
    if a.json:
        Path(a.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
