"""Write tiny random-weight multimodal checkpoints as Hugging Face style folders: Gemma 3
(`write_tiny_gemma3_vlm`, model_type `gemma3`: a text model under text_config, a SigLIP tower
under vision_config) and Idefics3 / SmolVLM (`write_tiny_idefics3`: a Llama text model, the
tower, the pixel-shuffle connector, tiles of 32 pixels) and Qwen2.5-VL / Qwen2-VL
(`write_tiny_qwen2_vl`: a Qwen2 text model with M-RoPE, the window-attention tower) and
Mistral 3 (`write_tiny_mistral3`: a Mistral text model, the Pixtral tower and projector) and
Gemma 4 (`write_tiny_gemma4`: a Gemma 4 text model, its own tower and embedder).

The folder: config.json (text_config: a tiny `gemma3_text`, vision_config: a tiny SigLIP,
the projector's mm_tokens_per_image and the image token ids inside the tiny vocabulary),
model.safetensors under Hugging Face's multimodal names (language_model.model.*,
vision_tower.vision_model.*, multi_modal_projector.*), preprocessor_config.json (a
Gemma3ImageProcessor's, at the tower's image size), and the tiny tokenizer files of
`write_tiny_model`. Loadable by fx-engine's text loader (the text model), by
`fx_engine.loading.vision` (the image path) and by mlx-vlm (the oracle).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from fx_engine.testing.tiny import CHATML, _tokenizer_json, _weights, tiny_config

#: the tiny tower: 8 x 8 patches of 4 x 4 pixels, pooled 2 x 2 into 16 image tokens
TINY_VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "patch_size": 4, "image_size": 32,
               "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False}
#: image token ids inside the tiny text model's 384-token vocabulary
TINY_IDS = {"boi_token_index": 380, "eoi_token_index": 381, "image_token_index": 382}


def tiny_gemma3_config(*, text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None,
                       mm_tokens_per_image: int = 16, **top: Any) -> dict[str, Any]:
    """config.json of a tiny Gemma 3 multimodal model (each part's overrides applied)."""
    text_cfg = tiny_config("gemma3_text", **(text or {}))
    text_cfg.pop("architectures", None)
    text_cfg["mm_tokens_per_image"] = mm_tokens_per_image  # (mlx-vlm reads it here)
    return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
            "text_config": text_cfg, "vision_config": {**TINY_VISION, **(vision or {})},
            "mm_tokens_per_image": mm_tokens_per_image, **TINY_IDS,
            # mlx-vlm divides image embeddings by sqrt(config.hidden_size) (default 2048)
            "hidden_size": text_cfg["hidden_size"],
            "eos_token_id": text_cfg["eos_token_id"], "bos_token_id": text_cfg["bos_token_id"], **top}


def preprocessor_config(image_size: int, **overrides: Any) -> dict[str, Any]:
    """A Gemma3ImageProcessor's preprocessor_config.json, as google/gemma-3-*-it ship it,
    at `image_size`."""
    return {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
            "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "image_seq_length": 256, "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
            "pan_and_scan_min_ratio_to_activate": None, "resample": 2, "rescale_factor": 0.00392156862745098,
            "size": {"height": image_size, "width": image_size}, **overrides}


def _vision_weights(cfg: dict[str, Any], dtype: mx.Dtype, seed: int) -> dict[str, mx.array]:
    from fx_engine.core.vision import gemma3

    layout = gemma3.checkpoint_layout(gemma3.config_from_hf(cfg, "tiny"))
    keys = iter(mx.random.split(mx.random.key(seed + 7919), len(layout)))
    return {name: (spec.center + spec.scale * mx.random.normal(spec.shape, key=next(keys))).astype(dtype)
            for name, spec in layout.items()}


def write_tiny_gemma3_vlm(
    folder: str | Path, *, dtype: str = "float32", seed: int = 0, layout: str = "hf",
    quantize_vision: dict[str, int] | None = None, preprocessor: dict[str, Any] | None = None, **config: Any,
) -> Path:
    """Write a random-weight Gemma 3 multimodal folder; returns its path.

    layout: "hf" (Hugging Face's tensors) or "mlx" (as mlx-vlm's conversion stores them:
    the patch conv's weight channels last). quantize_vision={"group_size": 32, "bits": 4}:
    the tower's linears MLX affine-quantized with a `quantization` entry, as an
    mlx-community folder that quantized its vision tower (the text model stays dense).
    config: `tiny_gemma3_config`'s arguments (text=..., vision=..., mm_tokens_per_image=...,
    top-level fields); preprocessor: preprocessor_config.json overrides.
    """
    if layout not in ("hf", "mlx"):
        raise ValueError(f"layout must be 'hf' or 'mlx', got {layout!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_gemma3_config(**config)
    dt = getattr(mx, dtype)
    text = _weights(cfg["text_config"], dt, seed)
    weights = {("language_model." + n): w for n, w in text.items()}  # model.* and lm_head.*
    vision = _vision_weights(cfg, dt, seed)
    if layout == "mlx":
        name = "vision_tower.vision_model.embeddings.patch_embedding.weight"
        vision[name] = mx.contiguous(vision[name].transpose(0, 2, 3, 1))
    if quantize_vision:
        gs, bits = quantize_vision["group_size"], quantize_vision["bits"]
        for name in [n for n in vision if n.endswith(".weight") and ("self_attn." in n or "mlp." in n)]:
            q, s, b = mx.quantize(vision[name], group_size=gs, bits=bits)
            base = name[: -len(".weight")]
            vision[name], vision[base + ".scales"], vision[base + ".biases"] = q, s, b
        cfg["quantization"] = {"group_size": gs, "bits": bits}
    weights.update(vision)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    size = cfg["vision_config"].get("image_size", 224)
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(size, **(preprocessor or {})),
                                                                indent=1))
    (folder / "tokenizer.json").write_text(_tokenizer_json(cfg["text_config"]["vocab_size"]))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=1))
    return folder


# ---------------------------------------------------------------- Idefics3 / SmolVLM

IDEFICS3_ROWS = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
IDEFICS3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
                     "<global-img>", *IDEFICS3_ROWS]
IDEFICS3_IMAGE_ID = IDEFICS3_SPECIALS.index("<image>")
IDEFICS3_VISION = {"model_type": "idefics3_vision", "hidden_size": 32, "intermediate_size": 64,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "patch_size": 4, "image_size": 32,
                   "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}
#: tiles of 32 x 32 (8 x 8 patches, shuffled by 2: 16 tokens a tile), images resized to 64
IDEFICS3_PREPROCESSOR = {"image_processor_type": "Idefics3ImageProcessor", "do_convert_rgb": True,
                         "do_image_splitting": True, "do_normalize": True, "do_pad": True, "do_rescale": True,
                         "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                         "max_image_size": {"longest_edge": 32}, "resample": 1, "rescale_factor": 1 / 255,
                         "size": {"longest_edge": 64}}


def write_tiny_idefics3(folder: str | Path, model_type: str = "idefics3", layout: str = "hf", seed: int = 0,
                        preprocessor: dict | None = None, *, text: dict | None = None,
                        vision: dict | None = None, dtype: str = "float32", **top: Any) -> Path:
    """A random-weight Idefics3 / SmolVLM folder under Hugging Face's names (layout "mlx":
    mlx-vlm's converted names, the patch conv channels last). text / vision: overrides of
    the tiny text_config / vision_config (a real geometry: tools/bench_vision.py); top:
    config.json's (scale_factor=...); dtype: the tensors'."""
    from fx_engine.core.vision import idefics3

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dt = getattr(mx, dtype)
    text = tiny_config("llama", **{"tie_word_embeddings": False,  # (mlx-vlm's text model always has lm_head)
                                   **(text or {})})
    text.pop("architectures", None)
    cfg = {"model_type": model_type, "architectures": ["Idefics3ForConditionalGeneration"], "text_config": text,
           "vision_config": {**IDEFICS3_VISION, **(vision or {})}, "scale_factor": 2,
           "image_token_id": IDEFICS3_IMAGE_ID, "vocab_size": text["vocab_size"], "eos_token_id": 2,
           "bos_token_id": 1, "tie_word_embeddings": False, **top}
    weights = {}
    for name, w in _weights(text, dt, seed).items():
        weights["lm_head.weight" if name == "lm_head.weight" else "model.text_model." + name[len("model."):]] = w
    layout_v = idefics3.checkpoint_layout(idefics3.config_from_hf(cfg))
    keys = iter(mx.random.split(mx.random.key(seed + 7919), len(layout_v)))
    vis = {n: (s.center + s.scale * mx.random.normal(s.shape, key=next(keys))).astype(dt)
           for n, s in layout_v.items()}
    if layout == "mlx":
        vis = {n[len("model."):]: w for n, w in vis.items()}
        pn = "vision_model.embeddings.patch_embedding.weight"
        vis[pn] = mx.contiguous(vis[pn].transpose(0, 2, 3, 1))
        weights = {("language_model." + n[len("model.text_model."):] if n.startswith("model.text_model.")
                    else "language_model.lm_head.weight"): w for n, w in weights.items()}
    weights.update(vis)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps({**IDEFICS3_PREPROCESSOR, **(preprocessor or {})}))
    (folder / "tokenizer.json").write_text(_tokenizer_json(text["vocab_size"], IDEFICS3_SPECIALS))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


# ---------------------------------------------------------------- Qwen2.5-VL / Qwen2-VL

QWEN2_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                     "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
#: the multimodal token ids inside the tiny vocabulary (config.json's fields)
QWEN2_VL_IDS = {"vision_start_token_id": 3, "vision_end_token_id": 4, "image_token_id": 6, "video_token_id": 7}
#: tiny towers (patch 4, merge 2: 8 pixels a merged token; Qwen2.5-VL's windows 16 pixels:
#: 2 x 2 merged tokens), out_hidden_size = the tiny text model's hidden size
QWEN2_5_VL_VISION = {"model_type": "qwen2_5_vl", "depth": 3, "hidden_size": 32, "intermediate_size": 48,
                     "num_heads": 2, "out_hidden_size": 64, "patch_size": 4, "temporal_patch_size": 2,
                     "spatial_merge_size": 2, "in_channels": 3, "window_size": 16, "fullatt_block_indexes": [1],
                     "hidden_act": "silu", "tokens_per_second": 2}
QWEN2_VL_VISION = {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2,
                   "num_heads": 2, "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2,
                   "in_chans": 3, "hidden_act": "quick_gelu"}
#: Qwen2VLImageProcessor's rules at the tiny patch geometry: images resized to multiples of
#: 8 pixels, between 4 and 36 merged tokens
QWEN2_VL_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "do_convert_rgb": True,
                         "do_normalize": True, "do_rescale": True, "do_resize": True,
                         "image_mean": [0.48145466, 0.4578275, 0.40821073],
                         "image_std": [0.26862954, 0.26130258, 0.27577711], "min_pixels": 16 * 16,
                         "max_pixels": 48 * 48, "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
                         "resample": 3, "rescale_factor": 1 / 255}
#: the tiny text model's M-RoPE sections (head_dim 16: 8 frequencies)
QWEN2_VL_MROPE = [2, 3, 3]


def write_tiny_qwen2_vl(folder: str | Path, model_type: str = "qwen2_5_vl", layout: str = "hf", seed: int = 0,
                        preprocessor: dict | None = None, *, text: dict | None = None,
                        vision: dict | None = None, dtype: str = "float32") -> Path:
    """A random-weight Qwen2.5-VL (or Qwen2-VL: model_type "qwen2_vl") folder: a tiny Qwen2
    text model with M-RoPE and the tiny tower. layout "hf": as the published folders
    (transformers < 4.52: the text model's fields at config.json's top level, tensors
    model.* / lm_head.* / visual.*; mlx-vlm reads it); "nested": transformers >= 4.52's
    (text_config; model.language_model.*, model.visual.*). text / vision: overrides of the
    tiny text model's fields / vision_config (a real geometry: tools/bench_vision.py);
    dtype: the tensors'."""
    from fx_engine.core.vision import qwen2_vl

    if layout not in ("hf", "nested"):
        raise ValueError(f"layout must be 'hf' or 'nested', got {layout!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dt = getattr(mx, dtype)
    text = tiny_config("qwen2", **{"tie_word_embeddings": False,
                                   "rope_scaling": {"type": "mrope", "mrope_section": list(QWEN2_VL_MROPE)},
                                   **(text or {})})
    text.pop("architectures", None)
    vision = {**(QWEN2_5_VL_VISION if model_type == "qwen2_5_vl" else QWEN2_VL_VISION), **(vision or {})}
    arch = "Qwen2_5_VLForConditionalGeneration" if model_type == "qwen2_5_vl" else "Qwen2VLForConditionalGeneration"
    top = {"architectures": [arch], "vision_config": vision, **QWEN2_VL_IDS}
    if layout == "hf":
        cfg = {**text, **top, "model_type": model_type}
    else:
        cfg = {"model_type": model_type, **top, "text_config": {**text, "model_type": f"{model_type}_text"},
               "vocab_size": text["vocab_size"], "tie_word_embeddings": False}
    weights = {}
    for name, w in _weights(text, dt, seed).items():
        if layout == "nested" and name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        weights[name] = w
    layout_v = qwen2_vl.checkpoint_layout(qwen2_vl.config_from_hf(cfg))
    keys = iter(mx.random.split(mx.random.key(seed + 7919), len(layout_v)))
    for name, spec in layout_v.items():
        w = (spec.center + spec.scale * mx.random.normal(spec.shape, key=next(keys))).astype(dt)
        weights[("model." + name) if layout == "nested" else name] = w
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps({**QWEN2_VL_PREPROCESSOR, **(preprocessor or {})}))
    (folder / "tokenizer.json").write_text(_tokenizer_json(text["vocab_size"], QWEN2_VL_SPECIALS))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


# ---------------------------------------------------------------- Mistral 3 (Pixtral)

MISTRAL3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
MISTRAL3_IMAGE_ID = MISTRAL3_SPECIALS.index("[IMG]")
#: the tiny Pixtral tower: patches of 4 pixels, merged 2 x 2 (8 pixels an image token), at
#: most 16 x 16 patches (images resized to a longest edge of 64)
MISTRAL3_VISION = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "head_dim": 8, "patch_size": 4, "image_size": 64,
                   "rope_theta": 10000.0, "hidden_act": "silu", "num_channels": 3}
MISTRAL3_PREPROCESSOR = {"image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
                         "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                         "image_mean": [0.48145466, 0.4578275, 0.40821073],
                         "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": {"height": 4, "width": 4},
                         "resample": 3, "rescale_factor": 1 / 255, "size": {"longest_edge": 64}}


def tiny_mistral3_config(vision: dict[str, Any] | None = None, *, text: dict[str, Any] | None = None,
                         **top: Any) -> dict[str, Any]:
    """config.json of a tiny Mistral 3 (a `mistral` text model with `text`'s overrides, the
    tiny Pixtral tower with `vision`'s overrides)."""
    text = tiny_config("mistral", **{"tie_word_embeddings": False, "head_dim": 16,  # (mlx-vlm's Mistral reads head_dim)
                                     **(text or {})})
    text.pop("architectures", None)
    return {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"], "text_config": text,
            "vision_config": {**MISTRAL3_VISION, **(vision or {})}, "image_token_index": MISTRAL3_IMAGE_ID,
            "spatial_merge_size": 2, "multimodal_projector_bias": False, "projector_hidden_act": "gelu",
            "vision_feature_layer": -1, "vocab_size": text["vocab_size"], "eos_token_id": 2, "bos_token_id": 1,
            "tie_word_embeddings": False, **top}


def write_tiny_mistral3(folder: str | Path, layout: str = "hf", seed: int = 0,
                        preprocessor: dict | None = None, *, dtype: str = "float32", **top: Any) -> Path:
    """A random-weight Mistral 3 folder: the tiny `mistral` text model and the tiny Pixtral
    tower and projector (core/vision/pixtral.checkpoint_layout; every layer of the tower,
    whatever vision_feature_layer says). Its tensors are exactly those mlx-vlm 0.7.10's
    `mistral3.Model` has for this config (tests/models/test_mistral3_vision.py checks
    names and shapes against its classes; mlx-vlm is not imported here). layout "hf":
    transformers >= 4.52's names (model.vision_tower.*, model.multi_modal_projector.*,
    model.language_model.*, lm_head.*; the patch conv [hidden, C, p, p]); "legacy":
    earlier transformers' (vision_tower.*, multi_modal_projector.*, language_model.model.*,
    language_model.lm_head.*); "mlx": mlx-vlm's conversions' (vision_tower.vision_model.*,
    multi_modal_projector.*, language_model.*; the patch conv channels last). top:
    config.json overrides (multimodal_projector_bias=True, vision_feature_layer=...,
    vision={...}: vision_config's, text={...}: text_config's); dtype: the tensors'."""
    from fx_engine.core.vision import pixtral

    if layout not in ("hf", "legacy", "mlx"):
        raise ValueError(f"layout must be 'hf', 'legacy' or 'mlx', got {layout!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_mistral3_config(**top)
    dt = getattr(mx, dtype)
    weights = {}
    for name, w in _weights(cfg["text_config"], dt, seed).items():
        if name.startswith("model."):
            name = {"hf": "model.language_model.", "legacy": "language_model.model.",
                    "mlx": "language_model.model."}[layout] + name[len("model."):]
        else:  # lm_head.weight
            name = name if layout == "hf" else "language_model." + name
        weights[name] = w
    tower, proj = {"hf": ("model.vision_tower.", "model.multi_modal_projector."),
                   "legacy": ("vision_tower.", "multi_modal_projector."),
                   "mlx": ("vision_tower.vision_model.", "multi_modal_projector.")}[layout]
    vcfg = pixtral.config_from_hf({**cfg, "vision_feature_layer": -1}, "tiny")  # (every layer stored)
    spec = pixtral.checkpoint_layout(vcfg, tower, proj)
    keys = iter(mx.random.split(mx.random.key(seed + 7919), len(spec)))
    for name, s in spec.items():
        w = (s.center + s.scale * mx.random.normal(s.shape, key=next(keys))).astype(dt)
        if layout == "mlx" and name.endswith("patch_conv.weight"):
            w = mx.contiguous(w.transpose(0, 2, 3, 1))
        weights[name] = w
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps({**MISTRAL3_PREPROCESSOR, **(preprocessor or {})}))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": cfg["vision_config"]["patch_size"],
        "spatial_merge_size": cfg["spatial_merge_size"], "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]"}))
    (folder / "tokenizer.json").write_text(_tokenizer_json(cfg["text_config"]["vocab_size"], MISTRAL3_SPECIALS))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


# ---------------------------------------------------------------- Qwen3-VL

#: the tiny Qwen3-VL tower: patch 4, merge 2 (8 pixels a merged token), a 4 x 4 learned
#: position grid, DeepStack features from blocks 0 and 2 (into the tiny text model's two
#: layers), out_hidden_size = the tiny text model's hidden size
QWEN3_VL_VISION = {"model_type": "qwen3_vl", "depth": 3, "hidden_size": 32, "intermediate_size": 48,
                   "num_heads": 2, "out_hidden_size": 64, "patch_size": 4, "temporal_patch_size": 2,
                   "spatial_merge_size": 2, "in_channels": 3, "num_position_embeddings": 16,
                   "deepstack_visual_indexes": [0, 2], "hidden_act": "gelu_pytorch_tanh"}
#: Qwen3-VL's preprocessor_config.json form (size.shortest_edge / longest_edge, mean = std =
#: 0.5) at the tiny geometry
QWEN3_VL_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "do_convert_rgb": True,
                         "do_normalize": True, "do_rescale": True, "do_resize": True,
                         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                         "size": {"shortest_edge": 16 * 16, "longest_edge": 48 * 48}, "patch_size": 4,
                         "temporal_patch_size": 2, "merge_size": 2, "resample": 3, "rescale_factor": 1 / 255}
#: the tiny text model's interleaved M-RoPE sections (head_dim 16: 8 frequencies; t h w t h w t t)
QWEN3_VL_MROPE = [4, 2, 2]


def _fused_experts(weights: dict[str, mx.array], text: dict, stacked: bool) -> dict[str, mx.array]:
    """A Qwen3-MoE checkpoint's per-expert tensors (mlp.experts.{e}.{gate,up,down}_proj)
    as Qwen3-VL-MoE's fused ones (x @ W) or, `stacked`, mlx-vlm's switch_mlp stacks."""
    out = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    for i in range(text["num_hidden_layers"]):
        pre = f"model.layers.{i}.mlp."
        if pre + "experts.0.gate_proj.weight" not in weights:
            continue
        stack = {n: mx.stack([weights[f"{pre}experts.{e}.{n}_proj.weight"] for e in range(text["num_experts"])])
                 for n in ("gate", "up", "down")}  # [E, out, in]
        if stacked:
            for n, w in stack.items():
                out[f"{pre}switch_mlp.{n}_proj.weight"] = w
        else:
            out[pre + "experts.gate_up_proj"] = mx.contiguous(
                mx.concatenate([stack["gate"], stack["up"]], axis=1).swapaxes(1, 2))
            out[pre + "experts.down_proj"] = mx.contiguous(stack["down"].swapaxes(1, 2))
    return out


def write_tiny_qwen3_vl(folder: str | Path, seed: int = 0, preprocessor: dict | None = None,
                        vision: dict | None = None, layout: str = "hf", *, text: dict | None = None,
                        dtype: str = "float32", moe: bool = False) -> Path:
    """A random-weight Qwen3-VL folder as transformers >= 4.57 writes it (text_config with
    rope_scaling {mrope_section, mrope_interleaved}; model.language_model.*, model.visual.*,
    lm_head.*): a tiny Qwen3 text model (q / k norms) and the tiny tower with its DeepStack
    mergers. mlx-vlm reads it (the oracle). layout "mlx": as mlx-vlm's conversions store it
    (language_model.model.*, language_model.lm_head.*, vision_tower.*, the patch conv's
    weight channels last). text: overrides of the tiny text model's fields (a real geometry:
    tools/bench_vision.py); dtype: the tensors'. moe: Qwen3-VL-MoE (`qwen3_vl_moe`): a tiny
    Qwen3-MoE text model, its experts fused as the released checkpoints store them
    (mlp.experts.gate_up_proj [E, H, 2F], gate then up; down_proj [E, F, H]: x @ W), or
    mlx-vlm's switch_mlp stacks in the "mlx" layout."""
    if layout not in ("hf", "mlx"):
        raise ValueError(f"layout must be 'hf' or 'mlx', got {layout!r}")
    from fx_engine.core.vision import qwen3_vl

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dt = getattr(mx, dtype)
    text = tiny_config("qwen3_moe" if moe else "qwen3", **{"tie_word_embeddings": False,
                                   "rope_scaling": {"rope_type": "default", "mrope_section": list(QWEN3_VL_MROPE),
                                                    "mrope_interleaved": True},
                                   **(text or {})})
    text.pop("architectures", None)
    mt = "qwen3_vl_moe" if moe else "qwen3_vl"
    cfg = {"model_type": mt, "architectures": ["Qwen3VLMoeForConditionalGeneration" if moe
                                                else "Qwen3VLForConditionalGeneration"],
           "text_config": {**text, "model_type": mt + "_text"},
           "vision_config": {**QWEN3_VL_VISION, "model_type": mt, **(vision or {})},
           **QWEN2_VL_IDS, "vocab_size": text["vocab_size"], "tie_word_embeddings": False}
    weights = {}
    text_weights = _weights(text, dt, seed)
    if moe:
        text_weights = _fused_experts(text_weights, text, stacked=layout == "mlx")
    for name, w in text_weights.items():
        weights[("model.language_model." + name[len("model."):]) if name.startswith("model.") else name] = w
    layout_v = qwen3_vl.checkpoint_layout(qwen3_vl.config_from_hf(cfg))
    keys = iter(mx.random.split(mx.random.key(seed + 7919), len(layout_v)))
    for name, spec in layout_v.items():
        weights[name] = (spec.center + spec.scale * mx.random.normal(spec.shape, key=next(keys))).astype(dt)
    if layout == "mlx":
        renamed = {}
        for name, w in weights.items():
            if name.startswith("model.visual."):
                name = "vision_tower." + name[len("model.visual."):]
                if name.endswith("patch_embed.proj.weight"):
                    w = mx.contiguous(w.transpose(0, 2, 3, 4, 1))
            elif name.startswith("model.language_model."):
                name = "language_model.model." + name[len("model.language_model."):]
            else:
                name = "language_model." + name
            renamed[name] = w
        weights = renamed
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps({**QWEN3_VL_PREPROCESSOR, **(preprocessor or {})}))
    (folder / "tokenizer.json").write_text(_tokenizer_json(text["vocab_size"], QWEN2_VL_SPECIALS))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


# ---------------------------------------------------------------- Gemma 4

#: the tiny Gemma 4 tower: patches of 4 pixels pooled 3 x 3 (12 pixels a soft token),
#: grouped-query heads of 8, a 256-entry position table (the longest side at 70 soft
#: tokens: 210 patches), 70 soft tokens an image
GEMMA4_VISION = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4,
                 "pooling_kernel_size": 3, "position_embedding_size": 256, "default_output_length": 70,
                 "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
                 "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
                 "use_clipped_linears": False, "standardize": False}
GEMMA4_SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<|image|>", "<|image>", "<image|>"]
GEMMA4_IDS = {"image_token_id": 3, "boi_token_id": 4, "eoi_token_id": 5}
#: Gemma4ImageProcessor's preprocessor_config.json at the tiny geometry
GEMMA4_PREPROCESSOR = {"image_processor_type": "Gemma4ImageProcessor", "do_convert_rgb": True, "do_normalize": False,
                       "do_rescale": True, "do_resize": True, "image_mean": [0.0, 0.0, 0.0],
                       "image_std": [1.0, 1.0, 1.0], "max_soft_tokens": 70, "patch_size": 4,
                       "pooling_kernel_size": 3, "resample": 3, "rescale_factor": 1 / 255}


def tiny_gemma4_config(vision: dict[str, Any] | None = None, *, text: dict[str, Any] | None = None,
                       **top: Any) -> dict[str, Any]:
    """config.json of a tiny Gemma 4 (the tiny `gemma4_text` with `text`'s overrides, the
    tiny tower with `vision`'s)."""
    text_cfg = tiny_config("gemma4_text", **{"pad_token_id": 0, **(text or {})})
    text_cfg.pop("architectures", None)
    return {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text_cfg,
            "vision_config": {**GEMMA4_VISION, **(vision or {})}, "audio_config": None, **GEMMA4_IDS,
            "vision_soft_tokens_per_image": 70, "vocab_size": text_cfg["vocab_size"], "eos_token_id": 2,
            "bos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": True, **top}


def write_tiny_gemma4(folder: str | Path, layout: str = "hf", seed: int = 0, preprocessor: dict | None = None, *,
                      dtype: str = "float32", quantize_vision: dict[str, int] | None = None, **top: Any) -> Path:
    """A random-weight Gemma 4 folder: the tiny `gemma4_text` model (per-layer inputs,
    KV-shared layers) and the tiny vision tower and embedder (core/vision/gemma4.checkpoint_layout).
    layout "hf": transformers 5's names (model.language_model.*, model.vision_tower.*,
    model.embed_vision.*); "mlx": mlx-vlm's conversions' (language_model.model.*,
    vision_tower.*, embed_vision.*). top: config.json overrides (vision={...},
    text={...}: e.g. use_bidirectional_attention "vision"); quantize_vision: the tower's
    linears MLX affine-quantized ({"group_size": 32, "bits": 4}) with a `quantization`
    entry. mlx-vlm reads it (the oracle)."""
    from fx_engine.core.vision import gemma4

    if layout not in ("hf", "mlx"):
        raise ValueError(f"layout must be 'hf' or 'mlx', got {layout!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_gemma4_config(**top)
    dt = getattr(mx, dtype)
    weights = {}
    for name, w in _weights(cfg["text_config"], dt, seed).items():
        if name.startswith("model."):
            name = {"hf": "model.language_model.", "mlx": "language_model.model."}[layout] + name[len("model."):]
        weights[name] = w
    spec = gemma4.checkpoint_layout(gemma4.config_from_hf(cfg, "tiny"),
                                    *{"hf": gemma4.TOWER_PREFIXES[0:1] + gemma4.EMBEDDER_PREFIXES[0:1],
                                      "mlx": gemma4.TOWER_PREFIXES[1:2] + gemma4.EMBEDDER_PREFIXES[1:2]}[layout])
    keys = iter(mx.random.split(mx.random.key(seed + 7919), len(spec)))
    for name, s in spec.items():
        weights[name] = (s.center + s.scale * mx.random.normal(s.shape, key=next(keys))).astype(dt)
    if quantize_vision:
        gs, bits = quantize_vision["group_size"], quantize_vision["bits"]
        for name in [n for n in weights if n.endswith(".linear.weight")]:
            q, s, b = mx.quantize(weights[name], group_size=gs, bits=bits)
            base = name[: -len(".weight")]
            weights[name], weights[base + ".scales"], weights[base + ".biases"] = q, s, b
        cfg["quantization"] = {"group_size": gs, "bits": bits}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps({**GEMMA4_PREPROCESSOR, **(preprocessor or {})}))
    (folder / "tokenizer.json").write_text(_tokenizer_json(cfg["vocab_size"], GEMMA4_SPECIALS))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<pad>", "add_bos_token": False,
        "image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder
