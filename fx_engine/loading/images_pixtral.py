"""Mistral 3 (Pixtral) pixel preprocessing (issue 46): transformers' PixtralImageProcessor
rules, step for step as its torch-free PIL backend (`PixtralImageProcessorPil`,
transformers 5.x; mlx-vlm's own PixtralImageProcessor likewise) computes them, with the
patch size PixtralProcessor passes it (patch_size * spatial_merge_size: Mistral 3's
processor resizes to whole image tokens), from a preprocessor_config.json dict:

1. to RGB as fx_engine/loading/images.py does (`_rgb_array`).
2. resize: ratio = max(H / longest_edge, W / longest_edge); if over 1, each side
   floor(side / ratio); then each side rounded up to a multiple of
   f = patch_size * spatial_merge_size ((side - 1) // f + 1 patches of f); PIL's resize
   with `resample` (3: bicubic) on the 8-bit image. No tiling, no crop.
3. rescale (float64 times rescale_factor, then float32) and normalize ((x - mean) / std in
   float32; OpenAI CLIP's mean / std by default).
4. channels first: [3, H', W'] float32, one image at a time (the processor pads a batch to
   its largest image and passes image_sizes; the tower crops each back: the same).

The image's token grid is (H' / f, W' / f) (core/vision/pixtral.PixtralConfig.token_grid).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np

from fx_engine.core.config import ConfigError
from fx_engine.loading.images import ImageError, PixelRules, _pil, _rgb_array, normalized_pixels, read_pixel_rules

#: the image processors whose rules these are
PROCESSOR_TYPES = ("PixtralImageProcessor", "PixtralImageProcessorFast", "PixtralImageProcessorPil")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@attrs.frozen
class PixtralProcessorConfig(PixelRules):
    """preprocessor_config.json's rules (defaults: PixtralImageProcessor's) and the merge
    size of the model (the processor_config.json / config.json `spatial_merge_size`)."""

    resample: int = 3
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    longest_edge: int = 1024
    patch_size: int = 16
    merge_size: int = 1

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def _size_of(v: Any, key: str, default: int, source: str) -> int:
    """An int, or a {"height": n, "width": n} dict of one size (patch_size's forms)."""
    if v is None:
        return default
    if isinstance(v, dict):
        vals = {v.get("height"), v.get("width")} - {None}
        if len(vals) != 1:
            raise ConfigError(f"{source}: field '{key}' must have equal height and width, got {v!r}")
        v = vals.pop()
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{source}: field '{key}' must be a positive integer, got {v!r}")
    return v


def processor_config_from_dict(d: dict[str, Any], source: str = "preprocessor_config.json",
                               merge_size: int = 1) -> PixtralProcessorConfig:
    """The rules of a Pixtral preprocessor_config.json dict (merge_size: the model's
    spatial_merge_size); ConfigError naming the field for what is malformed or not
    implemented."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    kind = d.get("image_processor_type")
    if kind is not None and kind not in PROCESSOR_TYPES:
        raise ConfigError(f"{source}: image_processor_type {kind!r} is not supported ({', '.join(PROCESSOR_TYPES)})")
    size = d.get("size")
    if size is None:
        edge = 1024
    elif isinstance(size, dict) and set(size) == {"longest_edge"}:
        edge = _size_of(size["longest_edge"], "size.longest_edge", 1024, source)
    else:
        raise ConfigError(f"{source}: field 'size' must be {{\"longest_edge\": N}}, got {size!r}")
    if d.get("do_center_crop"):
        raise ConfigError(f"{source}: field 'do_center_crop' = true is not supported (not part of Pixtral's "
                          "processing)")
    rules = read_pixel_rules(d, source, PixtralProcessorConfig())
    if not rules["do_resize"]:
        raise ConfigError(f"{source}: field 'do_resize' = false is not supported (images would have to come in "
                          "multiples of patch_size * spatial_merge_size already)")
    return PixtralProcessorConfig(longest_edge=edge, patch_size=_size_of(d.get("patch_size"), "patch_size", 16, source),
                                  merge_size=merge_size, **rules)


def target_size(height: int, width: int, cfg: PixtralProcessorConfig) -> tuple[int, int]:
    """transformers' pixtral get_resize_output_image_size at patch size `cfg.factor`."""
    ratio = max(height / cfg.longest_edge, width / cfg.longest_edge)
    if ratio > 1:
        height, width = int(np.floor(height / ratio)), int(np.floor(width / ratio))
    f = cfg.factor
    return ((height - 1) // f + 1) * f, ((width - 1) // f + 1) * f


def preprocess_one(image: Any, cfg: PixtralProcessorConfig, what: str = "image") -> np.ndarray:
    """One image -> [3, H', W'] float32 pixels (the module docstring's steps)."""
    arr = _rgb_array(image, what, cfg.do_convert_rgb)
    th, tw = target_size(*arr.shape[:2], cfg)
    if th <= 0 or tw <= 0:
        raise ImageError(f"{what}: {arr.shape[1]}x{arr.shape[0]} pixels resize to nothing")
    if (th, tw) != arr.shape[:2]:
        arr = np.array(_pil().Image.fromarray(arr).resize((tw, th), resample=cfg.resample))
    return normalized_pixels(arr, cfg)


def folder_processor_config(folder: str | Path, tower: Any) -> PixtralProcessorConfig:
    """The rules `fx_engine.load` puts on `Model.image_processor` for a Mistral 3 folder: its
    preprocessor_config.json's (the patch size checked against the tower's), or the
    processor's defaults at the tower's geometry (longest edge: its image_size)."""
    from fx_engine.loading.weights import read_json_object

    merge = tower.spatial_merge_size
    if not (Path(folder) / "preprocessor_config.json").exists():
        return PixtralProcessorConfig(longest_edge=tower.image_size, patch_size=tower.patch_size, merge_size=merge)
    d, path = read_json_object(folder, "preprocessor_config.json", "the image preprocessing rules")
    cfg = processor_config_from_dict(d, str(path), merge)
    if cfg.patch_size != tower.patch_size:
        raise ConfigError(f"{path}: field 'patch_size' ({cfg.patch_size}) is not the vision tower's patch_size "
                          f"({tower.patch_size})")
    return cfg
