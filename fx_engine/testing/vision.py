"""Write tiny random-weight multimodal checkpoints as Hugging Face style folders: Gemma 3
(`write_tiny_gemma3_vlm`, model_type `gemma3`: a text model under text_config, a SigLIP tower
under vision_config) and Idefics3 / SmolVLM (`write_tiny_idefics3`: a Llama text model, the
tower, the pixel-shuffle connector, tiles of 32 pixels) and Qwen2.5-VL / Qwen2-VL
(`write_tiny_qwen2_vl`: a Qwen2 text model with M-RoPE, the window-attention tower).

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
                        preprocessor: dict | None = None) -> Path:
    """A random-weight Idefics3 / SmolVLM folder under Hugging Face's names (layout "mlx":
    mlx-vlm's converted names, the patch conv channels last)."""
    from fx_engine.core.vision import idefics3

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = tiny_config("llama", tie_word_embeddings=False)  # (mlx-vlm's text model always has lm_head)
    text.pop("architectures", None)
    cfg = {"model_type": model_type, "architectures": ["Idefics3ForConditionalGeneration"], "text_config": text,
           "vision_config": dict(IDEFICS3_VISION), "scale_factor": 2, "image_token_id": IDEFICS3_IMAGE_ID,
           "vocab_size": text["vocab_size"], "eos_token_id": 2, "bos_token_id": 1, "tie_word_embeddings": False}
    weights = {}
    for name, w in _weights(text, mx.float32, seed).items():
        weights["lm_head.weight" if name == "lm_head.weight" else "model.text_model." + name[len("model."):]] = w
    layout_v = idefics3.checkpoint_layout(idefics3.config_from_hf(cfg))
    keys = iter(mx.random.split(mx.random.key(seed + 7919), len(layout_v)))
    vis = {n: (s.center + s.scale * mx.random.normal(s.shape, key=next(keys))) for n, s in layout_v.items()}
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
                        preprocessor: dict | None = None) -> Path:
    """A random-weight Qwen2.5-VL (or Qwen2-VL: model_type "qwen2_vl") folder: a tiny Qwen2
    text model with M-RoPE and the tiny tower. layout "hf": as the published folders
    (transformers < 4.52: the text model's fields at config.json's top level, tensors
    model.* / lm_head.* / visual.*; mlx-vlm reads it); "nested": transformers >= 4.52's
    (text_config; model.language_model.*, model.visual.*)."""
    from fx_engine.core.vision import qwen2_vl

    if layout not in ("hf", "nested"):
        raise ValueError(f"layout must be 'hf' or 'nested', got {layout!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = tiny_config("qwen2", tie_word_embeddings=False,
                       rope_scaling={"type": "mrope", "mrope_section": list(QWEN2_VL_MROPE)})
    text.pop("architectures", None)
    vision = dict(QWEN2_5_VL_VISION if model_type == "qwen2_5_vl" else QWEN2_VL_VISION)
    arch = "Qwen2_5_VLForConditionalGeneration" if model_type == "qwen2_5_vl" else "Qwen2VLForConditionalGeneration"
    top = {"architectures": [arch], "vision_config": vision, **QWEN2_VL_IDS}
    if layout == "hf":
        cfg = {**text, **top, "model_type": model_type}
    else:
        cfg = {"model_type": model_type, **top, "text_config": {**text, "model_type": f"{model_type}_text"},
               "vocab_size": text["vocab_size"], "tie_word_embeddings": False}
    weights = {}
    for name, w in _weights(text, mx.float32, seed).items():
        if layout == "nested" and name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        weights[name] = w
    layout_v = qwen2_vl.checkpoint_layout(qwen2_vl.config_from_hf(cfg))
    keys = iter(mx.random.split(mx.random.key(seed + 7919), len(layout_v)))
    for name, spec in layout_v.items():
        w = spec.center + spec.scale * mx.random.normal(spec.shape, key=next(keys))
        weights[("model." + name) if layout == "nested" else name] = w
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps({**QWEN2_VL_PREPROCESSOR, **(preprocessor or {})}))
    (folder / "tokenizer.json").write_text(_tokenizer_json(text["vocab_size"], QWEN2_VL_SPECIALS))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder
