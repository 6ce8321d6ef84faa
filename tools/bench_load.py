"""Load time and memory of a K-quant GGUF: writes a synthetic Q4_K_M-like llama file (random
valid blocks: Q4_K weights, Q6_K embedding, attn_v and every other ffn_down, F32 norms, with
the gguf package) and loads it in a fresh process per mode, reporting the load's wall time,
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

# offsets of the float16 fields in each block type (d, and dmin for Q4_K), and the exponent
# range their random values get (weights of a sane size)
F16 = {"Q4_K": ((0, 2), (-13, -10)), "Q6_K": ((208,), (-17, -14))}


def write_file(path: Path, hidden: int, layers: int, ff: int, vocab: int, heads: int, kv_heads: int) -> None:
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)

    def blocks(kind: str, rows: int, cols: int) -> np.ndarray:
        qtype = gguf.GGMLQuantizationType[kind]
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
        offsets, (lo, hi) = F16[kind]
        for off in offsets:
            vals = rng.uniform(1, 2, len(raw)) * 2.0 ** rng.integers(lo, hi, len(raw))
            raw[:, off : off + 2] = vals.astype(np.float16).view(np.uint8).reshape(-1, 2)
        return raw.reshape(rows, -1)

    hd = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    for key, val in (("block_count", layers), ("context_length", 4096), ("embedding_length", hidden),
                     ("feed_forward_length", ff), ("attention.head_count", heads),
                     ("attention.head_count_kv", kv_heads)):
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    # the default model's vocabulary (SmolLM2's byte-level BPE), as its GGUF stores it
    from fx_engine.loading.default_model import default_model_path
    from fx_engine.loading.gguf import _Header

    for k, v in _Header(default_model_path()).metadata.items():
        if not k.startswith("tokenizer."):
            continue
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, (list, np.ndarray)):
            w.add_array(k, list(v.tolist() if isinstance(v, np.ndarray) else v))
        elif isinstance(v, (bool, np.bool_)):
            w.add_bool(k, bool(v))
        else:
            w.add_uint32(k, int(v))

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        w.add_tensor(name, blocks(kind, rows, cols), raw_dtype=gguf.GGMLQuantizationType[kind])

    add("token_embd.weight", "Q6_K", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        add(p + "attn_q.weight", "Q4_K", heads * hd, hidden)
        add(p + "attn_k.weight", "Q4_K", kv_heads * hd, hidden)
        add(p + "attn_v.weight", "Q6_K", kv_heads * hd, hidden)
        add(p + "attn_output.weight", "Q4_K", hidden, heads * hd)
        add(p + "ffn_gate.weight", "Q4_K", ff, hidden)
        add(p + "ffn_up.weight", "Q4_K", ff, hidden)
        add(p + "ffn_down.weight", "Q6_K" if i % 2 == 0 else "Q4_K", hidden, ff)
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
