"""Vision encoders as pure core code (issue 46: images in, text out), one module per
family, like the text models in fx_engine/core/models/: a frozen config read from the
checkpoint's config.json, params read from its tensors, a pure forward from preprocessed
pixels to the text model's image token embeddings.

`VISION_MODULES` maps a multimodal config.json `model_type` to its module; each module has
`config_from_hf(d, source)`, `assemble(cfg, src, opts)`, `checkpoint_layout(cfg)`,
`is_vision_tensor(name)` and `encode_images(params, pixels)` (Qwen2(.5)-VL's:
`encode_images(params, patches, grid_thw)`; Gemma 4's, one image at a time:
`encode_image(params, patches, grid)`).

* siglip.py: the SigLIP vision tower (Gemma 3's).
* gemma3.py: Gemma 3's projector, the prompt layout and the image-token attention masks.
* gemma4.py: Gemma 4's own vision transformer (2-D rotary, images of any aspect ratio
  within a soft-token budget, k x k pooling), its projection and prompt layout.
* idefics3.py: Idefics3 / SmolVLM's connector (pixel shuffle + projection), tiles and
  prompt layout (a Llama text model).
* qwen2_vl.py: Qwen2.5-VL's and Qwen2-VL's vision transformer (window attention, 2-D
  rotary, patch merger), the prompt's image-token runs and its 3-D (M-RoPE) positions
  (a Qwen2 text model: core/models/llama.py with core/models/mrope.py).
* qwen3_vl.py: Qwen3-VL's vision transformer (learned position grid, DeepStack mergers;
  `encode_images` returns (rows, deepstack)); the prompt side is qwen2_vl.py's (a Qwen3 text
  model with interleaved M-RoPE and DeepStack: core/models/llama.py).
* pixtral.py: Mistral 3's (`mistral3`) Pixtral tower (2-D rotary), projector with its
  patch merger, and the prompt's [IMG] / [IMG_BREAK] / [IMG_END] layout (a Mistral text
  model; images of any size: `encode_images(params, pixels)` per image size).
* splice.py: `ImageInput` and the splice of image rows into the token embeddings (any
  family).

The any-size towers (Qwen2-VL / 2.5-VL / 3-VL, Pixtral) pad to core/buckets.size_bucket in
`encode_images_compiled`, so a compiled tower traces once per bucket (8 per octave of
tokens), not per image size.

Each module also names `PLACEHOLDER`-like prompt text through its config's `placeholder`
(engine/image_prompt.py reads it) and has `encode_images_compiled`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from fx_engine.core.config import ConfigError
from fx_engine.core.vision import gemma3, gemma4, idefics3, pixtral, qwen2_vl, qwen3_vl, siglip, splice

#: multimodal config.json model_type -> the module that runs its image path
VISION_MODULES: dict[str, ModuleType] = {gemma3.MODEL_TYPE: gemma3, gemma4.MODEL_TYPE: gemma4, **{mt: idefics3 for mt in idefics3.MODEL_TYPES},
                                          **{mt: qwen2_vl for mt in qwen2_vl.MODEL_TYPES},
                                          **{mt: pixtral for mt in pixtral.MODEL_TYPES},
                                          **{mt: qwen3_vl for mt in qwen3_vl.MODEL_TYPES}}


def vision_module(d: dict[str, Any], source: str = "config.json") -> ModuleType:
    """The module running a config.json's image path, or a ConfigError naming what is
    supported."""
    mt = d.get("model_type")
    if mt not in VISION_MODULES:
        raise ConfigError(f"{source}: images are not supported for model_type {mt!r} (supported: "
                          f"{', '.join(VISION_MODULES)})")
    return VISION_MODULES[mt]


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Any:
    """The image path's config of a multimodal config.json dict."""
    return vision_module(d, source).config_from_hf(d, source)


__all__ = ["VISION_MODULES", "config_from_hf", "gemma3", "gemma4", "idefics3", "pixtral", "qwen2_vl", "qwen3_vl", "siglip", "splice",
           "vision_module"]
