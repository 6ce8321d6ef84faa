"""Image prompts: fx-engine against mlx-vlm on the same weights, same run (issue 46, item 5).

    python tools/bench_vision.py                       # Gemma 3 4B's vision tower, 6 text layers
    python tools/bench_vision.py --geometry qwen2.5-vl-3b
    python tools/bench_vision.py --folder DIR          # a real multimodal folder (both engines load it)

Without --folder a synthetic folder is written (random weights: meaningless output, real
shapes; fx_engine/testing/vision.py's writers) at a real geometry, `--geometry` (the
published config.json's numbers; towers whole, `--text-layers` of the text model, default
as stated):
  gemma3-4b   google/gemma-3-4b-it's: SigLIP-so400m tower at 896 x 896 (4096 patches of 14,
              27 layers, width 1152), 256 image tokens, text width 2560, 8 / 4 heads of 256,
              ff 10240, vocab 262208; `--text-layers` of the text model's 34 (default 6: one
              sliding-window pattern, the fewest mlx-vlm's Gemma 3 runs; the tower is what an
              image prompt's first token waits on);
  gemma3-small the same tower at 448 x 448 (1024 patches), for a quicker check;
  smolvlm-256m HuggingFaceTB/SmolVLM-256M-Instruct's (Idefics3): SigLIP tower width 768, 12
              layers, 12 heads, ff 3072, patch 16, tiles of 512 (1024 patches, pixel shuffle by
              scale_factor 4: 64 tokens a tile), images resized to a longest edge of 2048 and
              split (640 x 480: 4 x 3 tiles + the global image, 832 image tokens); text =
              SmolLM2-135M's Llama: width 576, 9 / 3 heads of 64, ff 1536, vocab 49280, rope
              theta 1e5; all 30 text layers by default (the whole model);
  qwen2.5-vl-3b Qwen/Qwen2.5-VL-3B-Instruct's: window-attention tower depth 32, width 1280, ff
              3420 (SiLU gated), 16 heads, patch 14 (temporal 2), merge 2, windows of 112
              pixels, full attention in blocks 7 / 15 / 23 / 31, out 2048; processor min / max
              pixels 3136 / 12845056 (640 x 480 -> 644 x 476: 391 image tokens); text Qwen2
              with M-RoPE sections 16 / 24 / 24: width 2048, 16 / 2 heads of 128, ff 11008,
              vocab 151936, rope theta 1e6; 6 of its 36 text layers by default;
  qwen3-vl-2b Qwen/Qwen3-VL-2B-Instruct's: tower depth 24, width 1024, ff 4096, 16 heads,
              patch 16 (temporal 2), merge 2, 48 x 48 learned positions (2304), DeepStack from
              blocks 5 / 11 / 17, out 2048; processor shortest / longest edge (pixels) 65536 /
              16777216, mean = std = 0.5 (640 x 480: 300 image tokens); text Qwen3 with
              interleaved M-RoPE 24 / 20 / 20: width 2048, 16 / 8 heads of 128, ff 6144, vocab
              151936, rope theta 5e6; 6 of its 28 text layers by default (DeepStack feeds the
              first 3);
  mistral3-small mistralai/Mistral-Small-3.1-24B-Instruct-2503's: Pixtral tower width 1024,
              24 layers, 16 heads of 64, ff 4096, patch 14, longest edge 1540, 2-D RoPE theta
              1e4, patch merger 2 x 2 (640 x 480 -> 644 x 504: 23 x 18 = 414 image tokens, 18
              [IMG_BREAK] / [IMG_END]); text Mistral width 5120, 32 / 8 heads of 128, ff 32768,
              vocab 131072, rope theta 1e9; 2 of its 40 text layers by default (2.9 B
              parameters: 11.6 GB in float32 for each engine; --dtype bfloat16 halves it);
  tiny, tiny-idefics3, tiny-qwen2.5-vl, tiny-qwen3-vl, tiny-mistral3
              the tests' tiny models (smoke tests of this tool; `tiny` is Gemma 3's).
(The text models' lm_head is stored untied, as the writers do for mlx-vlm: the same
compute.) The prompt: a short question and one image of --image pixels (default 640 x 480;
a fresh random image per run, so neither engine's caches help).

Measured per engine, medians of --runs after one warm-up:
  ttft        seconds from the request to the first generated token: for fx-engine,
              `fx_engine.stream(model, messages)` (preprocessing, the tower, the projector,
              the prefill); for mlx-vlm, its model on the same pixels and prompt ids
              (`get_input_embeddings` with the family's arguments: pixel_values and
              image_grid_thw / image_sizes, then its language model on a fresh cache with
              the embeddings' extras (M-RoPE positions, DeepStack rows): what
              mlx_vlm.generate's first step runs; its preprocessing is not timed, in its
              favour). --mlx-vlm-prefill: "whole" (default; the measurement of this tool's
              first version) runs the whole prompt in one call, its logits for every prompt
              token; "generate" as mlx_vlm.generate does at its default prefill_step_size
              (2048): the prompt but its last token (logits not evaluated), then the last
              token (one row of logits);
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

# HuggingFaceTB/SmolVLM-256M-Instruct (model_type idefics3)
SMOLVLM_256M = {
    "vision": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
               "patch_size": 16, "image_size": 512, "layer_norm_eps": 1e-6},
    "text": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "vocab_size": 49280, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 8192},
    "top": {"scale_factor": 4},
    "preprocessor": {"size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512}}}
# Qwen/Qwen2.5-VL-3B-Instruct
QWEN2_5_VL_3B = {
    "vision": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 2048,
               "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
               "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "tokens_per_second": 2},
    "text": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
             "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
             "max_position_embeddings": 128000, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
    "preprocessor": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                     "merge_size": 2}}
# Qwen/Qwen3-VL-2B-Instruct
QWEN3_VL_2B = {
    "vision": {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "out_hidden_size": 2048,
               "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 2304,
               "deepstack_visual_indexes": [5, 11, 17], "hidden_act": "gelu_pytorch_tanh"},
    "text": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rope_theta": 5000000.0,
             "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
             "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
    "preprocessor": {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                     "temporal_patch_size": 2, "merge_size": 2}}
# mistralai/Mistral-Small-3.1-24B-Instruct-2503 (model_type mistral3)
MISTRAL3_SMALL = {
    "vision": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
               "head_dim": 64, "patch_size": 14, "image_size": 1540, "rope_theta": 10000.0, "hidden_act": "silu"},
    "text": {"hidden_size": 5120, "intermediate_size": 32768, "num_hidden_layers": 40, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072, "rope_theta": 1000000000.0,
             "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
    "top": {"spatial_merge_size": 2, "multimodal_projector_bias": False, "projector_hidden_act": "gelu",
            "vision_feature_layer": -1},
    "preprocessor": {"size": {"longest_edge": 1540}, "patch_size": {"height": 14, "width": 14}}}

#: name -> (family, the writer's geometry (vision / text / top / preprocessor overrides; for
#: gemma3 also mm_tokens_per_image), the default --text-layers (None: the writer's own))
GEOMETRIES: dict[str, tuple[str, dict[str, Any], int | None]] = {
    "gemma3-4b": ("gemma3", {"vision": TOWER_SO400M, "text": TEXT_4B, "mm_tokens_per_image": 256}, 6),
    "gemma3-small": ("gemma3", {"vision": {**TOWER_SO400M, "image_size": 448}, "text": TEXT_4B,
                                "mm_tokens_per_image": 256}, 6),
    "tiny": ("gemma3", {"vision": {}, "text": {}, "mm_tokens_per_image": 16}, 6),  # (a smoke test of this tool)
    "smolvlm-256m": ("idefics3", SMOLVLM_256M, 30),
    "qwen2.5-vl-3b": ("qwen2_5_vl", QWEN2_5_VL_3B, 6),
    "qwen3-vl-2b": ("qwen3_vl", QWEN3_VL_2B, 6),
    "mistral3-small": ("mistral3", MISTRAL3_SMALL, 2),
    # the tests' tiny models (smoke tests of this tool)
    "tiny-idefics3": ("idefics3", {}, None),
    "tiny-qwen2.5-vl": ("qwen2_5_vl", {}, None),
    "tiny-qwen3-vl": ("qwen3_vl", {}, None),
    "tiny-mistral3": ("mistral3", {}, None),
}


def write_folder(root: Path, geometry: str, text_layers: int | None, dtype: str) -> Path:
    from fx_engine.testing import vision as writers

    family, geo, _ = GEOMETRIES[geometry]
    folder = root / geometry
    text = dict(geo.get("text", {}))
    if text_layers is not None:
        text["num_hidden_layers"] = text_layers
    vision, top, pre = geo.get("vision"), geo.get("top", {}), geo.get("preprocessor")
    if family == "gemma3":
        return writers.write_tiny_gemma3_vlm(folder, dtype=dtype, text=text, vision=vision,
                                             mm_tokens_per_image=geo["mm_tokens_per_image"])
    if family == "idefics3":
        return writers.write_tiny_idefics3(folder, "idefics3", preprocessor=pre, text=text, vision=vision,
                                           dtype=dtype, **top)
    if family == "qwen2_5_vl":
        return writers.write_tiny_qwen2_vl(folder, "qwen2_5_vl", preprocessor=pre, text=text, vision=vision,
                                           dtype=dtype)
    if family == "qwen3_vl":
        return writers.write_tiny_qwen3_vl(folder, preprocessor=pre, vision=vision, text=text, dtype=dtype)
    if family == "mistral3":
        return writers.write_tiny_mistral3(folder, preprocessor=pre, dtype=dtype, text=text, vision=vision or {},
                                           **top)
    raise ValueError(f"unknown family {family!r}")


def _image(seed: int, size: tuple[int, int] = (640, 480)) -> Any:
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _messages(image: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image", "image": image}]}]


def time_fx(model: Any, seed: int, tokens: int, size: tuple[int, int] = (640, 480)) -> tuple[float, float]:
    t0 = time.perf_counter()
    times = []
    for delta in fx_engine.stream(model, _messages(_image(seed, size)), max_tokens=tokens, temperature=0):
        times += [time.perf_counter()] * len(delta.token_ids)
    ttft = times[0] - t0
    return ttft, (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")


def mlx_vlm_inputs(model: Any, msgs: list[dict[str, Any]]) -> tuple[list[int], mx.array, dict[str, Any]]:
    """(prompt ids, pixel_values, the family's other get_input_embeddings arguments) for
    mlx-vlm's model: our prompt ids and pixels (the same ones fx-engine builds; tests/models
    check them against mlx-vlm's / transformers' processors)."""
    from fx_engine.engine.image_prompt import image_prompt, split_messages

    ids = list(image_prompt(model, msgs).ids)  # (not timed: the prompt ids only)
    _, images = split_messages(msgs)
    kind = model.vision.config.model_type
    if kind == "gemma3":
        from fx_engine.loading.images import preprocess

        return ids, mx.array(preprocess(images, model.image_processor)), {}
    if kind in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl"):
        from fx_engine.loading.images_qwen2_vl import preprocess as qwen_preprocess

        patches, grid = qwen_preprocess(images, model.image_processor)
        return ids, mx.array(patches), {"image_grid_thw": mx.array(grid)}
    if kind == "mistral3":
        from fx_engine.loading.images_pixtral import preprocess_one

        pix = [preprocess_one(im, model.image_processor) for im in images]
        if len({p.shape for p in pix}) != 1:
            raise ValueError("images of different sizes: mlx-vlm takes them padded (not done here)")
        return ids, mx.array(np.stack(pix)), {"image_sizes": [tuple(p.shape[1:]) for p in pix]}
    from fx_engine.loading.images import idefics3_tiles  # idefics3 / smolvlm: [1, tiles, 3, M, M]

    return ids, mx.array(np.concatenate([idefics3_tiles(im, model.image_processor)[0] for im in images]))[None], {}


def time_mlx_vlm(ref: Any, model: Any, seed: int, tokens: int, size: tuple[int, int] = (640, 480),
                 prefill: str = "whole") -> tuple[float, float]:
    """mlx-vlm's model on our prompt ids and pixels (the module docstring)."""
    from mlx_vlm.models.cache import make_prompt_cache

    ids, pixels, extra = mlx_vlm_inputs(model, _messages(_image(seed, size)))
    mx.eval(pixels)
    lm = ref.language_model
    t0 = time.perf_counter()
    x = mx.array([ids])
    out = ref.get_input_embeddings(x, pixels, mask=mx.ones(x.shape), **extra)
    emb = out.inputs_embeds
    kw = {k: v for k, v in out.to_dict().items() if k != "inputs_embeds" and v is not None}
    cache = make_prompt_cache(lm)
    if prefill == "generate" and x.shape[1] > 1:  # (mlx_vlm.generate's chunk loop, one chunk under 2048)
        n = x.shape[1] - 1
        lm(inputs=x[:, :n], inputs_embeds=emb[:, :n], cache=cache, n_to_process=n, logits_to_keep=1, **kw)
        mx.eval([c.state for c in cache])
        x, emb = x[:, n:], emb[:, n:]
    logits = lm(x, inputs_embeds=emb, cache=cache, **kw).logits[:, -1]
    tok = mx.argmax(logits, axis=-1)
    mx.eval(tok)
    t1 = time.perf_counter()
    for _ in range(tokens - 1):
        tok = mx.argmax(lm(tok[:, None], cache=cache).logits[:, -1], axis=-1)
        mx.eval(tok)
    return t1 - t0, (tokens - 1) / (time.perf_counter() - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", help="a multimodal model folder (default: a synthetic one, --geometry)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="gemma3-4b")
    ap.add_argument("--text-layers", type=int, help="text layers of the synthetic folder (default: the geometry's)")
    ap.add_argument("--dtype", default="float32", help="the synthetic folder's dtype")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--engines", default="fx,mlx-vlm")
    ap.add_argument("--image", default="640x480", help="the image's WIDTHxHEIGHT in pixels")
    ap.add_argument("--mlx-vlm-prefill", choices=("whole", "generate"), default="whole",
                    help="mlx-vlm's prompt step (the module docstring)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    size = tuple(int(v) for v in a.image.lower().split("x"))
    if len(size) != 2:
        ap.error(f"--image: WIDTHxHEIGHT, got {a.image!r}")
    tmp = None
    if a.folder:
        folder = Path(a.folder)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench-vision-")
        t = time.perf_counter()
        if a.text_layers is None:
            a.text_layers = GEOMETRIES[a.geometry][2]
        folder = write_folder(Path(tmp.name), a.geometry, a.text_layers, a.dtype)
        if a.text_layers is None:  # (the writer's own)
            cfg = json.loads((folder / "config.json").read_text())
            a.text_layers = cfg.get("text_config", cfg)["num_hidden_layers"]
        print(f"wrote {a.geometry} ({a.text_layers} text layers, {a.dtype}) in {time.perf_counter() - t:.0f} s")
    engines = a.engines.split(",")
    model = fx_engine.load(str(folder))
    ref = None
    if "mlx-vlm" in engines:
        from mlx_vlm.utils import load_model

        ref = load_model(folder)
    from fx_engine.engine.image_prompt import image_prompt

    ip = image_prompt(model, _messages(_image(999, size)))
    print(f"prompt: {len(ip.ids)} tokens, {sum(ip.image_tokens)} of them image tokens ({size[0]} x {size[1]} image)")
    results: dict[str, dict[str, list[float]]] = {e: {"ttft": [], "decode": []} for e in engines}
    for r in range(a.runs + 1):  # run 0: warm-up (compiles), not counted
        for e in engines:
            ttft, rate = (time_fx(model, 1000 + r, a.tokens, size) if e == "fx"
                          else time_mlx_vlm(ref, model, 1000 + r, a.tokens, size, a.mlx_vlm_prefill))
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
                                            "dtype": a.dtype, "image": list(size), "prompt_tokens": len(ip.ids),
                                            "image_tokens": sum(ip.image_tokens),
                                            "mlx_vlm_prefill": a.mlx_vlm_prefill, "runs": results,
                                            "medians": med}, indent=1))


if __name__ == "__main__":
    main()
