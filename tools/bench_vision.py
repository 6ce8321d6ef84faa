"""Image prompts: fx-engine against mlx-vlm on the same weights, same run (issue 46, item 5).

    python tools/bench_vision.py                       # Gemma 3 4B's vision tower, 6 text layers
    python tools/bench_vision.py --folder DIR          # a real multimodal folder (both engines load it)

Without --folder a synthetic Gemma 3 folder is written (random weights: meaningless output,
real shapes; fx_engine/testing/vision.py's writer) at a real geometry, `--geometry`:
  gemma3-4b   google/gemma-3-4b-it's: SigLIP-so400m tower at 896 x 896 (4096 patches of 14,
              27 layers, width 1152), 256 image tokens, text width 2560, 8 / 4 heads of 256,
              ff 10240, vocab 262208; `--text-layers` of the text model's 34 (default 6: one
              sliding-window pattern, the fewest mlx-vlm's Gemma 3 runs; the tower is what an
              image prompt's first token waits on);
  gemma3-small the same tower at 448 x 448 (1024 patches), for a quicker check;
  tiny        the tests' tiny model (a smoke test of this tool).
The prompt: a short question and one image (a fresh random image per run, so neither
engine's caches help).

Measured per engine, medians of --runs after one warm-up:
  ttft        seconds from the request to the first generated token: for fx-engine,
              `fx_engine.stream(model, messages)` (preprocessing, the tower, the projector,
              the prefill); for mlx-vlm, its model on the same pixels and prompt ids
              (`get_input_embeddings`, then its language model on a fresh cache: what
              mlx_vlm.generate's first step runs; its preprocessing is not timed, in its
              favour);
  decode      generated tokens per second after the first (--tokens, greedy).
The CPU and the versions are printed with the table; --json writes the numbers.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fx_engine  # noqa: E402

fx_engine.setup()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

TOWER_SO400M = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
                "patch_size": 14, "image_size": 896, "layer_norm_eps": 1e-6}
TEXT_4B = {"hidden_size": 2560, "intermediate_size": 10240, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 256, "vocab_size": 262208, "sliding_window": 1024, "sliding_window_pattern": 6,
           "query_pre_attn_scalar": 256, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
           "max_position_embeddings": 131072}
GEOMETRIES = {"gemma3-4b": (TOWER_SO400M, TEXT_4B), "gemma3-small": ({**TOWER_SO400M, "image_size": 448}, TEXT_4B),
              "tiny": ({}, {})}  # (the test writer's tiny model: a smoke test of this tool)


def write_folder(root: Path, geometry: str, text_layers: int, dtype: str) -> Path:
    from fx_engine.testing.vision import write_tiny_gemma3_vlm

    vision, text = GEOMETRIES[geometry]
    return write_tiny_gemma3_vlm(root / geometry, dtype=dtype, text={**text, "num_hidden_layers": text_layers},
                                 vision=vision, mm_tokens_per_image=16 if geometry == "tiny" else 256)


def _image(seed: int, size: tuple[int, int] = (640, 480)) -> Any:
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _messages(image: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image", "image": image}]}]


def time_fx(model: Any, seed: int, tokens: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    times = []
    for delta in fx_engine.stream(model, _messages(_image(seed)), max_tokens=tokens, temperature=0):
        times += [time.perf_counter()] * len(delta.token_ids)
    ttft = times[0] - t0
    return ttft, (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")


def time_mlx_vlm(ref: Any, model: Any, seed: int, tokens: int) -> tuple[float, float]:
    """mlx-vlm's model on our prompt ids and pixels (the same ones fx-engine builds)."""
    from fx_engine.engine.image_prompt import image_prompt, split_messages
    from fx_engine.loading.images import preprocess

    msgs = _messages(_image(seed))
    ids = list(image_prompt(model, msgs).ids)  # (not timed: the prompt ids only)
    _, images = split_messages(msgs)
    pixels = mx.array(preprocess(images, model.image_processor))
    mx.eval(pixels)
    t0 = time.perf_counter()
    x = mx.array([ids])
    emb = ref.get_input_embeddings(x, pixels, mask=mx.ones(x.shape)).inputs_embeds
    cache = ref.language_model.make_cache()
    logits = ref.language_model(x, inputs_embeds=emb, cache=cache).logits[:, -1]
    tok = mx.argmax(logits, axis=-1)
    mx.eval(tok)
    t1 = time.perf_counter()
    for _ in range(tokens - 1):
        tok = mx.argmax(ref.language_model(tok[:, None], cache=cache).logits[:, -1], axis=-1)
        mx.eval(tok)
    return t1 - t0, (tokens - 1) / (time.perf_counter() - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", help="a multimodal model folder (default: a synthetic one, --geometry)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="gemma3-4b")
    ap.add_argument("--text-layers", type=int, default=6)
    ap.add_argument("--dtype", default="float32", help="the synthetic folder's dtype")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--engines", default="fx,mlx-vlm")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    tmp = None
    if a.folder:
        folder = Path(a.folder)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench-vision-")
        t = time.perf_counter()
        folder = write_folder(Path(tmp.name), a.geometry, a.text_layers, a.dtype)
        print(f"wrote {a.geometry} ({a.text_layers} text layers, {a.dtype}) in {time.perf_counter() - t:.0f} s")
    engines = a.engines.split(",")
    model = fx_engine.load(str(folder))
    ref = None
    if "mlx-vlm" in engines:
        from mlx_vlm.utils import load_model

        ref = load_model(folder)
    results: dict[str, dict[str, list[float]]] = {e: {"ttft": [], "decode": []} for e in engines}
    for r in range(a.runs + 1):  # run 0: warm-up (compiles), not counted
        for e in engines:
            ttft, rate = (time_fx(model, 1000 + r, a.tokens) if e == "fx"
                          else time_mlx_vlm(ref, model, 1000 + r, a.tokens))
            if r:
                results[e]["ttft"].append(ttft)
                results[e]["decode"].append(rate)
            print(f"  run {r} {e}: ttft {ttft:.3f} s, decode {rate:.2f} tok/s", flush=True)
    import mlx_vlm

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"\n{cpu}; mlx {mx.__version__}, mlx-vlm {mlx_vlm.__version__}; "
          f"{a.folder or a.geometry + f' ({a.text_layers} text layers, {a.dtype})'}; medians of {a.runs}")
    print("| engine | time to first token (s) | decode (tok/s) |\n|---|---:|---:|")
    med = {e: {k: statistics.median(v) for k, v in m.items()} for e, m in results.items()}
    for e in engines:
        print(f"| {e} | {med[e]['ttft']:.3f} | {med[e]['decode']:.2f} |")
    if "fx" in med and "mlx-vlm" in med:
        print(f"| fx speed vs mlx-vlm | {med['mlx-vlm']['ttft'] / med['fx']['ttft']:.2f}x | "
              f"{med['fx']['decode'] / med['mlx-vlm']['decode']:.2f}x |")
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu, "mlx": mx.__version__, "mlx_vlm": mlx_vlm.__version__,
                                            "model": a.folder or a.geometry, "text_layers": a.text_layers,
                                            "dtype": a.dtype, "runs": results, "medians": med}, indent=1))


if __name__ == "__main__":
    main()
