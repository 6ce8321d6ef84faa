"""Gemma 4 pixel preprocessing: transformers' Gemma4ImageProcessor rules, step for step as
its torch-free PIL backend (`Gemma4ImageProcessorPil`, transformers 5.x; mlx-vlm's
Gemma4ImageProcessor likewise) computes them:

1. to RGB as fx_engine/loading/images.py does (`_rgb_array`).
2. resize, keeping the aspect ratio, to the largest size of at most max_patches =
   max_soft_tokens * k^2 patches of patch_size pixels whose sides are multiples of
   f = pooling_kernel_size (k) * patch_size: factor = sqrt(max_patches * patch_size^2 /
   (H * W)), each side floor(side * factor / f) * f; a side that comes out 0 becomes f and
   the other floor(long / short) * f, at most (max_patches / k^2) * f. PIL's resize with
   `resample` (3: bicubic) on the 8-bit image (none when the size is already that).
3. rescale (float64 times rescale_factor, then float32); normalize only where the config
   says so (Gemma 4's says not: the model maps [0, 1] to [-1, 1] itself).
4. patches: the [3, H', W'] image cut into (H' / p) x (W' / p) patches, row-major, each
   flattened in (row, column, channel) order: [n, p * p * 3], with their (x, y) grid
   positions (the processor pads both to max_patches; core/vision/gemma4.py runs the real
   ones).

The image's soft tokens: (H' / p / k) * (W' / p / k). The rules come from the folder's
preprocessor_config.json, else processor_config.json's "image_processor" object (the form
transformers 5 saves), else the processor's defaults at the tower's geometry.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from fx_engine.core.config import POSITIVE, ConfigError, Field, read_field
from fx_engine.loading.images import ImageError, PixelRules, _pil, _rgb_array, normalized_pixels, read_pixel_rules

#: the image processors whose rules these are
PROCESSOR_TYPES = ("Gemma4ImageProcessor", "Gemma4ImageProcessorFast", "Gemma4ImageProcessorPil")
#: the soft-token budgets Gemma4ImageProcessor accepts
SOFT_TOKENS = (70, 140, 280, 560, 1120)


@attrs.frozen
class Gemma4ProcessorConfig(PixelRules):
    """preprocessor_config.json's rules (defaults: Gemma4ImageProcessor's)."""

    resample: int = 3
    do_normalize: bool = False
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2


def _positive(d: dict[str, Any], key: str, default: int, source: str) -> int:
    return read_field(d, Field(key, POSITIVE, default, null_default=True), source)


def processor_config_from_dict(d: dict[str, Any], source: str = "preprocessor_config.json",
                               defaults: Gemma4ProcessorConfig | None = None) -> Gemma4ProcessorConfig:
    """The rules of a Gemma 4 preprocessor_config.json dict (missing fields: `defaults`');
    ConfigError naming the field for what is malformed or not implemented."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    defaults = defaults or Gemma4ProcessorConfig()
    kind = d.get("image_processor_type")
    if kind is not None and kind not in PROCESSOR_TYPES:
        raise ConfigError(f"{source}: image_processor_type {kind!r} is not supported ({', '.join(PROCESSOR_TYPES)})")
    rules = read_pixel_rules(d, source, defaults)
    if not rules["do_resize"]:
        raise ConfigError(f"{source}: field 'do_resize' = false is not supported (Gemma 4 resizes every image to "
                          "its patch budget)")
    soft = _positive(d, "max_soft_tokens", defaults.max_soft_tokens, source)
    if soft not in SOFT_TOKENS:
        raise ConfigError(f"{source}: field 'max_soft_tokens' must be one of {SOFT_TOKENS}, got {soft}")
    return Gemma4ProcessorConfig(patch_size=_positive(d, "patch_size", defaults.patch_size, source),
                                 max_soft_tokens=soft,
                                 pooling_kernel_size=_positive(d, "pooling_kernel_size", defaults.pooling_kernel_size,
                                                               source), **rules)


def target_size(height: int, width: int, cfg: Gemma4ProcessorConfig) -> tuple[int, int]:
    """The resized (height, width): Gemma4ImageProcessor's aspect-ratio-preserving size
    (the module docstring's step 2); ImageError where nothing fits."""
    p, k = cfg.patch_size, cfg.pooling_kernel_size
    side = k * p
    factor = math.sqrt(cfg.max_patches * p * p / (height * width))
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    if th == 0 and tw == 0:
        raise ImageError(f"a {width}x{height} image resizes to 0 x 0 pixels")
    longest = (cfg.max_patches // k ** 2) * side
    if th == 0:
        th, tw = side, min(int(math.floor(width / height)) * side, longest)
    elif tw == 0:
        th, tw = min(int(math.floor(height / width)) * side, longest), side
    if th * tw > cfg.max_patches * p * p:
        raise ImageError(f"a {width}x{height} image resizes to {tw}x{th} pixels, more than {cfg.max_patches} "
                         f"patches of {p} pixels")
    return th, tw


def patches_of(pixels: np.ndarray, patch: int) -> np.ndarray:
    """[3, H, W] -> [(H / p) * (W / p), p * p * 3]: patches row-major, each in (row,
    column, channel) order (Gemma4ImageProcessor's convert_image_to_patches)."""
    c, h, w = pixels.shape
    x = pixels.reshape(c, h // patch, patch, w // patch, patch).transpose(1, 3, 2, 4, 0)
    return np.ascontiguousarray(x.reshape((h // patch) * (w // patch), patch * patch * c))


def preprocess_one(image: Any, cfg: Gemma4ProcessorConfig, what: str = "image") -> tuple[np.ndarray, tuple[int, int]]:
    """One image -> (its patches [n, p * p * 3] float32, its patch grid (rows, columns))."""
    arr = _rgb_array(image, what, cfg.do_convert_rgb)
    th, tw = target_size(*arr.shape[:2], cfg)
    if (th, tw) != arr.shape[:2]:
        arr = np.array(_pil().Image.fromarray(arr).resize((tw, th), resample=cfg.resample))
    p = cfg.patch_size
    return patches_of(normalized_pixels(arr, cfg), p), (th // p, tw // p)


def folder_processor_config(folder: str | Path, tower: Any) -> Gemma4ProcessorConfig:
    """The rules `fx_engine.load` puts on `Model.image_processor` for a Gemma 4 folder (its
    preprocessor_config.json's, else processor_config.json's image_processor, else the
    defaults at the tower's patch size, pooling and soft tokens), checked against the tower."""
    from fx_engine.loading.weights import read_json_object

    soft = tower.default_output_length if tower.default_output_length in SOFT_TOKENS else 280
    base = Gemma4ProcessorConfig(patch_size=tower.patch_size, pooling_kernel_size=tower.pooling_kernel_size,
                                 max_soft_tokens=soft)
    folder = Path(folder)
    cfg, path = base, folder
    if (folder / "preprocessor_config.json").exists():
        d, path = read_json_object(folder, "preprocessor_config.json", "the image preprocessing rules")
        cfg = processor_config_from_dict(d, str(path), base)
    elif (folder / "processor_config.json").exists():
        d, path = read_json_object(folder, "processor_config.json", "the processor's settings")
        if isinstance(d.get("image_processor"), dict):
            cfg = processor_config_from_dict(d["image_processor"], f"{path}: image_processor", base)
    for key in ("patch_size", "pooling_kernel_size"):
        if getattr(cfg, key) != getattr(tower, key):
            raise ConfigError(f"{path}: field '{key}' ({getattr(cfg, key)}) is not the vision tower's "
                              f"({getattr(tower, key)})")
    return cfg
