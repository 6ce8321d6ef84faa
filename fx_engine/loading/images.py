"""Pixel preprocessing (issue 46), from a checkpoint's preprocessor_config.json: Gemma 3's
(below) and Idefics3 / SmolVLM's tiling (`idefics3_tiles`, at the end of this module;
`read_processor_config` picks by image_processor_type). The fields every family's rules
share (resize filter, rescale, normalize, RGB) are `PixelRules`, read by `read_pixel_rules`
and applied by `normalized_pixels` (Qwen2-VL's rules: loading/images_qwen2_vl.py).

What Hugging Face's Gemma3ImageProcessor does with pan-and-scan off, step for step as its
PIL backend (transformers' `Gemma3ImageProcessorPil`, the one used without torch, and so
the one mlx-vlm uses here) computes it:

1. to RGB (`do_convert_rgb`, on unless false): a PIL image or array with alpha is composited
   onto white, grayscale repeated to three channels. Encoded image bytes and files are
   first opened as transformers' and mlx-vlm's `load_image` do: EXIF orientation applied,
   then PIL's convert("RGB") (alpha dropped, not composited).
2. resize to size.height x size.width with PIL's filter `resample` (2: bilinear), on the
   8-bit image (`do_resize`); without resizing, the image must already be that size.
3. rescale: float64(x) * rescale_factor, then float32 (`do_rescale`).
4. normalize: (x - image_mean) / image_std per channel, in float32 (`do_normalize`).
5. channels first: one [3, H, W] float32 array per image; a batch is [N, 3, H, W], the
   layout fx_engine/core/vision/siglip.py reads.

Transformers' default Gemma3ImageProcessorFast (torchvision) resizes float tensors with
its own antialiasing and so differs in the last bits of some pixels; pan-and-scan (extra
crops of a wide or tall image, each its own image) is not implemented: a config that turns
it on is refused. Pillow is needed here (a lazy import: the rest of fx-engine does not).
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np

from fx_engine.core.config import ConfigError

#: the Gemma 3 image processors whose rules these are
PROCESSOR_TYPES = ("Gemma3ImageProcessor", "Gemma3ImageProcessorFast", "Gemma3ImageProcessorPil")
#: PIL's resampling filters by their codes (PIL.Image.Resampling)
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


class ImageError(ValueError):
    """An image that cannot be read or preprocessed; the message says which and why."""


@attrs.frozen
class PixelRules:
    """What every image processor here shares (preprocessor_config.json's fields of these
    names): RGB conversion, the PIL resize filter, rescale and normalize. Each family's
    config subclasses it with its own fields and defaults; `read_pixel_rules` reads them."""

    resample: int = 2
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True


@attrs.frozen
class ImageProcessorConfig(PixelRules):
    """preprocessor_config.json's rules (defaults: Gemma3ImageProcessor's)."""

    height: int = 224
    width: int = 224
    image_seq_length: int | None = None  # the processor's image tokens per image (informative)
    # Gemma 3's pan-and-scan (off unless the folder turns it on): a wide or tall image also
    # goes in as 2..pan_max_crops crops (`pan_and_scan_crops`), each an image of its own
    pan_and_scan: bool = False
    pan_min_crop_size: int = 256
    pan_max_crops: int = 4
    pan_min_ratio: float = 1.2


def _flag(d: dict[str, Any], key: str, default: bool, source: str) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{source}: field '{key}' must be true, false or null, got {v!r}")
    return v


def _channels(d: dict[str, Any], key: str, source: str, positive: bool = False,
              default: tuple[float, float, float] = (0.5, 0.5, 0.5)) -> tuple[float, float, float]:
    v = d.get(key)
    if v is None:
        return default
    vals = [v] * 3 if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    if (not isinstance(vals, list) or len(vals) != 3
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals)):
        raise ConfigError(f"{source}: field '{key}' must be a number or a list of 3 numbers, got {v!r}")
    if positive and not all(x > 0 for x in vals):
        raise ConfigError(f"{source}: field '{key}' must be > 0, got {v!r}")
    return tuple(float(x) for x in vals)  # type: ignore[return-value]


def read_pixel_rules(d: dict[str, Any], source: str, defaults: PixelRules) -> dict[str, Any]:
    """`PixelRules`' fields of a preprocessor_config.json dict (a missing or null field:
    `defaults`' value), checked: ConfigError naming the field. Returns them as keywords
    for the family's config (a `PixelRules` subclass)."""
    resample = d.get("resample")
    resample = defaults.resample if resample is None else resample
    if isinstance(resample, bool) or resample not in RESAMPLE:
        raise ConfigError(f"{source}: field 'resample' must be a PIL filter code "
                          f"({', '.join(f'{k}: {v}' for k, v in RESAMPLE.items())}), got {resample!r}")
    factor = d.get("rescale_factor")
    factor = defaults.rescale_factor if factor is None else factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ConfigError(f"{source}: field 'rescale_factor' must be a positive number, got {factor!r}")
    return {"resample": resample, "rescale_factor": float(factor),
            "image_mean": _channels(d, "image_mean", source, default=defaults.image_mean),
            "image_std": _channels(d, "image_std", source, positive=True, default=defaults.image_std),
            **{k: _flag(d, k, getattr(defaults, k), source)
               for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")}}


def normalized_pixels(arr: np.ndarray, cfg: PixelRules) -> np.ndarray:
    """An 8-bit [H, W, C] image rescaled (float64 times rescale_factor, then float32) and
    normalized ((x - mean) / std in float32) as `cfg` says: [C, H, W] float32."""
    x = (arr.astype(np.float64) * cfg.rescale_factor).astype(np.float32) if cfg.do_rescale else arr
    if cfg.do_normalize:
        x = x.astype(np.float32) if not np.issubdtype(x.dtype, np.floating) else x
        x = (x - np.array(cfg.image_mean, x.dtype)) / np.array(cfg.image_std, x.dtype)
    return np.ascontiguousarray(np.asarray(x, np.float32).transpose(2, 0, 1))


def processor_config_from_dict(d: dict[str, Any], source: str = "preprocessor_config.json",
                               image_size: int | None = None) -> ImageProcessorConfig:
    """The rules of a preprocessor_config.json dict; ConfigError naming the field for what
    is malformed or not implemented. image_size: the vision tower's (the resize target
    must be image_size x image_size)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    kind = d.get("image_processor_type")
    if kind is not None and kind not in PROCESSOR_TYPES:
        raise ConfigError(f"{source}: image_processor_type {kind!r} is not supported ({', '.join(PROCESSOR_TYPES)})")
    pan = {}
    for key, field, kind, default in (("pan_and_scan_min_crop_size", "pan_min_crop_size", int, 256),
                                      ("pan_and_scan_max_num_crops", "pan_max_crops", int, 4),
                                      ("pan_and_scan_min_ratio_to_activate", "pan_min_ratio", float, 1.2)):
        v = d.get(key)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or (kind is int and v != int(v)):
            raise ConfigError(f"{source}: field {key!r} must be a positive {'integer' if kind is int else 'number'}, "
                              f"got {v!r}")
        pan[field] = kind(v)
    for key in ("do_center_crop", "do_pad"):
        if d.get(key):
            raise ConfigError(f"{source}: field '{key}' = true is not supported (not part of Gemma 3's processing)")
    size = d.get("size", {"height": 224, "width": 224})
    if not (isinstance(size, dict) and set(size) == {"height", "width"}
            and all(isinstance(size[k], int) and not isinstance(size[k], bool) and size[k] > 0 for k in size)):
        raise ConfigError(f"{source}: field 'size' must be {{\"height\": H, \"width\": W}} with positive integers, "
                          f"got {size!r}")
    seq = d.get("image_seq_length")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0):
        raise ConfigError(f"{source}: field 'image_seq_length' must be a positive integer, got {seq!r}")
    cfg = ImageProcessorConfig(
        height=size["height"], width=size["width"], **read_pixel_rules(d, source, ImageProcessorConfig()),
        image_seq_length=seq, pan_and_scan=_flag(d, "do_pan_and_scan", False, source), **pan)
    if image_size is not None and (cfg.height, cfg.width) != (image_size, image_size):
        raise ConfigError(f"{source}: size {cfg.height}x{cfg.width} is not the vision tower's image_size "
                          f"{image_size}x{image_size}")
    return cfg


def read_processor_config(folder: str | Path, image_size: int | None = None) -> Any:
    """A model folder's preprocessor_config.json rules (`processor_config_from_dict`; an
    Idefics3 / SmolVLM image processor's: `idefics3_config_from_dict`)."""
    from fx_engine.loading.weights import read_json_object

    d, path = read_json_object(folder, "preprocessor_config.json", "the image preprocessing rules")
    if d.get("image_processor_type") in IDEFICS3_PROCESSOR_TYPES:
        return idefics3_config_from_dict(d, str(path), image_size)
    return processor_config_from_dict(d, str(path), image_size)


def _pil() -> Any:
    try:
        import PIL.Image
        import PIL.ImageOps
    except ImportError as e:  # pragma: no cover (the test extra installs it)
        raise ImportError("images need Pillow: pip install pillow") from e
    return PIL


def _opened(data: bytes | Path, what: str) -> Any:
    """An encoded image (bytes or a file) opened as load_image does (EXIF orientation, RGB)."""
    PIL = _pil()
    try:
        image = PIL.Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        image.load()
        image = PIL.ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError) as e:  # PIL.UnidentifiedImageError is an OSError
        raise ImageError(f"{what}: not a readable image ({e})") from e
    return image.convert("RGB")


def _rgb_array(image: Any, what: str, convert: bool) -> np.ndarray:
    """[H, W, 3] uint8 RGB of one image (the conversion rules of the module docstring)."""
    PIL = _pil()
    if isinstance(image, str):
        raise ImageError(f"{what}: a str is not an image (pass a pathlib.Path for a file, or the encoded bytes)")
    if isinstance(image, (bytes, bytearray, memoryview)):
        image = _opened(bytes(image), what)
    elif isinstance(image, os.PathLike):
        if not Path(image).is_file():
            raise ImageError(f"{what}: no such file: {image}")
        image = _opened(Path(image), what)
    if isinstance(image, PIL.Image.Image):
        if convert:
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                rgba = image.convert("RGBA")
                white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                image = PIL.Image.alpha_composite(white, rgba).convert("RGB")
            else:
                image = image.convert("RGB")
        arr = np.array(image)
    elif isinstance(image, np.ndarray):
        arr = image
        if arr.dtype != np.uint8:
            raise ImageError(f"{what}: a numpy image must be uint8 (0-255), got {arr.dtype}")
        if arr.ndim == 2:
            arr = arr[..., None]
        if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4):
            raise ImageError(f"{what}: a numpy image must be [H, W], [H, W, 1], [H, W, 3] or [H, W, 4] "
                             f"(channels last), got shape {list(image.shape)}")
        if convert and arr.shape[-1] == 1:
            arr = np.repeat(arr, 3, axis=-1)
        elif convert and arr.shape[-1] == 4:  # onto white, as transformers' convert_to_rgb
            alpha = arr[..., 3:4] / 255
            arr = np.round(alpha * arr[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    else:
        raise ImageError(f"{what}: unsupported image type {type(image).__name__} (a PIL image, encoded image "
                         "bytes, a file path, or a uint8 numpy array)")
    if arr.ndim != 3 or arr.shape[-1] != 3:
        raise ImageError(f"{what}: expected an RGB image, got shape {list(arr.shape)} (do_convert_rgb is off)")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ImageError(f"{what}: the image is empty ({arr.shape[1]}x{arr.shape[0]})")
    return arr


def preprocess_one(image: Any, cfg: ImageProcessorConfig, what: str = "image") -> np.ndarray:
    """One image -> [3, height, width] float32 pixels (the module docstring's steps)."""
    return _pixels(_rgb_array(image, what, cfg.do_convert_rgb), cfg, what)


def pan_and_scan_crops(arr: np.ndarray, cfg: ImageProcessorConfig) -> list[np.ndarray]:
    """Gemma 3's pan-and-scan (Gemma3ImageProcessor's rule) of an RGB image [H, W, 3]: none
    unless its long side is at least `pan_min_ratio` times the short one; else n crops
    side by side along the long side, n the aspect ratio rounded half up, at most the long
    side // pan_min_crop_size, clamped to [2, pan_max_crops], each ceil(side / n) long
    (the last one what is left); none if a crop would be under pan_min_crop_size."""
    h, w = arr.shape[:2]
    long_, short = (w, h) if w >= h else (h, w)
    if long_ / short < cfg.pan_min_ratio:
        return []
    n = min(int(math.floor(long_ / short + 0.5)), long_ // cfg.pan_min_crop_size)
    n = min(cfg.pan_max_crops, max(2, n))
    size = int(math.ceil(long_ / n))
    if min(size, short) < cfg.pan_min_crop_size:
        return []
    if w >= h:
        return [arr[:, i * size:(i + 1) * size] for i in range(n)]
    return [arr[i * size:(i + 1) * size] for i in range(n)]


def preprocess_crops(image: Any, cfg: ImageProcessorConfig, what: str = "image") -> np.ndarray:
    """One image -> [1 + crops, 3, height, width]: the image, then its pan-and-scan crops
    (none unless `cfg.pan_and_scan`), each preprocessed as an image of its own."""
    arr = _rgb_array(image, what, cfg.do_convert_rgb)
    crops = pan_and_scan_crops(arr, cfg) if cfg.pan_and_scan else []
    return np.stack([_pixels(a, cfg, what) for a in [arr, *crops]])


def _pixels(arr: np.ndarray, cfg: ImageProcessorConfig, what: str) -> np.ndarray:
    """An RGB uint8 image [H, W, 3] resized, rescaled, normalized: [3, height, width] float32."""
    PIL = _pil()
    if cfg.do_resize:
        if arr.shape[:2] != (cfg.height, cfg.width):
            arr = np.array(PIL.Image.fromarray(arr).resize((cfg.width, cfg.height), resample=cfg.resample))
    elif arr.shape[:2] != (cfg.height, cfg.width):
        raise ImageError(f"{what}: {arr.shape[1]}x{arr.shape[0]} pixels, but resizing is off and the model reads "
                         f"{cfg.width}x{cfg.height}")
    return normalized_pixels(arr, cfg)


def preprocess(images: Any | Sequence[Any], cfg: ImageProcessorConfig) -> np.ndarray:
    """Images (one, or a list / tuple of them: PIL images, encoded bytes, file paths, uint8
    arrays [H, W(, C)]) -> pixels [N, 3, height, width] float32, channels first. ImageError
    (naming the image by its index) for what cannot be read."""
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if not images:
        raise ImageError("no images given")
    return np.stack([preprocess_one(im, cfg, f"image {i}") for i, im in enumerate(images)])


# ---------------------------------------------------------------- Idefics3 / SmolVLM
# Idefics3ImageProcessor's rules (transformers' torch-free Idefics3ImageProcessorPil /
# SmolVLMImageProcessorPil, step for step; every resize is PIL's on the 8-bit image):
# 1. to RGB as above; 2. resize so the longest edge is size.longest_edge (the other edge
# int(edge * aspect), rounded up to even, at least 1; then scaled down below 4096);
# 3. with do_image_splitting: resize again to multiples of max_image_size.longest_edge (M)
# (the longer edge ceil'd to a multiple of M, the other int(longer / aspect) ceil'd to a
# multiple), cut into rows x cols tiles of M x M (row-major) when larger than M, plus the
# global image (the resized image resized to M x M); an image that is not larger is one
# tile, rows = cols = 0. Without splitting: the image resized to M x M, rows = cols = 0;
# 4. rescale and normalize as above, each tile [3, M, M] float32.
IDEFICS3_PROCESSOR_TYPES = ("Idefics3ImageProcessor", "Idefics3ImageProcessorPil", "Idefics3ImageProcessorFast",
                            "SmolVLMImageProcessor", "SmolVLMImageProcessorPil", "SmolVLMImageProcessorFast")
MAX_IMAGE_SIZE = 4096  # transformers' Idefics3 absolute maximum edge


@attrs.frozen
class Idefics3ProcessorConfig(PixelRules):
    """preprocessor_config.json's rules for Idefics3 / SmolVLM (defaults: the processor's)."""

    resample: int = 1  # LANCZOS
    longest_edge: int = 4 * 364  # size.longest_edge
    max_image_size: int = 364  # max_image_size.longest_edge: the tile side
    do_image_splitting: bool = True


def _edge(d: dict[str, Any], key: str, default: int, source: str) -> int:
    v = d.get(key)
    if v is None:
        return default
    if not (isinstance(v, dict) and isinstance(v.get("longest_edge"), int) and not isinstance(v["longest_edge"], bool)
            and v["longest_edge"] > 0):
        raise ConfigError(f"{source}: field '{key}' must be {{\"longest_edge\": N}} with a positive integer, got {v!r}")
    return v["longest_edge"]


def idefics3_config_from_dict(d: dict[str, Any], source: str = "preprocessor_config.json",
                              image_size: int | None = None) -> Idefics3ProcessorConfig:
    """The Idefics3 / SmolVLM rules of a preprocessor_config.json dict (image_size: the
    tower's, which must be the tile side)."""
    tile = _edge(d, "max_image_size", 364, source)
    cfg = Idefics3ProcessorConfig(
        longest_edge=_edge(d, "size", 4 * 364, source), max_image_size=tile,
        do_image_splitting=_flag(d, "do_image_splitting", True, source),
        **read_pixel_rules(d, source, Idefics3ProcessorConfig()))
    if image_size is not None and tile != image_size:
        raise ConfigError(f"{source}: max_image_size.longest_edge {tile} is not the vision tower's image_size "
                          f"{image_size} (each tile is one tower input)")
    return cfg


def _longest_edge_size(h: int, w: int, edge: int) -> tuple[int, int]:
    """Idefics3's get_resize_output_image_size: (height, width)."""
    aspect = w / h
    if w >= h:
        w, h = edge, int(edge / aspect)
        h += h % 2
    else:
        h, w = edge, int(edge * aspect)
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    aspect = w / h
    if w >= h and w > MAX_IMAGE_SIZE:
        w, h = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif h > w and h > MAX_IMAGE_SIZE:
        h, w = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(h, 1), max(w, 1)


def _resized(arr: np.ndarray, h: int, w: int, resample: int) -> np.ndarray:
    if arr.shape[:2] == (h, w):
        return arr
    return np.array(_pil().Image.fromarray(arr).resize((w, h), resample=resample))


def idefics3_tiles(image: Any, cfg: Idefics3ProcessorConfig, what: str = "image") -> tuple[np.ndarray, int, int]:
    """One image -> (tiles [T, 3, M, M] float32, rows, cols): rows x cols tiles row-major
    then the global image (T = rows * cols + 1), or one tile with rows = cols = 0."""
    arr = _rgb_array(image, what, cfg.do_convert_rgb)
    m = cfg.max_image_size
    if cfg.do_resize:
        arr = _resized(arr, *_longest_edge_size(*arr.shape[:2], cfg.longest_edge), cfg.resample)
    rows = cols = 0
    if cfg.do_image_splitting:
        h, w = arr.shape[:2]
        aspect = w / h
        if w >= h:
            w = math.ceil(w / m) * m
            h = math.ceil(int(w / aspect) / m) * m
        else:
            h = math.ceil(h / m) * m
            w = math.ceil(int(h * aspect) / m) * m
        arr = _resized(arr, h, w, cfg.resample)
        if h > m or w > m:
            rows, cols = (h - m) // m + 1, (w - m) // m + 1
            tiles = [arr[r * m:(r + 1) * m, c * m:(c + 1) * m] for r in range(rows) for c in range(cols)]
            tiles.append(_resized(arr, m, m, cfg.resample))
        else:
            tiles = [arr]
    else:
        tiles = [_resized(arr, m, m, cfg.resample)]
    for t in tiles:
        if t.shape[:2] != (m, m):
            raise ImageError(f"{what}: a {t.shape[1]}x{t.shape[0]} tile, but the model reads {m}x{m} (resizing off?)")
    return np.stack([normalized_pixels(np.ascontiguousarray(t), cfg) for t in tiles]), rows, cols
