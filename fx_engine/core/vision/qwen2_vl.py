"""Qwen2.5-VL's (and Qwen2-VL's) vision transformer, as one pure forward (issue 46, first
half: the tower and its pixel preprocessing, fx_engine/loading/images_qwen2_vl.py).

Architecture (transformers' modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel;
mlx-vlm 0.7.10's mlx_vlm/models/qwen2_5_vl/vision.py `VisionModel`):

* input: the processor's flattened patches [N, C * T * P * P] (each patch in (channel,
  frame, row, column) order; T = temporal_patch_size frames, a still image duplicated),
  the patches of each image in *merge-window order* (for each m x m block of patches,
  m = spatial_merge_size, row-major over blocks, its m * m patches row-major), images one
  after another; and `grid_thw` [images, 3]: (frames / T, rows, columns) in patches.
* patch embedding: a Conv3d with kernel = stride = (T, P, P), no bias: one matmul
  [C*T*P*P -> hidden] (Hugging Face stores it [hidden, C, T, P, P]; mlx-vlm's converted
  checkpoints [hidden, T, P, P, C]; both are read).
* 2-D rotary embedding: head_dim / 2 rotary features, the first half from the patch's row,
  the second from its column (inv_freq = 1 / 10000^(2j / (head_dim / 2))), rotate-half
  style over the whole head (cos / sin of [row freqs | col freqs] repeated twice).
* window attention (2.5 only): the patches are regrouped by windows of
  w = window_size / spatial_merge_size / patch_size merged tokens a side (112 / 2 / 14 = 4:
  4 x 4 merged tokens = 8 x 8 patches = 112 x 112 pixels), windows row-major per frame, the last row / column
  of windows cut short where the grid is not a multiple of w; layers in
  `fullatt_block_indexes` attend over their whole frame instead (cu_seqlens: one segment
  per frame of each image), the others within their window only. Bidirectional, no bias
  in the scores, scale head_dim^-0.5.
* blocks (2.5): x + proj(attn(RMSNorm(x))), then x + down(silu(gate(y)) * up(y)), y =
  RMSNorm(x); every linear has a bias; RMSNorm eps 1e-6 (hard-coded in both).
  Qwen2-VL's blocks: LayerNorm (eps 1e-6, with bias) and an fc1 -> QuickGELU
  (x * sigmoid(1.702 x)) -> fc2 MLP of embed_dim * mlp_ratio; no windows (every layer full).
* merger: RMSNorm (Qwen2-VL: LayerNorm) eps 1e-6 over hidden, then m * m consecutive rows
  (one merge block: the processor's order guarantees they are a block) concatenated into
  one [m*m*hidden] row, Linear -> GELU (exact, erf) -> Linear to out_hidden_size (Qwen2-VL:
  vision_config.hidden_size). The window regrouping is undone after the merger.
* output: [N / m^2, out_hidden_size], one row per image token, in the processor's order
  (row-major over merge blocks, image after image).

Tensor names (prefix `visual.`; transformers >= 4.52 saves `model.visual.`; mlx-vlm's
converted folders `vision_tower.`): patch_embed.proj.weight, blocks.{i}.norm1.weight,
blocks.{i}.norm2.weight, blocks.{i}.attn.qkv.{weight,bias} [3 * hidden, hidden],
blocks.{i}.attn.proj.{weight,bias}, blocks.{i}.mlp.{gate_proj,up_proj,down_proj}.{weight,bias},
merger.ln_q.weight, merger.mlp.0.{weight,bias}, merger.mlp.2.{weight,bias}. Qwen2-VL: the
norms also have .bias and the MLP is blocks.{i}.mlp.{fc1,fc2}.{weight,bias}; merger.ln_q.bias.
Linears may be MLX affine-quantized (.scales / .biases); the patch conv is always dense.

Registered in VISION_MODULES (fx_engine/core/vision/__init__.py) with the text side below.
`encode_images(params, patches, grid_thw)` takes the grid as a third argument (Gemma 3's
takes pixels only): the shell passes what `fx_engine.loading.images_qwen2_vl.preprocess`
returns (engine/image_prompt.py encodes image by image).

The text side (how the engine does it: the end of this docstring)
-----------------------------------------------------------------
1. Prompt expansion (transformers' processing_qwen2_5_vl.Qwen2_5_VLProcessor.__call__;
   mlx-vlm uses the same processor): the chat template writes
   "<|vision_start|><|image_pad|><|vision_end|>" per image; the processor replaces each
   "<|image_pad|>" with "<|image_pad|>" * (t * h * w / merge^2) for that image's grid_thw
   (`Qwen2VLConfig.image_tokens` here), so each image is one run of `image_token_id`
   (151655) between vision_start_token_id (151652) and vision_end_token_id (151653);
   video: <|video_pad|> (151656). The encoder's rows replace those tokens' embeddings in
   order (mlx-vlm: qwen2_5_vl.py `Model.merge_input_ids_with_image_features`; Hugging
   Face: masked_scatter), no scaling. Qwen2.5-VL's text model attends causally over image
   tokens (no bidirectional image block as Gemma 3 has).
2. M-RoPE (the text model's rotary): position ids are 3-D (temporal, height, width) per
   token. The head_dim / 2 inverse frequencies (rope_theta, plain RoPE's) are split by
   rope_scaling.mrope_section ([16, 24, 24] for the 7B: sums to head_dim / 2); section i
   takes its angles from position row i (t, h, w), then the halves are duplicated for
   rotate-half (transformers 5.x: modeling_qwen2_5_vl.Qwen2_5_VLRotaryEmbedding.forward /
   recomposition_frequencies; mlx-vlm: mlx_vlm/models/rope_utils.py MRoPERotaryEmbedding
   and apply_multimodal_rotary_pos_emb(..., style="chunked"), called from
   qwen2_5_vl/language.py). Text tokens have t = h = w = their 1-D position, so a
   text-only prompt is exactly ordinary RoPE.
3. get_rope_index (mlx-vlm: mlx_vlm/models/qwen2_5_vl/language.py
   `LanguageModel.get_rope_index`; transformers 5.x: modeling_qwen2_5_vl.Qwen2_5_VLModel.
   get_rope_index + get_vision_position_ids): per row (padding dropped first), text runs
   get p, p+1, ... on all 3 rows; an image run (one per vision_start, grid (t, h, w), merged
   grid (t, h / m, w / m)) starting at position s gets t: s (+ frame * time interval for
   video), h: s + row, w: s + column, row-major over the merged grid; the text after it
   continues at s + max(h, w) / m (mlx-vlm: max position so far + 1; the same for images).
   So an image of 16 x 16 tokens advances the position by 16, not 256. The row's
   rope_delta = max position + 1 - len(tokens) (negative for images); in decode every new
   token's 3 ids are all cache_offset + rope_delta (language.py `__call__`, its `delta`
   branch), so a sequence must carry its delta (prefix cache, chunked prefill: a chunk's
   positions are a slice of the prompt's 3 x T table). Padded slots: mlx-vlm puts 1,
   transformers 0 (masked either way). Video time interval: transformers 5.x scales
   frames by tokens_per_second * second_per_grid_t; mlx-vlm 0.7.10 does not.
4. Config: top-level image_token_id / video_token_id / vision_start_token_id /
   vision_end_token_id (read into `Qwen2VLConfig`); text_config (transformers >= 4.52) or
   the top level (older config.json) holds the Qwen2 text model's fields incl.
   rope_scaling.mrope_section; vision_config.out_hidden_size (2.5) / hidden_size (2) must
   equal the text hidden_size (checked in `config_from_hf`).

How fx-engine carries the rope delta: it does not. Rotary attention scores depend only on
the differences of the query's and the key's ids (per frequency section), so every id of
a prompt may be shifted by one constant: the prompt's ids are stored *minus its
rope_delta* (`rope_offsets`: each token's three ids minus its cache position, zero for the
text after the last image), so decoded tokens (and a follow-up turn's text) are at their
cache positions on all three rows, which is plain RoPE: decode steps, speculation, batching
and row surgery need nothing new, and no per-row state is added to the cache. The offsets
travel with a prefill step's image rows (`splice.ImageInput.positions`; the Llama forward
then rotates with `models.mrope.mrope_tables`). The same prefix under another final delta
(a later image) is another rotation of the same keys, so the prefix cache keys an M-RoPE
prompt by its delta too (engine/image_prompt.prefix_key). Exact in real arithmetic; in
float32 the angles are those of ids shifted by |delta| (against mlx-vlm, which rotates by
the unshifted ids: logits within ~2e-6 in tests/models/test_qwen2_vl_text.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import mlx.core as mx
import numpy as np
from jaxtyping import Float

from fx_engine.core.checkpoint import (Fused, Lin, LoadOptions, Norm, Reader, TensorSource, TensorSpec,
                                       WeightsError, read_tensors)
from fx_engine.core.config import ConfigError, Field, read_fields
from fx_engine.core.nn import Linear, Numerics, attention, gelu, layer_norm, linear, rms_norm, swiglu_fused
from fx_engine.core.tree import CompiledFunction, static_field
from fx_engine.core.buckets import size_bucket

#: multimodal config.json model_types this module reads (the top level's)
MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")
#: where the tower's tensors live: Hugging Face (< 4.52, >= 4.52) and mlx-vlm's conversions
TOWER_PREFIXES = ("visual.", "model.visual.", "vision_tower.")
#: what the chat template writes per image (the processor expands the <|image_pad|>)
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
#: the tower's norms' eps (hard-coded in transformers and mlx-vlm)
EPS = 1e-6
#: rotary base of the 2-D vision rope (VisionRotaryEmbedding's theta)
ROPE_THETA = 10000.0
#: query rows per attention block (full-attention layers over one large frame)
QUERY_BLOCK = 1024


@attrs.frozen
class Qwen2VLConfig:
    """The vision tower's sizes and the image token ids of a Qwen2(.5)-VL config.json.

    `hidden_size`: the tower's width (2.5: vision_config.hidden_size; Qwen2-VL:
    vision_config.embed_dim); `out_hidden_size`: the merger's output = the text hidden size
    (2.5: vision_config.out_hidden_size; Qwen2-VL: vision_config.hidden_size)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    tokens_per_second: int = 2
    model_type: str = "qwen2_5_vl"  # "qwen2_vl": LayerNorm, QuickGELU fc1/fc2, no windows
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    @property
    def v2(self) -> bool:
        """Qwen2-VL's tower (not 2.5's)."""
        return self.model_type == "qwen2_vl"

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
    def window_tokens(self) -> int:
        """Merged tokens a side of one attention window (2.5): window_size / merge / patch."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def placeholder(self) -> str:
        """What the chat template writes in an image's place."""
        return PLACEHOLDER

    @property
    def image_token_index(self) -> int:
        """The image token (the name the shell's splice reads for every family)."""
        return self.image_token_id

    def image_tokens(self, grid: Sequence[int]) -> int:
        """The image tokens (text positions) of one image of grid (t, h, w)."""
        t, h, w = (int(v) for v in grid)
        return t * h * w // self.merge_unit


def _token_ids(d: dict[str, Any], source: str) -> dict[str, int]:
    out = {}
    for name, default in (("image_token_id", 151655), ("video_token_id", 151656),
                          ("vision_start_token_id", 151652), ("vision_end_token_id", 151653)):
        v = d.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{source}: field '{name}' must be a token id (an integer >= 0), got {v!r}")
        out[name] = v
    if len(set(out.values())) != 4:
        raise ConfigError(f"{source}: the image, video, vision-start and vision-end token ids must differ, got {out}")
    return out


def _text_hidden(d: dict[str, Any]) -> int | None:
    text = d.get("text_config")
    if isinstance(text, dict) and text.get("hidden_size") is not None:
        return text["hidden_size"]
    return d.get("hidden_size")


_V25 = (
    Field("depth"), Field("hidden_size"), Field("intermediate_size"), Field("num_heads"),
    Field("out_hidden_size"), Field("patch_size", default=14), Field("temporal_patch_size", default=2),
    Field("spatial_merge_size", default=2), Field("in_channels", default=3), Field("window_size", default=112),
    Field("tokens_per_second", default=2),
)
_V2 = (
    Field("depth"), Field("embed_dim", to="hidden_size"), Field("num_heads"),
    Field("hidden_size", to="out_hidden_size"), Field("patch_size", default=14),
    Field("temporal_patch_size", default=2), Field("spatial_merge_size", default=2),
)


def _vision_dict(d: dict[str, Any]) -> dict[str, Any]:
    """vision_config with transformers' attribute_map aliases read too."""
    v = dict(d)
    for alias, name in (("num_attention_heads", "num_heads"), ("num_hidden_layers", "depth"),
                        ("in_chans", "in_channels")):
        if name not in v and alias in v:
            v[name] = v[alias]
    return v


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Qwen2VLConfig:
    """The tower's config from a Qwen2.5-VL (model_type "qwen2_5_vl") or Qwen2-VL
    ("qwen2_vl") config.json dict; ConfigError naming the field for what is missing,
    malformed or not implemented."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected an object, got {type(d).__name__}")
    mt = d.get("model_type")
    if mt not in MODEL_TYPES:
        raise ConfigError(f"{source}: model_type {mt!r} is not Qwen2.5-VL's or Qwen2-VL's ({', '.join(MODEL_TYPES)})")
    vision = d.get("vision_config")
    if not isinstance(vision, dict):
        raise ConfigError(f"{source}: field 'vision_config' is missing or not an object (a text-only checkpoint "
                          "has no vision tower)")
    vsrc = f"{source}: vision_config"
    v = _vision_dict(vision)
    if mt == "qwen2_vl":
        f = read_fields(v, _V2, vsrc)
        in_ch = read_fields(v, (Field("in_channels", default=3),), vsrc)["in_channels"]
        ratio = v.get("mlp_ratio", 4)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0:
            raise ConfigError(f"{vsrc}: field 'mlp_ratio' must be a positive number, got {ratio!r}")
        act = v.get("hidden_act") or "quick_gelu"
        if act != "quick_gelu":
            raise ConfigError(f"{vsrc}: field 'hidden_act' = {act!r} is not supported (Qwen2-VL: 'quick_gelu')")
        f.update(intermediate_size=int(f["hidden_size"] * ratio), in_channels=in_ch, window_size=0,
                 fullatt_block_indexes=tuple(range(f["depth"])), tokens_per_second=2)
    else:
        f = read_fields(v, _V25, vsrc)
        act = v.get("hidden_act") or "silu"
        if act != "silu":
            raise ConfigError(f"{vsrc}: field 'hidden_act' = {act!r} is not supported (Qwen2.5-VL: 'silu')")
        full = v.get("fullatt_block_indexes", [7, 15, 23, 31])
        if (not isinstance(full, (list, tuple)) or
                not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < f["depth"] for i in full)):
            raise ConfigError(f"{vsrc}: field 'fullatt_block_indexes' must be a list of layer indexes in "
                              f"[0, depth = {f['depth']}), got {full!r}")
        f["fullatt_block_indexes"] = tuple(sorted(set(full)))
        unit = f["spatial_merge_size"] * f["patch_size"]
        if f["window_size"] % unit:
            raise ConfigError(f"{vsrc}: field 'window_size' ({f['window_size']}) is not a multiple of "
                              f"spatial_merge_size * patch_size ({unit})")
    if f["hidden_size"] % f["num_heads"] or (f["hidden_size"] // f["num_heads"]) % 4:
        raise ConfigError(f"{vsrc}: the head size (hidden width {f['hidden_size']} / num_heads {f['num_heads']}) "
                          "must be a whole multiple of 4 (the 2-D rotary embedding's halves)")
    text_hidden = _text_hidden(d)
    if text_hidden is not None and text_hidden != f["out_hidden_size"]:
        key = "hidden_size" if mt == "qwen2_vl" else "out_hidden_size"
        raise ConfigError(f"{vsrc}: field '{key}' ({f['out_hidden_size']}) differs from the text model's "
                          f"hidden_size ({text_hidden})")
    return Qwen2VLConfig(model_type=mt, **f, **_token_ids(d, source))


# ---------------------------------------------------------------- params and checkpoint


@attrs.frozen
class Qwen2VLLayer:
    norm1: tuple[mx.array, mx.array | None]  # (weight, bias): RMSNorm's bias is None
    qkv: Linear  # q | k | v rows, with biases
    proj: Linear
    norm2: tuple[mx.array, mx.array | None]
    up: Linear  # 2.5: gate | up fused (with biases); Qwen2-VL: fc1
    down: Linear  # 2.5: down_proj; Qwen2-VL: fc2


@attrs.frozen
class Qwen2VLParams:
    patch: Linear  # [C*T*P*P -> hidden], no bias, inputs in (channel, frame, row, column) order
    layers: tuple[Qwen2VLLayer, ...]
    merger_norm: tuple[mx.array, mx.array | None]
    merger_fc1: Linear
    merger_fc2: Linear
    config: Qwen2VLConfig = static_field()
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")


def _layer_table(cfg: Qwen2VLConfig) -> tuple:
    norm_bias = cfg.v2
    attn = (Norm("norm1", "norm1", bias=norm_bias),
            Lin("qkv", "attn.qkv", 3 * cfg.hidden_size, "hidden_size", bias=True),
            Lin("proj", "attn.proj", "hidden_size", "hidden_size", bias=True),
            Norm("norm2", "norm2", bias=norm_bias))
    if cfg.v2:
        return attn + (Lin("up", "mlp.fc1", "intermediate_size", "hidden_size", bias=True),
                       Lin("down", "mlp.fc2", "hidden_size", "intermediate_size", bias=True))
    return attn + (Fused("up", (("mlp.gate_proj", "intermediate_size"), ("mlp.up_proj", "intermediate_size")),
                         "hidden_size", bias=True),
                   Lin("down", "mlp.down_proj", "hidden_size", "intermediate_size", bias=True))


def is_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the vision tower (with its merger)."""
    return name.startswith(TOWER_PREFIXES)


def _prefix(src: TensorSource, where: str, prefixes: Sequence[str] = TOWER_PREFIXES) -> str:
    """The first of `prefixes` under which the checkpoint holds the patch embedding."""
    probe = "patch_embed.proj.weight"
    for p in prefixes:
        if src.has(p + probe):
            return p
    raise WeightsError(f"{where}: no vision tower tensors (looked for "
                       f"{', '.join(repr(p + probe) for p in prefixes)})")


def _patch_weight(cfg: Qwen2VLConfig, src: TensorSource, name: str, where: str) -> mx.array:
    """The patch conv's weight as [hidden, C*T*P*P] in (channel, frame, row, column) order,
    from Hugging Face's [hidden, C, T, P, P] or mlx-vlm's [hidden, T, P, P, C]."""
    if src.has(name[: -len(".weight")] + ".scales"):
        raise WeightsError(f"{src.origin.get(name, where)}: '{name}' is quantized; a quantized patch "
                           "embedding is not supported")
    w = src.get(name, None, where)
    h, c, t, p = cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
    hf, mlx = (h, c, t, p, p), (h, t, p, p, c)
    shape = tuple(w.shape)
    if shape == mlx and hf != mlx:
        w = w.transpose(0, 4, 1, 2, 3)
    elif shape != hf:
        raise WeightsError(f"{src.origin[name]}: tensor '{name}' has shape {shape}, expected {hf} "
                           f"(Hugging Face) or {mlx} (mlx-vlm)")
    elif hf == mlx:
        raise WeightsError(f"{src.origin[name]}: '{name}' {shape}: with in_channels == temporal_patch_size == "
                           "patch_size the channels-first and channels-last layouts cannot be told apart")
    return w.reshape(h, c * t * p * p)


def assemble(cfg: Qwen2VLConfig, src: TensorSource, opts: LoadOptions) -> Qwen2VLParams:
    """The tower's params from a checkpoint's tensors (any prefix of TOWER_PREFIXES)."""
    pre = _prefix(src, opts.where)
    rd = Reader(src, opts)
    patch = Linear(weight=_patch_weight(cfg, src, pre + "patch_embed.proj.weight", opts.where))
    table = _layer_table(cfg)
    layers = tuple(Qwen2VLLayer(**read_tensors(rd, table, cfg, pre + "blocks.{i}.", i=i))
                   for i in range(cfg.depth))
    merged = cfg.hidden_size * cfg.merge_unit
    merger = read_tensors(rd, (Norm("merger_norm", "ln_q", bias=cfg.v2),
                               Lin("merger_fc1", "mlp.0", merged, merged, bias=True),
                               Lin("merger_fc2", "mlp.2", "out_hidden_size", merged, bias=True)),
                          cfg, pre + "merger.")
    return Qwen2VLParams(patch=rd.finish(patch), layers=layers, **merger, config=cfg, numerics=opts.numerics,
                         dtype=opts.dtype_name)


def _spec(*shape: int, scale: float = 0.1, center: float = 0.0) -> TensorSpec:
    return TensorSpec(tuple(shape), center=center, scale=scale)


def _lin_specs(name: str, rows: int, cols: int) -> dict[str, TensorSpec]:
    """A linear's weight [rows, cols] and bias, for tiny test models."""
    return {name + ".weight": _spec(rows, cols, scale=0.15), name + ".bias": _spec(rows, scale=0.05)}


def _patch_spec(cfg: Any) -> TensorSpec:
    """The patch conv's weight in Hugging Face's layout [hidden, C, T, P, P]."""
    return _spec(cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size,
                 scale=0.15)


def checkpoint_layout(cfg: Qwen2VLConfig) -> dict[str, TensorSpec]:
    """The tower's tensors under Hugging Face's names (`visual.`), for tiny test models."""
    h, f, o = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size
    m = h * cfg.merge_unit
    pre = TOWER_PREFIXES[0]

    def norm(name: str) -> dict[str, TensorSpec]:
        out = {name + ".weight": _spec(h, center=1.0)}
        if cfg.v2:
            out[name + ".bias"] = _spec(h, scale=0.05)
        return out

    out = {pre + "patch_embed.proj.weight": _patch_spec(cfg)}
    for i in range(cfg.depth):
        b = f"{pre}blocks.{i}."
        out.update(norm(b + "norm1"))
        out.update(_lin_specs(b + "attn.qkv", 3 * h, h))
        out.update(_lin_specs(b + "attn.proj", h, h))
        out.update(norm(b + "norm2"))
        if cfg.v2:
            out.update(_lin_specs(b + "mlp.fc1", f, h))
            out.update(_lin_specs(b + "mlp.fc2", h, f))
        else:
            out.update(_lin_specs(b + "mlp.gate_proj", f, h))
            out.update(_lin_specs(b + "mlp.up_proj", f, h))
            out.update(_lin_specs(b + "mlp.down_proj", h, f))
    out.update(norm(pre + "merger.ln_q"))
    out.update(_lin_specs(pre + "merger.mlp.0", m, m))
    out.update(_lin_specs(pre + "merger.mlp.2", o, m))
    return out


# ---------------------------------------------------------------- geometry (numpy, from grid_thw)


def _grids(grid_thw: Any, cfg: Qwen2VLConfig) -> tuple[tuple[int, int, int], ...]:
    g = np.asarray(grid_thw.tolist() if isinstance(grid_thw, mx.array) else grid_thw)
    if g.ndim != 2 or g.shape[1] != 3 or g.shape[0] == 0:
        raise ValueError(f"Qwen2-VL: grid_thw must be [images, 3] (t, h, w), got shape {list(g.shape)}")
    m = cfg.spatial_merge_size
    out = []
    for i, (t, h, w) in enumerate(g.tolist()):
        if min(t, h, w) <= 0 or h % m or w % m:
            raise ValueError(f"Qwen2-VL: grid_thw[{i}] = {[t, h, w]}: t, h, w must be positive and h, w "
                             f"multiples of spatial_merge_size ({m})")
        out.append((int(t), int(h), int(w)))
    return tuple(out)


def _positions(grids: Sequence[tuple[int, int, int]], m: int) -> np.ndarray:
    """(row, column) of every patch in the processor's (merge-window) order: [N, 2]."""
    out = []
    for t, h, w in grids:
        rows = np.arange(h)[:, None].repeat(w, 1).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
        cols = np.arange(w)[None, :].repeat(h, 0).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], -1), (t, 1)))
    return np.concatenate(out)


def _window_index(grids: Sequence[tuple[int, int, int]], cfg: Qwen2VLConfig) -> tuple[np.ndarray, list[int]]:
    """The merged tokens regrouped by attention window (get_window_index): their order
    [N / m^2] and each window's length in merged tokens (empty windows dropped)."""
    win = cfg.window_tokens
    m = cfg.spatial_merge_size
    order, lens, base = [], [], 0
    for t, h, w in grids:
        lh, lw = h // m, w // m
        idx = np.arange(t * lh * lw).reshape(t, lh, lw)
        nh, nw = -(-lh // win), -(-lw // win)
        padded = np.full((t, nh * win, nw * win), -1)
        padded[:, :lh, :lw] = idx
        blocks = padded.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4).reshape(-1, win * win)
        for b in blocks:
            keep = b[b >= 0]
            if keep.size:
                order.append(keep + base)
                lens.append(int(keep.size))
        base += t * lh * lw
    return np.concatenate(order), lens


@attrs.frozen
class Segments:
    """Attention segments as a padded batch: gather [S, L] token indexes, valid [S, L],
    scatter [N] each token's flat slot (s * L + l). Padding (slots past a segment's end,
    whole padding segments, tokens past the real ones) gathers token 0 and is never a key
    of a real query; a padding segment keeps its first slot valid so that no softmax row is
    empty (no NaN anywhere), and padding tokens take slot 0's output (dropped at the end)."""

    gather: mx.array
    valid: mx.array
    scatter: mx.array


def _segments(lengths: Sequence[int], tokens: int | None = None, slots: int | None = None,
              width: int | None = None) -> Segments:
    """Segments of consecutive tokens of `lengths`, padded to `slots` segments of `width`
    and `tokens` tokens (defaults: unpadded)."""
    n, s = int(sum(lengths)), len(lengths)
    width = max(lengths) if width is None else width
    slots = s if slots is None else slots
    tokens = n if tokens is None else tokens
    gather = np.zeros((slots, width), np.int32)
    valid = np.zeros((slots, width), bool)
    valid[s:, 0] = True
    scatter = np.zeros(tokens, np.int32)
    start = 0
    for i, ln in enumerate(lengths):
        gather[i, :ln] = np.arange(start, start + ln)
        valid[i, :ln] = True
        scatter[start:start + ln] = i * width + np.arange(ln)
        start += ln
    return Segments(mx.array(gather), mx.array(valid), mx.array(scatter))


def _frame_lengths(grids: Sequence[tuple[int, int, int]]) -> list[int]:
    """Full attention's segments: one per frame of each image."""
    return [h * w for t, h, w in grids for _ in range(t)]


def _frame_segments(grids: Sequence[tuple[int, int, int]], tokens: int | None = None,
                    bucketed: bool = False) -> Segments:
    """Full attention's segments (one per frame of each image), their width padded to a
    size bucket when `bucketed` (the frame count stays exact: images per call)."""
    lens = _frame_lengths(grids)
    return _segments(lens, tokens, width=size_bucket(max(lens)) if bucketed else None)


def padded_tokens(grids: Sequence[tuple[int, int, int]], unit: int) -> int:
    """The patch count a compiled forward pads the images of `grids` to: merged tokens
    rounded up to a size bucket, times the merge unit."""
    return size_bucket(sum(t * h * w for t, h, w in grids) // unit) * unit


@attrs.frozen
class Geometry:
    """What the forward needs from grid_thw, as array inputs (so that a compiled forward
    traces once per padded size, not per image size): the window order of the patches and
    its inverse over merged tokens, each (window-ordered) patch's (row, column) for the
    rotary embedding, and the two attention segmentations. Padded to `tokens` patches: the
    padding patches sit at the end in both orders."""

    order: mx.array  # [N] int32, window-ordered position -> processor position (patches)
    restore: mx.array  # [N / m^2] int32, processor position -> window-ordered position (merged)
    rows_cols: mx.array  # [N, 2] float32 in window order
    windows: Segments  # window attention (2.5; Qwen2-VL: the frames)
    frames: Segments  # full attention (one segment per frame of each image)


def geometry(grid_thw: Any, cfg: Qwen2VLConfig, tokens: int | None = None) -> Geometry:
    """The Geometry of `grid_thw`, padded to `tokens` patches (None: unpadded; else the
    windows' count and the frames' width are padded to size buckets too)."""
    grids = _grids(grid_thw, cfg)
    unit = cfg.merge_unit
    pos = _positions(grids, cfg.spatial_merge_size)
    n = pos.shape[0]
    padded = tokens is not None
    tokens = n if tokens is None else tokens
    if tokens < n or tokens % unit:
        raise ValueError(f"Qwen2-VL: cannot pad {n} patches to {tokens} (a multiple of {unit} >= {n})")
    frames = _frame_segments(grids, tokens, bucketed=padded)
    if cfg.v2:
        merged_order = np.arange(n // unit)
        windows = frames  # (every layer attends over its frame)
    else:
        merged_order, win_lens = _window_index(grids, cfg)
        cap = cfg.window_tokens ** 2 * unit
        windows = _segments([ln * unit for ln in win_lens], tokens, width=cap if padded else None,
                            slots=size_bucket(len(win_lens)) if padded else None)
    merged_order = np.concatenate([merged_order, np.arange(n // unit, tokens // unit)])
    order = (merged_order[:, None] * unit + np.arange(unit)[None]).reshape(-1)
    rows_cols = np.concatenate([pos, np.zeros((tokens - n, 2), pos.dtype)])[order]
    return Geometry(order=mx.array(order.astype(np.int32)), restore=mx.array(np.argsort(merged_order).astype(np.int32)),
                    rows_cols=mx.array(rows_cols.astype(np.float32)), windows=windows, frames=frames)


def pad_patches(patches: mx.array, tokens: int) -> mx.array:
    """Patches [N, F] with zero rows appended up to `tokens`."""
    n = patches.shape[0]
    return patches if n == tokens else mx.concatenate([patches, mx.zeros((tokens - n, patches.shape[1]), patches.dtype)])


# ---------------------------------------------------------------- forward


def _rope(rc: mx.array, head_dim: int) -> tuple[mx.array, mx.array]:
    """cos, sin [N, head_dim] of the 2-D rotary embedding (VisionRotaryEmbedding of
    head_dim / 2 over rows then columns, repeated for rotate-half) of rows_cols [N, 2] float32."""
    dim = head_dim // 2
    inv = 1.0 / (ROPE_THETA ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim))
    freqs = (rc[:, :, None] * inv[None, None]).reshape(rc.shape[0], -1)  # [N, dim]: rows' | cols'
    emb = mx.concatenate([freqs, freqs], axis=-1)
    return mx.cos(emb), mx.sin(emb)


def check_patches(patches: mx.array, grids: Sequence[tuple[int, int, int]], features: int, family: str) -> int:
    """The patch count of `grids`, checked against patches [N, C*T*P*P]; `family` names the
    tower in the error."""
    n = int(sum(t * h * w for t, h, w in grids))
    if patches.ndim != 2 or tuple(patches.shape) != (n, features):
        raise ValueError(f"{family}: patches must be [{n}, {features}] (sum of t*h*w over grid_thw, "
                         f"C*T*P*P), got {list(patches.shape)}")
    return n


def _embed_patches(p: Any, patches: mx.array) -> mx.array:
    """The patch embedding [N, hidden] (in the params' dtype, the processor's order) of
    patches [N, C*T*P*P]; `p`: a Qwen2-VL or Qwen3-VL tower's params."""
    return linear(patches.astype(getattr(mx, p.dtype)), p.patch, p.numerics)


def _segment_arrays(sg: Segments) -> tuple[mx.array, mx.array, mx.array]:
    """Segments as `_attention` takes them: gather [S, L], the valid mask [S, 1, 1, L], scatter [N]."""
    return sg.gather, sg.valid[:, None, None, :], sg.scatter


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x [N, H, D] rotated (rotate-half), in float32 then back to x's dtype."""
    d = x.shape[-1] // 2
    xf = x.astype(mx.float32)
    rot = mx.concatenate([-xf[..., d:], xf[..., :d]], axis=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).astype(x.dtype)


def _attention(x: mx.array, lp: Qwen2VLLayer, cfg: Qwen2VLConfig, num: Numerics, cos: mx.array, sin: mx.array,
               seg: tuple[mx.array, mx.array, mx.array]) -> mx.array:
    """Attention within segments (a padded batch: `_Segments` as arrays, the valid mask as
    [S, 1, 1, L]: padded slots are never keys; their query rows are dropped)."""
    n = x.shape[0]
    hq, d = cfg.num_heads, cfg.head_dim
    qkv = linear(x, lp.qkv, num).reshape(n, 3, hq, d)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    gather, keys, scatter = seg
    s, width = gather.shape
    qs = q[gather]  # [S, L, H, D]
    ks = k[gather].transpose(0, 2, 1, 3)
    vs = v[gather].transpose(0, 2, 1, 3)
    outs = []
    for j0 in range(0, width, QUERY_BLOCK):
        j1 = min(width, j0 + QUERY_BLOCK)
        mask = mx.broadcast_to(keys, (s, 1, j1 - j0, width))
        outs.append(attention(qs[:, j0:j1], ks, vs, mask, d ** -0.5, num))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)  # [S, L, H * D]
    out = out.reshape(s * width, hq * d)[scatter]
    return linear(out, lp.proj, num)


def _norm(x: mx.array, w: tuple[mx.array, mx.array | None], v2: bool) -> mx.array:
    return layer_norm(x, w[0], w[1], EPS) if v2 else rms_norm(x, w[0], EPS)


def _mlp(x: mx.array, lp: Qwen2VLLayer, v2: bool, num: Numerics) -> mx.array:
    y = linear(x, lp.up, num)
    if v2:  # QuickGELU
        yf = y.astype(mx.float32)
        y = (yf * mx.sigmoid(1.702 * yf)).astype(y.dtype)
    else:
        y = swiglu_fused(y, num)
    return linear(y, lp.down, num)


def forward(p: Qwen2VLParams, patches: Float[mx.array, "N F"], geo: Geometry) -> Float[mx.array, "M O"]:
    """The tower on patches [N, C*T*P*P] (processor order, padded to the Geometry's size)
    with a Geometry: [N / m^2, out_hidden_size] in the processor's order (padding rows
    last), in the params' dtype."""
    cfg, num = p.config, p.numerics
    x = _embed_patches(p, patches)[geo.order]
    n = x.shape[0]
    cos, sin = _rope(geo.rows_cols, cfg.head_dim)
    full = set(cfg.fullatt_block_indexes)
    frames, windows = _segment_arrays(geo.frames), _segment_arrays(geo.windows)
    for i, lp in enumerate(p.layers):
        seg = frames if i in full else windows
        x = x + _attention(_norm(x, lp.norm1, cfg.v2), lp, cfg, num, cos, sin, seg)
        x = x + _mlp(_norm(x, lp.norm2, cfg.v2), lp, cfg.v2, num)
    x = _norm(x, p.merger_norm, cfg.v2).reshape(n // cfg.merge_unit, cfg.merge_unit * cfg.hidden_size)
    x = linear(gelu(linear(x, p.merger_fc1, num)), p.merger_fc2, num)
    return x[geo.restore]


def encode_images(p: Qwen2VLParams, patches: Float[mx.array, "N F"], grid_thw: Any) -> Float[mx.array, "M O"]:
    """Patches [N, C*T*P*P] of the images of `grid_thw` [images, 3] (both as the
    processor returns them: fx_engine/loading/images_qwen2_vl.py) -> their token
    embeddings [sum(t*h*w) / m^2, out_hidden_size], image after image (eager, unpadded)."""
    cfg = p.config
    check_patches(patches, _grids(grid_thw, cfg), cfg.patch_features, "Qwen2-VL")
    return forward(p, patches, geometry(grid_thw, cfg))


_compiled = CompiledFunction(forward, name="qwen2_vl_encode_images")


def encode_images_compiled(p: Qwen2VLParams, patches: mx.array, grid_thw: Any) -> mx.array:
    """`encode_images` compiled and bucketed by image size: the patches are padded to
    `padded_tokens` and the geometry passed as arrays, so one trace serves every set of
    images with the same padded size, frame count (exact: the engine encodes image by
    image) and largest frame's bucket, and for Qwen2.5-VL window-count bucket."""
    cfg = p.config
    grids = _grids(grid_thw, cfg)
    n = check_patches(patches, grids, cfg.patch_features, "Qwen2-VL")
    tokens = padded_tokens(grids, cfg.merge_unit)
    out = _compiled(p, pad_patches(patches, tokens), geometry(grids, cfg, tokens))
    return out[:n // cfg.merge_unit]


def split_images(rows: mx.array, grid_thw: Any, cfg: Qwen2VLConfig) -> list[mx.array]:
    """The encoder's rows cut per image ([t*h*w / m^2, out] each)."""
    sizes = [cfg.image_tokens(g) for g in _grids(grid_thw, cfg)]
    cuts = np.cumsum(sizes)[:-1].tolist()
    return list(mx.split(rows, cuts, axis=0)) if cuts else [rows]


# ---------------------------------------------------------------- the text side: prompt and positions


def image_token_runs(tokens: Sequence[int] | np.ndarray, cfg: Qwen2VLConfig,
                     grid_thw: Any = None) -> list[tuple[int, int]]:
    """The [start, end) spans of the image-token runs of a token sequence (one per image),
    checked against the images' token counts when `grid_thw` is given. ValueError otherwise."""
    t = np.asarray(tokens).reshape(-1)
    edges = np.diff(np.concatenate([[0], (t == cfg.image_token_id).astype(np.int8), [0]]))
    spans = list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))
    if grid_thw is not None:
        want = [cfg.image_tokens(g) for g in _grids(grid_thw, cfg)]
        got = [b - a for a, b in spans]
        if got != want:
            raise ValueError(f"the prompt's image-token runs are {got} tokens long, but the images have {want}")
    return spans


def rope_positions(tokens: Sequence[int] | np.ndarray, grid_thw: Any, cfg: Qwen2VLConfig) -> tuple[np.ndarray, int]:
    """get_rope_index for one unpadded prompt (images only): its three position ids
    [3, L] (temporal, height, width) and its rope_delta (max id + 1 - L). Text runs count
    on from the last id + 1 on all three rows; an image of grid (t, h, w) starting at id s
    gets (s + frame, s + row, s + column) over its merged grid (t, h / m, w / m),
    row-major: the text after it starts at its largest id + 1."""
    t = np.asarray(tokens).reshape(-1)
    grids = _grids(grid_thw, cfg) if grid_thw is not None and len(grid_thw) else ()
    spans = image_token_runs(t, cfg, grid_thw if grids else None)
    m = cfg.spatial_merge_size
    pos = np.zeros((3, t.size), np.int64)
    at = nxt = 0
    for (a, b), (gt, gh, gw) in zip(spans, grids):
        pos[:, at:a] = nxt + np.arange(a - at)
        s = nxt + a - at
        pos[:, a:b] = np.indices((gt, gh // m, gw // m)).reshape(3, -1) + s
        nxt = int(pos[:, a:b].max()) + 1
        at = b
    pos[:, at:] = nxt + np.arange(t.size - at)
    delta = int(pos.max()) + 1 - t.size if t.size else 0
    return pos, delta


def rope_offsets(tokens: Sequence[int] | np.ndarray, grid_thw: Any, cfg: Qwen2VLConfig) -> tuple[np.ndarray, int]:
    """(offsets int32 [3, L], rope_delta): each token's three ids shifted by -rope_delta,
    minus its cache position, what `splice.ImageInput.positions` holds (the module
    docstring: shifted so that the text after the last image, and decoding, is plain RoPE;
    the offsets are zero there)."""
    pos, delta = rope_positions(tokens, grid_thw, cfg)
    return (pos - delta - np.arange(pos.shape[1])[None, :]).astype(np.int32), delta
