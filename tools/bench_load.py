"""Load time and memory of a K-quant GGUF: writes a synthetic Q4_K_M-like llama file (random
valid blocks: Q4_K weights, Q6_K embedding, attn_v and every other ffn_down, F32 norms, with
tools/synth_gguf.py's writer) and loads it in a fresh process per mode, reporting the load's wall time,
the params' bytes and the process's peak RSS.

    python tools/bench_load.py                       # hidden 2048, 16 layers: ~517 MiB
    python tools/bench_load.py --json docs/bench/x.json --runs 3

Modes: the CPU default (what the native kernels run is kept packed: 4-bit, 8-bit, 8-bit in
groups of 16; the rest in float32) and keep_quantized=True (every tensor as stored, the GPU
form). The file is written once into --dir (reused if present).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "tools"))
import synth_gguf  # noqa: E402  (the synthetic GGUF writer: tools/synth_gguf.py)


def write_file(path: Path, hidden: int, layers: int, ff: int, vocab: int, heads: int, kv_heads: int) -> None:
    """tools/synth_gguf.py's writer with this tool's historical Q4_K_M-like mix ("Q4_K_M-alt":
    Q6_K attn_v on every layer and ffn_down on the even ones, Q4_K elsewhere)."""
    shape = synth_gguf.Shape(f"load-{hidden}x{layers}", hidden, layers, ff, heads, kv_heads, vocab,
                             tied=True, rope_theta=10000.0, context=4096)
    synth_gguf.write_file(path, shape, "Q4_K_M-alt")


_CHILD = r"""
import json, resource, sys, time
import fx_engine
fx_engine.setup()
import mlx.core as mx
from fx_engine.core.tree import tree_leaves
keep = {"default": None, "keep_quantized": True}[sys.argv[2]]
t0 = time.perf_counter()
m = fx_engine.load(sys.argv[1], keep_quantized=keep)
mx.eval(tree_leaves(m.params))
t = time.perf_counter() - t0
params = sum(x.nbytes for x in tree_leaves(m.params))
print(json.dumps({"seconds": t, "params_mib": params / 2**20,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "weight_format": m.weight_format}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/fx-bench-load")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ff", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=49152, help="rows of the embedding (the tokenizer is SmolLM2's)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    folder = Path(a.dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"synthetic-q4km-{a.hidden}x{a.layers}.gguf"
    if not path.exists():
        write_file(path, a.hidden, a.layers, a.ff, a.vocab, heads=a.hidden // 64, kv_heads=a.hidden // 256)
    size = path.stat().st_size / 2**20
    print(f"{path} ({size:.0f} MiB), {platform.processor() or platform.machine()}")
    out = {"file": str(path), "file_mib": size, "modes": {}}
    for mode in ("default", "keep_quantized"):
        runs = []
        for _ in range(a.runs):
            r = subprocess.run([sys.executable, "-c", _CHILD, str(path), mode], capture_output=True,
                               text=True, cwd=ROOT)
            if r.returncode:
                print(r.stderr[-2000:], file=sys.stderr)
                return 1
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        med = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "params_mib", "peak_rss_mib")}
        out["modes"][mode] = {"runs": runs, "median": med, "weight_format": runs[0]["weight_format"]}
        print(f"{mode:15s} load {med['seconds']:.1f} s  params {med['params_mib']:.0f} MiB "
              f"({med['params_mib'] / size:.2f}x the file)  peak RSS {med['peak_rss_mib']:.0f} MiB  "
              f"[{runs[0]['weight_format']}]")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
