"""Qwen3-VL's vision transformer and its DeepStack features, as one pure forward (issue 46:
model_type "qwen3_vl"; the dense text model is Qwen3's, core/models/llama.py).

Architecture (transformers 5.x modeling_qwen3_vl.Qwen3VLVisionModel; mlx-vlm 0.7.10's
mlx_vlm/models/qwen3_vl/vision.py `VisionModel`):

* input: the processor's flattened patches [N, C * T * P * P] in merge-window order and
  grid_thw [images, 3], exactly as Qwen2-VL's (fx_engine/loading/images_qwen2_vl.py makes
  them; Qwen3-VL's processor is Qwen2VLImageProcessor with patch_size 16, merge_size 2 and
  mean = std = 0.5 in its preprocessor_config.json).
* patch embedding: the Conv3d (kernel = stride = (T, P, P)) *with a bias*, one matmul.
* learned position embeddings: `pos_embed` [num_position_embeddings, hidden], a square
  grid of side g = sqrt(num_position_embeddings) (48 for 2304), resampled bilinearly with
  align_corners to each image's (h, w) patch grid (rows at linspace(0, g - 1, h), columns
  at linspace(0, g - 1, w); the four neighbours' rows weighted (1 - dh)(1 - dw), (1 - dh) dw,
  dh (1 - dw), dh dw, summed in that order), repeated over frames, in the patches' merge-
  window order; added to the patch embeddings.
* 2-D rotary embedding over (row, column), as Qwen2-VL's (`qwen2_vl._rope`).
* blocks: x + proj(attn(LayerNorm(x))), then x + fc2(gelu_tanh(fc1(LayerNorm(x)))); every
  linear with a bias, LayerNorm eps 1e-6; attention full within each frame of each image
  (no windows), bidirectional, scale head_dim^-0.5.
* merger: LayerNorm over hidden, then m * m consecutive rows concatenated, Linear -> GELU
  (exact) -> Linear to out_hidden_size.
* DeepStack: after block `deepstack_visual_indexes[j]`, its output goes through
  `deepstack_merger_list[j]`: the m * m rows concatenated *first*, then LayerNorm over
  m * m * hidden (use_postshuffle_norm), Linear -> GELU -> Linear to out_hidden_size;
  the features in the order of their layers (as both references append them).
  The text model adds feature j to the hidden states at the image positions after its
  decoder layer j (j < len(deepstack_visual_indexes)): `splice.ImageInput.deepstack`,
  read by the Llama family's layer loop (core/models/llama.py).

`encode_images(params, patches, grid_thw)` returns (rows [M, out], deepstack [L, M, out])
(L = len(deepstack_visual_indexes), M = sum(t*h*w) / m^2): the rows replace the image
tokens' embeddings as Qwen2-VL's do, the deepstack rows travel with them
(engine/image_prompt.py stores them on `ImagePrompt.deepstack`).

Tensor names (prefix `model.visual.` (transformers >= 4.57), `visual.`, or mlx-vlm's
`vision_tower.`): patch_embed.proj.{weight,bias}, pos_embed.weight,
blocks.{i}.norm{1,2}.{weight,bias}, blocks.{i}.attn.qkv.{weight,bias},
blocks.{i}.attn.proj.{weight,bias}, blocks.{i}.mlp.linear_fc{1,2}.{weight,bias},
merger.norm.{weight,bias}, merger.linear_fc{1,2}.{weight,bias},
deepstack_merger_list.{j}.norm / .linear_fc1 / .linear_fc2.

The text side is Qwen2(.5)-VL's (`qwen2_vl.image_token_runs`, `rope_positions`,
`rope_offsets`, re-exported here): the same placeholder and expansion (transformers'
Qwen3VLProcessor: <|image_pad|> * t*h*w / m^2 between <|vision_start|> and <|vision_end|>),
the same get_rope_index for images (mlx-vlm qwen3_vl/language.py; transformers'
Qwen3VLModel.get_rope_index), and the rope delta carried the same way (stored shifted, so
decode is plain RoPE). What differs: M-RoPE's frequency layout is *interleaved*
(the text config's `mrope_interleaved`, core/models/mrope.py: frequency j reads the height row
where j % 3 == 1 and j < 3 * section[1], the width row where j % 3 == 2 and
j < 3 * section[2], else the temporal row), and DeepStack. Videos (timestamped frames) are
not supported.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import mlx.core as mx
import numpy as np
from jaxtyping import Float

from fx_engine.core.checkpoint import Lin, LoadOptions, Norm, Reader, TensorSource, TensorSpec, read_tensors
from fx_engine.core.config import ConfigError, Field, read_fields
from fx_engine.core.nn import Linear, Numerics, embed, gelu, gelu_tanh, layer_norm, linear
from fx_engine.core.tree import CompiledFunction, static_field
from fx_engine.core.vision import qwen2_vl
from fx_engine.core.vision.qwen2_vl import (PLACEHOLDER, Qwen2VLLayer, Segments, _attention,  # noqa: F401
                                            _embed_patches, _frame_segments, _grids, _lin_specs, _patch_spec,
                                            _patch_weight, _positions, _rope, _segment_arrays, _spec,
                                            check_patches, image_token_runs, pad_patches, padded_tokens,
                                            rope_offsets, rope_positions)

#: multimodal config.json model_types this module reads
MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")  # (the MoE one: the same tower)
TOWER_PREFIXES = ("model.visual.", "visual.", "vision_tower.")
EPS = 1e-6


@attrs.frozen
class Qwen3VLConfig:
    """The vision tower's sizes and the image token ids of a Qwen3-VL config.json (the
    text-side attributes are Qwen2VLConfig's, so qwen2_vl's prompt functions read it)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    model_type: str = "qwen3_vl"
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def patch_features(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def grid_side(self) -> int:
        """The side of the learned position-embedding grid."""
        return int(self.num_position_embeddings ** 0.5)

    @property
    def placeholder(self) -> str:
        return PLACEHOLDER

    @property
    def image_token_index(self) -> int:
        return self.image_token_id

    def image_tokens(self, grid: Sequence[int]) -> int:
        t, h, w = (int(v) for v in grid)
        return t * h * w // self.merge_unit


_FIELDS = (
    Field("depth"), Field("hidden_size"), Field("intermediate_size"), Field("num_heads"),
    Field("out_hidden_size"), Field("patch_size", default=16), Field("temporal_patch_size", default=2),
    Field("spatial_merge_size", default=2), Field("in_channels", default=3),
    Field("num_position_embeddings", default=2304),
)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Qwen3VLConfig:
    """The tower's config from a Qwen3-VL config.json dict; ConfigError naming the field."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected an object, got {type(d).__name__}")
    if d.get("model_type") not in MODEL_TYPES:
        raise ConfigError(f"{source}: model_type {d.get('model_type')!r} is not Qwen3-VL's ({', '.join(MODEL_TYPES)})")
    vision = d.get("vision_config")
    if not isinstance(vision, dict):
        raise ConfigError(f"{source}: field 'vision_config' is missing or not an object (a text-only checkpoint "
                          "has no vision tower)")
    vsrc = f"{source}: vision_config"
    f = read_fields(qwen2_vl._vision_dict(vision), _FIELDS, vsrc)
    act = vision.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{vsrc}: field 'hidden_act' = {act!r} is not supported (Qwen3-VL: 'gelu_pytorch_tanh')")
    side = int(f["num_position_embeddings"] ** 0.5)
    if side * side != f["num_position_embeddings"]:
        raise ConfigError(f"{vsrc}: field 'num_position_embeddings' ({f['num_position_embeddings']}) must be a "
                          "square (the learned position grid)")
    deep = vision.get("deepstack_visual_indexes", [8, 16, 24])
    if (not isinstance(deep, (list, tuple)) or len(set(deep)) != len(deep) or
            not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < f["depth"] for i in deep)):
        raise ConfigError(f"{vsrc}: field 'deepstack_visual_indexes' must be distinct layer indexes in "
                          f"[0, depth = {f['depth']}), got {deep!r}")
    if f["hidden_size"] % f["num_heads"] or (f["hidden_size"] // f["num_heads"]) % 4:
        raise ConfigError(f"{vsrc}: the head size (hidden_size {f['hidden_size']} / num_heads {f['num_heads']}) "
                          "must be a whole multiple of 4 (the 2-D rotary embedding's halves)")
    text_hidden = qwen2_vl._text_hidden(d)
    if text_hidden is not None and text_hidden != f["out_hidden_size"]:
        raise ConfigError(f"{vsrc}: field 'out_hidden_size' ({f['out_hidden_size']}) differs from the text "
                          f"model's hidden_size ({text_hidden})")
    return Qwen3VLConfig(**f, deepstack_visual_indexes=tuple(deep), **qwen2_vl._token_ids(d, source))


# ---------------------------------------------------------------- params and checkpoint


@attrs.frozen
class Qwen3VLMerger:
    norm: tuple[mx.array, mx.array | None]  # LayerNorm over hidden (merger) or m*m*hidden (deepstack)
    fc1: Linear
    fc2: Linear


@attrs.frozen
class Qwen3VLParams:
    patch: Linear  # [C*T*P*P -> hidden] with a bias
    pos_embed: Linear  # the learned position table [num_position_embeddings, hidden]
    layers: tuple[Qwen2VLLayer, ...]  # (up / down: linear_fc1 / linear_fc2)
    merger: Qwen3VLMerger
    deepstack: tuple[Qwen3VLMerger, ...]
    config: Qwen3VLConfig = static_field()
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")


_LAYER = (Norm("norm1", "norm1"), Lin("qkv", "attn.qkv", "qkv_rows", "hidden_size", bias=True),
          Lin("proj", "attn.proj", "hidden_size", "hidden_size", bias=True), Norm("norm2", "norm2"),
          Lin("up", "mlp.linear_fc1", "intermediate_size", "hidden_size", bias=True),
          Lin("down", "mlp.linear_fc2", "hidden_size", "intermediate_size", bias=True))


def _merger_table(norm_size: str) -> tuple:
    return (Norm("norm", "norm", norm_size), Lin("fc1", "linear_fc1", "merged", "merged", bias=True),
            Lin("fc2", "linear_fc2", "out_hidden_size", "merged", bias=True))


def is_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the vision tower (its mergers included)."""
    return name.startswith(TOWER_PREFIXES)


def assemble(cfg: Qwen3VLConfig, src: TensorSource, opts: LoadOptions) -> Qwen3VLParams:
    """The tower's params from a checkpoint's tensors (any prefix of TOWER_PREFIXES)."""
    pre = qwen2_vl._prefix(src, opts.where, TOWER_PREFIXES)
    rd = Reader(src, opts)
    w = _patch_weight(cfg, src, pre + "patch_embed.proj.weight", opts.where)
    patch = rd.finish(Linear(weight=w, bias=rd.vec(pre + "patch_embed.proj.bias", cfg.hidden_size)))
    pos = rd.table(pre + "pos_embed", cfg.num_position_embeddings, cfg.hidden_size, lookup_only=True)
    merged = cfg.hidden_size * cfg.merge_unit
    sizes = {"qkv_rows": 3 * cfg.hidden_size, "merged": merged}
    layers = tuple(Qwen2VLLayer(**read_tensors(rd, _LAYER, cfg, pre + "blocks.{i}.", i=i, sizes=sizes))
                   for i in range(cfg.depth))
    merger = Qwen3VLMerger(**read_tensors(rd, _merger_table("hidden_size"), cfg, pre + "merger.", sizes=sizes))
    deep = tuple(Qwen3VLMerger(**read_tensors(rd, _merger_table("merged"), cfg,
                                              pre + "deepstack_merger_list.{i}.", i=j, sizes=sizes))
                 for j in range(len(cfg.deepstack_visual_indexes)))
    return Qwen3VLParams(patch=patch, pos_embed=pos, layers=layers, merger=merger, deepstack=deep, config=cfg,
                         numerics=opts.numerics, dtype=opts.dtype_name)


def checkpoint_layout(cfg: Qwen3VLConfig) -> dict[str, TensorSpec]:
    """The tower's tensors under transformers' names (`model.visual.`), for tiny test models."""
    h, f, o = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size
    m = h * cfg.merge_unit
    pre = TOWER_PREFIXES[0]

    def norm(name: str, n: int = h) -> dict[str, TensorSpec]:
        return {name + ".weight": _spec(n, center=1.0), name + ".bias": _spec(n, scale=0.05)}

    out = {pre + "patch_embed.proj.weight": _patch_spec(cfg),
           pre + "patch_embed.proj.bias": _spec(h, scale=0.05),
           pre + "pos_embed.weight": _spec(cfg.num_position_embeddings, h, scale=0.3)}
    for i in range(cfg.depth):
        b = f"{pre}blocks.{i}."
        out.update(norm(b + "norm1"))
        out.update(_lin_specs(b + "attn.qkv", 3 * h, h))
        out.update(_lin_specs(b + "attn.proj", h, h))
        out.update(norm(b + "norm2"))
        out.update(_lin_specs(b + "mlp.linear_fc1", f, h))
        out.update(_lin_specs(b + "mlp.linear_fc2", h, f))
    for base, n in ([(pre + "merger.", h)] +
                    [(f"{pre}deepstack_merger_list.{j}.", m) for j in range(len(cfg.deepstack_visual_indexes))]):
        out.update(norm(base + "norm", n))
        out.update(_lin_specs(base + "linear_fc1", m, m))
        out.update(_lin_specs(base + "linear_fc2", o, m))
    return out


# ---------------------------------------------------------------- geometry (numpy, from grid_thw)


@attrs.frozen
class Geometry:
    """What the forward needs from grid_thw, as array inputs (a compiled forward traces
    once per padded size): each patch's (row, column), the four position-table rows and
    weights of its interpolated position embedding, and the attention segments (one per
    frame of each image). Padded to `tokens` patches at the end (rows / columns 0, weights
    0; qwen2_vl.Segments' padding)."""

    rows_cols: mx.array  # [N, 2] float32
    pos_index: mx.array  # [4, N] int32
    pos_weight: mx.array  # [4, N] float32
    frames: Segments


def _interpolation(rows_cols: np.ndarray, heights: np.ndarray, widths: np.ndarray,
                   side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear (align_corners) taps of each patch into the side x side table."""
    def axis(i: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        step = np.where(n > 1, np.float32(side - 1) / np.maximum(n - 1, 1).astype(np.float32), np.float32(0))
        x = (i.astype(np.float32) * step.astype(np.float32)).astype(np.float32)
        lo = x.astype(np.int32)
        return lo, np.minimum(lo + 1, side - 1), (x - lo.astype(np.float32)).astype(np.float32)

    h0, h1, dh = axis(rows_cols[:, 0], heights)
    w0, w1, dw = axis(rows_cols[:, 1], widths)
    one = np.float32(1)
    index = np.stack([h0 * side + w0, h0 * side + w1, h1 * side + w0, h1 * side + w1]).astype(np.int32)
    weight = np.stack([(one - dh) * (one - dw), (one - dh) * dw, dh * (one - dw), dh * dw]).astype(np.float32)
    return index, weight


def geometry(grid_thw: Any, cfg: Qwen3VLConfig, tokens: int | None = None) -> Geometry:
    """The Geometry of `grid_thw`, padded to `tokens` patches (None: unpadded; else the
    frames' width is padded to a size bucket too)."""
    grids = _grids(grid_thw, cfg)
    pos = _positions(grids, cfg.spatial_merge_size)
    n = pos.shape[0]
    padded = tokens is not None
    tokens = n if tokens is None else tokens
    if tokens < n or tokens % cfg.merge_unit:
        raise ValueError(f"Qwen3-VL: cannot pad {n} patches to {tokens} (a multiple of {cfg.merge_unit} >= {n})")
    heights = np.concatenate([np.full(t * h * w, h) for t, h, w in grids])
    widths = np.concatenate([np.full(t * h * w, w) for t, h, w in grids])
    index, weight = _interpolation(pos, heights, widths, cfg.grid_side)
    pad = tokens - n
    return Geometry(rows_cols=mx.array(np.concatenate([pos, np.zeros((pad, 2), pos.dtype)]).astype(np.float32)),
                    pos_index=mx.array(np.pad(index, ((0, 0), (0, pad)))),
                    pos_weight=mx.array(np.pad(weight, ((0, 0), (0, pad)))),
                    frames=_frame_segments(grids, tokens, bucketed=padded))


# ---------------------------------------------------------------- forward


def _merge(x: mx.array, mp: Qwen3VLMerger, cfg: Qwen3VLConfig, num: Numerics, postshuffle: bool) -> mx.array:
    n = x.shape[0] // cfg.merge_unit
    width = cfg.merge_unit * cfg.hidden_size
    if postshuffle:  # (DeepStack's mergers: the m * m rows concatenated, then normed)
        x = layer_norm(x.reshape(n, width), *mp.norm, EPS)
    else:
        x = layer_norm(x, *mp.norm, EPS).reshape(n, width)
    return linear(gelu(linear(x, mp.fc1, num)), mp.fc2, num)


def forward(p: Qwen3VLParams, patches: Float[mx.array, "N F"], geo: Geometry) -> tuple[
        Float[mx.array, "M O"], Float[mx.array, "L M O"]]:
    """The tower on patches [N, C*T*P*P] (processor order, padded to the Geometry's size)
    with a Geometry: (rows [N / m^2, out], deepstack [L, N / m^2, out]) in the params'
    dtype (padding rows last)."""
    cfg, num = p.config, p.numerics
    dt = getattr(mx, p.dtype)
    x = _embed_patches(p, patches)
    taps = embed(geo.pos_index, p.pos_embed).astype(dt) * geo.pos_weight.astype(dt)[:, :, None]
    x = x + (taps[0] + taps[1] + taps[2] + taps[3])
    cos, sin = _rope(geo.rows_cols, cfg.head_dim)
    seg = _segment_arrays(geo.frames)
    deep = []
    for i, lp in enumerate(p.layers):
        x = x + _attention(layer_norm(x, *lp.norm1, EPS), lp, cfg, num, cos, sin, seg)
        x = x + linear(gelu_tanh(linear(layer_norm(x, *lp.norm2, EPS), lp.up, num)), lp.down, num)
        if i in cfg.deepstack_visual_indexes:
            # (features in layer order, each through the merger of its place in the list)
            deep.append(_merge(x, p.deepstack[cfg.deepstack_visual_indexes.index(i)], cfg, num, postshuffle=True))
    rows = _merge(x, p.merger, cfg, num, postshuffle=False)
    deepstack = mx.stack(deep) if deep else mx.zeros((0, *rows.shape), rows.dtype)
    return rows, deepstack


def encode_images(p: Qwen3VLParams, patches: Float[mx.array, "N F"], grid_thw: Any) -> tuple[
        Float[mx.array, "M O"], Float[mx.array, "L M O"]]:
    """Patches [N, C*T*P*P] of the images of `grid_thw` [images, 3] (as the processor
    returns them) -> (their token embeddings [M, out], their DeepStack features
    [L, M, out]), image after image (eager, unpadded)."""
    cfg = p.config
    check_patches(patches, _grids(grid_thw, cfg), cfg.patch_features, "Qwen3-VL")
    return forward(p, patches, geometry(grid_thw, cfg))


_compiled = CompiledFunction(forward, name="qwen3_vl_encode_images")


def encode_images_compiled(p: Qwen3VLParams, patches: mx.array, grid_thw: Any) -> tuple[mx.array, mx.array]:
    """`encode_images` compiled and bucketed by image size (qwen2_vl.encode_images_compiled's
    padding: one trace per padded size and frame count)."""
    cfg = p.config
    grids = _grids(grid_thw, cfg)
    n = check_patches(patches, grids, cfg.patch_features, "Qwen3-VL")
    tokens = padded_tokens(grids, cfg.merge_unit)
    rows, deep = _compiled(p, pad_patches(patches, tokens), geometry(grids, cfg, tokens))
    m = n // cfg.merge_unit
    return rows[:m], deep[:, :m]
