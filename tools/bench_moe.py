"""Decode speed of a wide mixture-of-experts model against a dense model with the same
active parameters, and against mlx-lm on the same weights (issue 23's benchmark).

    python tools/bench_moe.py [--runs 3] [--json docs/bench/x.json]

Models (random weights, written with fx_engine.testing.write_tiny_model): `qwen3_moe` with
64 experts, top-2, expert width F; a dense `qwen3` whose MLP width is 2F (the same active
parameters per token: attention, norms and head identical); and the same MoE with top-8
(4x the active expert parameters). Each is measured as fx-engine runs it by default on this
machine and as mlx-lm's generate_step runs the same folder (float32), greedy decode of
--tokens tokens after a 32-token prompt; tok/s medians over --runs.
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

fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported
import mlx.core as mx  # noqa: E402


def _models(root: Path, hidden: int, layers: int, width: int) -> dict[str, Path]:
    from fx_engine.testing import write_tiny_model

    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=hidden // 8, vocab_size=2048, tie_word_embeddings=True)
    return {
        "moe 64x top-2": write_tiny_model(root / "moe2", "qwen3_moe", num_experts=64, num_experts_per_tok=2,
                                          moe_intermediate_size=width, intermediate_size=2 * width, **common),
        "dense, same active": write_tiny_model(root / "dense", "qwen3", intermediate_size=2 * width, **common),
        "moe 64x top-8": write_tiny_model(root / "moe8", "qwen3_moe", num_experts=64, num_experts_per_tok=8,
                                          moe_intermediate_size=width, intermediate_size=2 * width, **common),
    }


def _time_fx(model, prompt: list[int], tokens: int) -> float:  # noqa: ANN001
    """Greedy decode tok/s after the first token (EOS suppressed: random weights)."""
    def run() -> float:
        t0, n = None, 0
        for _ in fx_engine.stream(model, prompt, max_tokens=tokens, temperature=0.0, logit_bias={2: -100}):
            if t0 is None:
                t0 = time.perf_counter()
            n += 1
        return (n - 1) / (time.perf_counter() - t0)

    run()  # compile
    return run()


def _mlx_lm(path: Path, prompt: list[int], tokens: int) -> float:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    ref, _ = load_model(path)
    ref.set_dtype(mx.float32)

    def run() -> float:
        t0, n = None, 0
        for _tok, _ in generate_step(mx.array(prompt), ref, max_tokens=tokens,
                                     sampler=lambda x: mx.argmax(x, axis=-1)):
            if t0 is None:
                t0 = time.perf_counter()  # after the first token: decode only
            n += 1
        return (n - 1) / (time.perf_counter() - t0)

    run()
    return run()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256, help="each expert's MLP width")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    prompt = list(range(5, 37))
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = _models(Path(tmp), a.hidden, a.layers, a.width)
        for _ in range(a.runs):  # rounds interleave the models: load drift falls on all
            for name, path in paths.items():
                r = results.setdefault(name, {"fx": [], "mlx-lm": []})
                r["fx"].append(_time_fx(fx_engine.load(path), prompt, a.tokens))
                r["mlx-lm"].append(_mlx_lm(path, prompt, a.tokens))
    print(f"decode tok/s, median of {a.runs} ({platform.machine()}, hidden {a.hidden}, {a.layers} layers, "
          f"expert width {a.width})")
    out = {"config": vars(a), "results": {}}
    dense = statistics.median(results["dense, same active"]["fx"])
    for name, r in results.items():
        fx, ml = statistics.median(r["fx"]), statistics.median(r["mlx-lm"])
        out["results"][name] = {"fx": r["fx"], "mlx-lm": r["mlx-lm"], "fx_median": fx, "mlx_lm_median": ml}
        print(f"  {name:20s} fx {fx:7.1f}  mlx-lm {ml:7.1f}  fx/mlx-lm {fx / ml:5.2f}  fx vs dense {fx / dense:5.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
