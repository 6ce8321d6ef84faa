"""Qwen2-VL / Qwen2.5-VL pixel preprocessing (issue 46): transformers'
Qwen2VLImageProcessor rules (both models use it), step for step as its torch-free PIL
backend (`Qwen2VLImageProcessorPil`, transformers 5.x) computes them, from a
preprocessor_config.json dict:

1. to RGB as fx_engine/loading/images.py does (`_rgb_array`: alpha onto white, grayscale
   repeated; encoded bytes / files opened with EXIF orientation).
2. `smart_resize`: the target (h, w) is each edge rounded to a multiple of
   factor = patch_size * merge_size; if that has more than max_pixels pixels, both edges
   are floor'd to multiples of the factor after dividing by sqrt(h * w / max_pixels) (at
   least one factor); if fewer than min_pixels, ceil'd after multiplying by
   sqrt(min_pixels / (h * w)). An aspect ratio over 200 is refused. Then PIL's resize
   with `resample` (3: bicubic) on the 8-bit image.
3. rescale: float64(x) * rescale_factor, then float32; normalize: (x - mean) / std in
   float32 (mean / std default to OpenAI CLIP's).
4. patches: the [C, H, W] image cut into P x P patches grouped in m x m merge blocks
   (row-major over blocks, row-major inside a block), each patch repeated over
   temporal_patch_size frames (a still image), flattened in (channel, frame, row, column)
   order: [gh * gw, C * T * P * P] per image, grid (1, gh, gw) with gh = H / P, gw = W / P.
   A batch concatenates the images' patches: ([sum gh*gw, C*T*P*P], grid_thw [n, 3]) as
   fx_engine/core/vision/qwen2_vl.py's `encode_images` reads them.

Transformers' default Qwen2VLImageProcessorFast (torchvision) resizes float tensors with
its own antialiasing and so differs in the last bits of some pixels, as for Gemma 3.
Videos (several frames per grid) are not preprocessed here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np

from fx_engine.core.config import ConfigError
from fx_engine.loading.images import ImageError, PixelRules, _pil, _rgb_array, normalized_pixels, read_pixel_rules

#: the image processors whose rules these are
PROCESSOR_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
#: transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: smart_resize's limit on the aspect ratio
MAX_ASPECT = 200


@attrs.frozen
class Qwen2VLProcessorConfig(PixelRules):
    """preprocessor_config.json's rules (defaults: Qwen2VLImageProcessor's; the resize,
    rescale and normalize fields: loading/images.PixelRules)."""

    resample: int = 3
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def _positive(d: dict[str, Any], key: str, default: int, source: str) -> int:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{source}: field '{key}' must be a positive integer, got {v!r}")
    return v


def processor_config_from_dict(d: dict[str, Any], source: str = "preprocessor_config.json") -> Qwen2VLProcessorConfig:
    """The rules of a Qwen2-VL preprocessor_config.json dict; ConfigError naming the field
    for what is malformed or not implemented. min_pixels / max_pixels: the top-level fields
    win over size.shortest_edge / size.longest_edge (as the processor's __init__ does), and
    older configs' size.min_pixels / size.max_pixels are read too."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    kind = d.get("image_processor_type")
    if kind is not None and kind not in PROCESSOR_TYPES:
        raise ConfigError(f"{source}: image_processor_type {kind!r} is not supported ({', '.join(PROCESSOR_TYPES)})")
    size = d.get("size") or {}
    if not isinstance(size, dict):
        raise ConfigError(f"{source}: field 'size' must be an object, got {size!r}")
    lo = {"min_pixels": d.get("min_pixels"), "size.shortest_edge": size.get("shortest_edge"),
          "size.min_pixels": size.get("min_pixels")}
    hi = {"max_pixels": d.get("max_pixels"), "size.longest_edge": size.get("longest_edge"),
          "size.max_pixels": size.get("max_pixels")}
    picked = {}
    for name, options, default in (("min_pixels", lo, 56 * 56), ("max_pixels", hi, 28 * 28 * 1280)):
        key, value = next(((k, v) for k, v in options.items() if v is not None), (name, default))
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{source}: field '{key}' must be a positive integer, got {value!r}")
        picked[name] = value
    if picked["min_pixels"] > picked["max_pixels"]:
        raise ConfigError(f"{source}: min_pixels ({picked['min_pixels']}) is larger than max_pixels "
                          f"({picked['max_pixels']})")
    rules = read_pixel_rules(d, source, Qwen2VLProcessorConfig())
    if not rules["do_resize"]:
        raise ConfigError(f"{source}: field 'do_resize' = false is not supported (images would have to come in "
                          "multiples of patch_size * merge_size already)")
    return Qwen2VLProcessorConfig(
        min_pixels=picked["min_pixels"], max_pixels=picked["max_pixels"],
        patch_size=_positive(d, "patch_size", 14, source),
        temporal_patch_size=_positive(d, "temporal_patch_size", 2, source),
        merge_size=_positive(d, "merge_size", 2, source), **rules)


def check_matches(proc: Qwen2VLProcessorConfig, tower: Any, source: str = "preprocessor_config.json") -> None:
    """ConfigError where the processor's patch geometry is not the tower's
    (fx_engine.core.vision.qwen2_vl.Qwen2VLConfig)."""
    for ours, theirs in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                         ("merge_size", "spatial_merge_size")):
        a, b = getattr(proc, ours), getattr(tower, theirs)
        if a != b:
            raise ConfigError(f"{source}: field '{ours}' ({a}) is not the vision tower's {theirs} ({b})")


def read_processor_config(folder: str | Path) -> Qwen2VLProcessorConfig:
    """A model folder's preprocessor_config.json rules."""
    from fx_engine.loading.weights import read_json_object

    d, path = read_json_object(folder, "preprocessor_config.json", "the image preprocessing rules")
    return processor_config_from_dict(d, str(path))


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """transformers' qwen2_vl smart_resize: (h, w) multiples of `factor`, h * w within
    [min_pixels, max_pixels] where it can be, the aspect ratio kept as far as it can be."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"absolute aspect ratio must be smaller than {MAX_ASPECT}, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(image: np.ndarray, cfg: Qwen2VLProcessorConfig) -> tuple[np.ndarray, int, int]:
    """[C, H, W] float32 -> ([gh * gw, C * T * P * P] in merge-block order, gh, gw)."""
    c, hh, ww = image.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = hh // p, ww // p
    x = image.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # gh gw mh mw C ph pw
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p), dtype=np.float32), gh, gw


def preprocess_one(image: Any, cfg: Qwen2VLProcessorConfig, what: str = "image") -> tuple[np.ndarray, tuple]:
    """One image -> (patches [gh * gw, C*T*P*P] float32, grid (1, gh, gw))."""
    arr = _rgb_array(image, what, cfg.do_convert_rgb)
    h, w = arr.shape[:2]
    try:
        th, tw = smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    except ImageError as e:
        raise ImageError(f"{what}: {w}x{h} pixels: {e}") from None
    if (th, tw) != (h, w):
        arr = np.array(_pil().Image.fromarray(arr).resize((tw, th), resample=cfg.resample))
    patches, gh, gw = patchify(normalized_pixels(arr, cfg), cfg)
    return patches, (1, gh, gw)


def preprocess(images: Any | Sequence[Any], cfg: Qwen2VLProcessorConfig) -> tuple[np.ndarray, np.ndarray]:
    """Images (one, or a list / tuple: PIL images, encoded bytes, file paths, uint8 arrays)
    -> (patches [sum of gh*gw, C*T*P*P] float32, grid_thw [n, 3] int64), the
    processor's pixel_values and image_grid_thw. ImageError naming the image by index."""
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if not images:
        raise ImageError("no images given")
    done = [preprocess_one(im, cfg, f"image {i}") for i, im in enumerate(images)]
    return np.concatenate([p for p, _ in done]), np.array([g for _, g in done], dtype=np.int64)


def image_tokens(grid_thw: np.ndarray, merge_size: int) -> list[int]:
    """Image tokens (<|image_pad|> repeats) of each image: t * h * w / merge_size^2."""
    return [int(t * h * w) // merge_size ** 2 for t, h, w in np.asarray(grid_thw).tolist()]


def folder_processor_config(folder: str | Path, tower: Any) -> Qwen2VLProcessorConfig:
    """The rules `fx_engine.load` puts on `Model.image_processor` for a Qwen2(.5)-VL folder:
    its preprocessor_config.json's (checked against the tower's patch geometry), or the
    processor's defaults at the tower's geometry when the folder has none."""
    path = Path(folder) / "preprocessor_config.json"
    if not path.exists():
        return Qwen2VLProcessorConfig(patch_size=tower.patch_size, temporal_patch_size=tower.temporal_patch_size,
                                      merge_size=tower.spatial_merge_size)
    cfg = read_processor_config(folder)
    check_matches(cfg, tower, str(path))
    return cfg
