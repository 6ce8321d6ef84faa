"""Decode speed of recurrent / hybrid models at short and long context, against mlx-lm on the
same weights (issue 25's benchmark): the recurrent layers' cost must not grow with context.

    python tools/bench_recurrent.py [--runs 1] [--json docs/bench/recurrent.json]

Models (random weights, tiny-shaped: hidden 256, written with fx_engine.testing.write_tiny_model):
`mamba2` (every layer a Mamba-2 mixer: no attention at all), `qwen3_next` (three Gated
DeltaNet layers per full-attention layer, routed experts) and `lfm2` (short convolutions,
one attention layer in four). Each: greedy decode of --tokens tokens after a prompt of 64
and of 4,096 tokens; fx-engine as it runs by default here, mlx-lm's generate_step on the
same folder (float32). tok/s after the first token.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fx_engine  # noqa: E402

fx_engine.setup()
import mlx.core as mx  # noqa: E402

from tools.bench import machine_info  # noqa: E402
from tools.bench_moe import _mlx_lm, _time_fx  # noqa: E402


def _models(root: Path, hidden: int, layers: int) -> dict[str, Path]:
    from fx_engine.testing import write_tiny_model

    common = dict(hidden_size=hidden, num_hidden_layers=layers, vocab_size=2048, max_position_embeddings=8192)
    return {
        "mamba2": write_tiny_model(root / "mamba2", "mamba2", num_heads=hidden // 32, head_dim=64, state_size=64,
                                   n_groups=1, **common),
        "qwen3_next": write_tiny_model(root / "qwen3_next", "qwen3_next", num_attention_heads=8, num_key_value_heads=2,
                                       head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
                                       linear_key_head_dim=64, linear_value_head_dim=32, num_experts=8,
                                       moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden,
                                       intermediate_size=2 * hidden, **common),
        "lfm2": write_tiny_model(root / "lfm2", "lfm2", num_attention_heads=8, num_key_value_heads=2,
                                 block_dim=hidden, block_ff_dim=3 * hidden,
                                 layer_types=["conv", "conv", "conv", "full_attention"] * (layers // 4), **common),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--contexts", default="64,4096")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    out: dict = {"machine": machine_info(), "config": vars(a), "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in _models(Path(tmp), a.hidden, a.layers).items():
            model = fx_engine.load(path)
            for ctx in contexts:
                prompt = [5 + (i * 7919) % 2000 for i in range(ctx)]
                fx = [_time_fx(model, prompt, a.tokens) for _ in range(a.runs)]
                ml = [_mlx_lm(path, prompt, a.tokens) for _ in range(a.runs)]
                r = {"fx": statistics.median(fx), "mlx-lm": statistics.median(ml), "fx_runs": fx, "mlx_lm_runs": ml}
                out["results"][f"{name}@{ctx}"] = r
                print(f"{name:10s} context {ctx:5d}: fx {r['fx']:7.1f} tok/s  mlx-lm {r['mlx-lm']:7.1f} tok/s  "
                      f"fx/mlx-lm {r['fx'] / r['mlx-lm']:4.2f}", flush=True)
            lo, hi = out["results"][f"{name}@{contexts[0]}"], out["results"][f"{name}@{contexts[-1]}"]
            print(f"{name:10s} decode at {contexts[-1]} / at {contexts[0]}: fx {hi['fx'] / lo['fx']:.2f}, "
                  f"mlx-lm {hi['mlx-lm'] / lo['mlx-lm']:.2f}")
    print(platform.machine(), out["machine"]["cpu"], out["machine"]["cpu_flags"])
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
