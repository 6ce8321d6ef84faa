"""Idefics3 / SmolVLM's image path (config.json model_type `idefics3`, `smolvlm`; SmolVLM2
folders are the same layout): the SigLIP tower (siglip.py), the connector, and where the
image rows go in the Llama text model's input.

Tower (Hugging Face's Idefics3VisionTransformer; mlx-vlm's idefics3 `VisionModel`): SigLIP
as siglip.py runs it, on tiles of image_size x image_size. Its position embedding is looked
up by position ids bucketized from fractional patch coordinates (made for padded, variable
patch grids); for the full tiles the processor always gives it, the ids are
`bucketized_positions(n)` per axis, which is the identity for most n but not all (n = 25,
29, 31, ...: float32 rounding of i * (1 / n) against torch.arange's boundaries). The
tower's position table is re-indexed by them at load, so the forward adds it as it is.
(mlx-vlm 0.7.10 computes the boundaries with float32 accumulation and gets other ids for
other n, e.g. 6, 7, 27 is fine, 10 is not; and its vision MLP uses the exact GELU where
Hugging Face's config says gelu_pytorch_tanh; tests set the oracle's to tanh.)

Connector (Idefics3Connector): pixel shuffle by `scale_factor` s (the [P, P] patch grid's
s x s blocks folded into the channels: [N, P * P, Dv] -> [N, P * P / s^2, Dv * s^2], in
Hugging Face's order), then `modality_projection.proj` [Dv * s^2 -> text hidden], no bias.
Result: [N, tokens_per_tile, text_hidden] per tile.

Prompt (Idefics3Processor / SmolVLMProcessor): each `<image>` placeholder of the rendered
text becomes, for an image split into rows x cols tiles,
"<fake_token_around_image><row_1_col_1>" + "<image>" * n ... per tile, "\\n" after each
row of tiles, then "\\n<fake_token_around_image><global-img>" + "<image>" * n +
"<fake_token_around_image>" (the global image); an image that is not split (rows = cols =
0) is the last part alone, without the leading "\\n". n = tokens_per_tile. The tiles'
rows take the image token positions in order (tiles row-major, the global image last):
`prompt_segments` gives the layout, the shell tokenizes it. The text model is causal
throughout (no image-token attention rule): `ImageInput.bidirectional` is moot.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import mlx.core as mx
import numpy as np
from jaxtyping import Float

from fx_engine.core.checkpoint import LoadOptions, Reader, TensorSource, TensorSpec
from fx_engine.core.config import POSITIVE, ConfigError, Field, read_field
from fx_engine.core.nn import Linear, linear
from fx_engine.core.tree import CompiledFunction, static_field
from fx_engine.core.vision import siglip
from fx_engine.core.vision.siglip import tensor_prefix as _prefix

MODEL_TYPES = ("idefics3", "smolvlm")
#: Hugging Face's names, then mlx-vlm's conversions (mlx-community)
TOWER_PREFIXES = ("model.vision_model.", "vision_model.")
CONNECTOR_PREFIXES = ("model.connector.", "connector.")
PROJ = "modality_projection.proj"
#: Hugging Face's Idefics3VisionConfig / SmolVLMVisionConfig defaults (the same)
VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
                   "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32,
                   "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}
#: the processor's strings
PLACEHOLDER = "<image>"
FAKE_TEXT, GLOBAL_TEXT = "<fake_token_around_image>", "<global-img>"


@attrs.frozen
class Idefics3VisionConfig:
    """What the image path reads from config.json."""

    vision: siglip.SiglipConfig
    text_hidden_size: int
    scale_factor: int = 2
    image_token_index: int = 49153  # <image>
    model_type: str = "idefics3"

    @property
    def image_size(self) -> int:
        """A tile's side in pixels (the tower's image_size)."""
        return self.vision.image_size

    @property
    def tokens_per_tile(self) -> int:
        return self.vision.num_patches // self.scale_factor ** 2

    @property
    def placeholder(self) -> str:
        return PLACEHOLDER


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Idefics3VisionConfig:
    """The image path's config of an Idefics3 / SmolVLM config.json dict; ConfigError
    naming the field for what is missing or malformed."""
    mt = d.get("model_type")
    if mt not in MODEL_TYPES:
        raise ConfigError(f"{source}: model_type {mt!r} is not Idefics3's ({', '.join(MODEL_TYPES)})")
    text, vision = d.get("text_config"), d.get("vision_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: field 'text_config' is missing or not an object")
    if not isinstance(vision, dict):
        raise ConfigError(f"{source}: field 'vision_config' is missing or not an object")
    # (SmolVLM folders leave some tower sizes to Idefics3VisionConfig's defaults)
    tower = siglip.config_from_hf({**VISION_DEFAULTS, **vision}, f"{source}: vision_config")
    if tower.num_channels != 3:
        raise ConfigError(f"{source}: vision_config.num_channels = {tower.num_channels} is not supported (3)")
    hidden = read_field(text, Field("hidden_size"), f"{source}: text_config")
    s = d.get("scale_factor", 2)
    s = POSITIVE(2 if s is None else s, "scale_factor", source)
    if tower.patches_per_side % s:
        raise ConfigError(f"{source}: {tower.patches_per_side} patches a side do not pixel-shuffle by "
                          f"scale_factor {s}")
    found = {k: d[k] for k in ("image_token_id", "image_token_index") if d.get(k) is not None}
    for k, v in found.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{source}: field '{k}' must be a token id (an integer >= 0), got {v!r}")
    if len(set(found.values())) > 1:
        raise ConfigError(f"{source}: fields 'image_token_id' and 'image_token_index' disagree ({found})")
    return Idefics3VisionConfig(vision=tower, text_hidden_size=hidden, scale_factor=s,
                                image_token_index=next(iter(found.values()), 49153), model_type=mt)


@attrs.frozen
class Idefics3VisionParams:
    tower: siglip.SiglipParams  # position table already re-indexed (`bucketized_positions`)
    projection: Linear  # [Dv * s^2 -> text hidden], no bias
    config: Idefics3VisionConfig = static_field()


def is_vision_tensor(name: str) -> bool:
    return name.startswith(TOWER_PREFIXES + CONNECTOR_PREFIXES)


def bucketized_positions(n: int) -> np.ndarray:
    """The position ids [n * n] Hugging Face's Idefics3VisionEmbeddings gives a full n x n
    patch grid: per axis bucketize(clamp(float32(i) * float32(1 / n), max=1 - 1e-6),
    arange(1 / n, 1, 1 / n), right=True), torch's arange in double then float32."""
    step = 1.0 / n
    count = len(np.arange(step, 1.0, step))
    bounds = np.array([step + k * step for k in range(count)], np.float64).astype(np.float32)
    frac = np.minimum(np.arange(n, dtype=np.float32) * np.float32(step), np.float32(1 - 1e-6))
    axis = (bounds[None, :] <= frac[:, None]).sum(axis=1)
    return (axis[:, None] * n + axis[None, :]).reshape(-1)


def assemble(cfg: Idefics3VisionConfig, src: TensorSource, opts: LoadOptions) -> Idefics3VisionParams:
    tower = siglip.assemble(cfg.vision, src, opts,
                            _prefix(src, TOWER_PREFIXES, "embeddings.patch_embedding.weight", "vision tower",
                                    opts.where))
    ids = bucketized_positions(cfg.vision.patches_per_side)
    if not np.array_equal(ids, np.arange(ids.size)):
        tower = attrs.evolve(tower, position=mx.contiguous(tower.position[mx.array(ids)]))
    pre = _prefix(src, CONNECTOR_PREFIXES, PROJ + ".weight", "connector", opts.where)
    dv, s = cfg.vision.hidden_size, cfg.scale_factor
    proj = Reader(src, opts).linear(pre + PROJ, cfg.text_hidden_size, dv * s * s)
    return Idefics3VisionParams(tower=tower, projection=proj, config=cfg)


def checkpoint_layout(cfg: Idefics3VisionConfig) -> dict[str, TensorSpec]:
    """The image path's tensors under Hugging Face's names (tiny test models)."""
    dv, s = cfg.vision.hidden_size, cfg.scale_factor
    out = siglip.checkpoint_layout(cfg.vision, TOWER_PREFIXES[0])
    out[CONNECTOR_PREFIXES[0] + PROJ + ".weight"] = TensorSpec((cfg.text_hidden_size, dv * s * s), scale=0.1)
    return out


def pixel_shuffle(x: Float[mx.array, "N P D"], s: int) -> Float[mx.array, "N M E"]:
    """Idefics3Connector.pixel_shuffle: [N, P * P, D] -> [N, P * P / s^2, D * s^2]."""
    n, seq, d = x.shape
    side = int(round(seq ** 0.5))
    x = x.reshape(n, side, side // s, d * s).transpose(0, 2, 1, 3)
    x = x.reshape(n, side // s, side // s, d * s * s).transpose(0, 2, 1, 3)
    return x.reshape(n, seq // (s * s), d * s * s)


def encode_images(p: Idefics3VisionParams, pixels: Float[mx.array, "N C S S"]) -> Float[mx.array, "N M H"]:
    """Tiles [N, 3, S, S] (preprocessed, S = image_size) -> their rows [N, tokens_per_tile,
    text_hidden], in the params' dtype."""
    feats = siglip.forward(p.tower, pixels)
    return linear(pixel_shuffle(feats, p.config.scale_factor), p.projection, p.tower.numerics)


encode_images_compiled = CompiledFunction(encode_images, name="encode_images_idefics3")


def prompt_segments(cfg: Idefics3VisionConfig, rows: int, cols: int) -> list[str | int]:
    """One image's expansion (the module docstring's): text pieces (str) and runs of image
    tokens (int: how many), in order."""
    n = cfg.tokens_per_tile
    out: list[str | int] = []
    if rows or cols:
        for r in range(rows):
            for c in range(cols):
                out += [f"{FAKE_TEXT}<row_{r + 1}_col_{c + 1}>", n]
            out.append("\n")
        out.append("\n")
    out += [f"{FAKE_TEXT}{GLOBAL_TEXT}", n, FAKE_TEXT]
    merged: list[str | int] = []
    for x in out:  # adjacent text pieces joined
        if merged and isinstance(x, str) and isinstance(merged[-1], str):
            merged[-1] += x
        else:
            merged.append(x)
    return merged


def image_token_runs(tokens: Sequence[int] | np.ndarray, cfg: Idefics3VisionConfig,
                     tiles: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The [start, end) spans of the image-token runs of a token sequence, checked: each is
    tokens_per_tile long and (given each image's tile count) there are sum(tiles) of them.
    ValueError otherwise."""
    t = np.asarray(tokens).reshape(-1)
    edges = np.diff(np.concatenate([[0], (t == cfg.image_token_index).astype(np.int8), [0]]))
    spans = list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))
    for a, b in spans:
        if b - a != cfg.tokens_per_tile:
            raise ValueError(f"image tokens at positions {a}..{b - 1}: {b - a} of them, expected "
                             f"{cfg.tokens_per_tile} per tile")
    if tiles is not None and len(spans) != sum(tiles):
        raise ValueError(f"the prompt has {len(spans)} tile(s) worth of image tokens, but the images have "
                         f"{sum(tiles)} tile(s)")
    return spans
