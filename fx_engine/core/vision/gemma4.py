"""Gemma 4's image path (config.json model_type `gemma4`: gemma-4-E2B / E4B / 26B-A4B /
31B): its own vision transformer (not Gemma 3's SigLIP), images of any aspect ratio
within a budget of soft tokens, the projection into the text model, and the prompt's
image-token layout.

Tower (transformers 5.x modeling_gemma4.Gemma4VisionModel; mlx-vlm 0.7.10
mlx_vlm/models/gemma4/vision.py), one image as its patches (the processor's layout,
fx_engine/loading/images_gemma4.py): n patches [n, p * p * 3], each flattened in (row,
column, channel) order with values in [0, 1], and their (x, y) grid positions:

* embed: input_proj(2 * (x - 0.5)) (no bias) plus the position table's two rows
  position_embedding_table[0][x] + position_embedding_table[1][y] ([2, P, hidden]).
* layers: h + post_attn_norm(attn(input_norm(h))), then h + post_ff_norm(mlp(pre_ff_norm(h))),
  every norm an RMSNorm x * rsqrt(mean(x^2) + eps) * w (no 1 +); attention bidirectional
  over the image's patches, scale 1, q and k RMS-normalized per head (with weights), v
  too (without), grouped-query heads; the MLP down(gelu_tanh(gate(x)) * up(x)); no biases.
  Each linear may clip its input and output to stored bounds (`use_clipped_linears`:
  Gemma4ClippableLinear's input_min / input_max / output_min / output_max).
* 2-D rotary ("axial"): the head's first half rotates by the patch's x, the second half by
  its y, each half rotate-half style, inv_freq = 1 / theta^(2j / (head_dim / 2)),
  j < head_dim / 4 (theta: rope_parameters.rope_theta, 100).
* pool: the k x k blocks of patches (k = pooling_kernel_size) averaged into one soft
  token each, row-major over the (H / k) x (W / k) token grid; times sqrt(hidden), in
  float32; where `standardize`, (x - std_bias) * std_scale.

Projection (Gemma4MultimodalEmbedder, `embed_vision`): RMSNorm without weights (eps: the
tower's), then embedding_projection [hidden -> text hidden] (no bias). One row per soft
token, spliced into the text model's embeddings after their sqrt(hidden) scaling (the
image rows go in as they are, as Gemma 3's).

The processor pads every image's patches to max_soft_tokens * k^2 and masks the padding
out of attention, the pool and the result: the same values as the tower run on the real
patches alone, which is what runs here (`encode_images_compiled` pads to a size bucket
instead, padding keys masked, so one compiled trace serves every image size in a bucket).

Prompt (Gemma4Processor): the chat template writes "<|image|>" per image; the processor
replaces it with "<|image>" + "<|image|>" * n + "<image|>" (n: the image's soft tokens),
no newlines around it. The text model's attention over them (the text config's
`use_bidirectional_attention`, core/models/gemma.py's `vision_bidirectional`): "vision"
(26B-A4B, 31B): during prefill the tokens of one image attend to each other on
sliding-window layers only (Hugging Face's create_masks_for_vision_model: full-attention layers stay causal, sliding ones are
window AND (causal OR same image)); otherwise (E2B, E4B) plain causal. mlx-vlm 0.7.10
overlays the image blocks on both kinds of layers: fx-engine follows Hugging Face.
The per-layer input embeddings (E2B / E4B) look image tokens up as the pad token
(Hugging Face's and mlx-vlm's Gemma4Model), their projection half reads the spliced rows.

Tensor names: Hugging Face's under model.vision_tower. / model.embed_vision., mlx-vlm's
conversions without the "model." (patch_embedder.input_proj.weight,
patch_embedder.position_embedding_table, encoder.layers.{i}.{input_layernorm,
post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm}.weight,
encoder.layers.{i}.self_attn.{q,k,v,o}_proj.linear.weight, self_attn.{q,k}_norm.weight,
encoder.layers.{i}.mlp.{gate,up,down}_proj.linear.weight, std_bias / std_scale;
embed_vision.embedding_projection.weight). Linears may be MLX affine-quantized.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import mlx.core as mx
import numpy as np
from jaxtyping import Float, Int

from fx_engine.core.buckets import size_bucket
from fx_engine.core.checkpoint import LoadOptions, Reader, TensorSource, TensorSpec
from fx_engine.core.config import BOOL, POSITIVE, POSITIVE_FLOAT, ConfigError, Field, Same, read_field, read_fields
from fx_engine.core.nn import Linear, Numerics, attention, gelu_tanh, linear
from fx_engine.core.tree import CompiledFunction, static_field
from fx_engine.core.vision.gemma3 import token_id_field
from fx_engine.core.vision.siglip import TANH_GELU, tensor_prefix as _prefix

MODEL_TYPE = "gemma4"
#: where the tower's and the projection's tensors live: Hugging Face's, mlx-vlm's conversions'
TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
EMBEDDER_PREFIXES = ("model.embed_vision.", "embed_vision.")
#: the chat template's placeholder and the processor's boi / eoi strings (Gemma 4's tokens)
PLACEHOLDER, BOI_TEXT, EOI_TEXT = "<|image|>", "<|image>", "<image|>"
#: the soft-token budgets the processor accepts (max_soft_tokens)
SOFT_TOKENS = (70, 140, 280, 560, 1120)
#: query rows per attention block (1120 soft tokens at k = 3: 10,080 patches; 16 heads:
#: ~660 MB of float32 scores a block)
QUERY_BLOCK = 1024
#: the linears of a layer, in the order their clip bounds are kept
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@attrs.frozen
class Gemma4VisionConfig:
    """What Gemma 4's image path reads from config.json (vision_config, the text model's
    hidden size and attention rule, the image token ids)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    text_hidden_size: int
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10240
    default_output_length: int = 280
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    standardize: bool = False
    clipped_linears: bool = False
    image_token_index: int = 258880
    boi_token_index: int = 255999
    eoi_token_index: int = 258882
    model_type: str = MODEL_TYPE

    @property
    def placeholder(self) -> str:
        """What the chat template writes in an image's place."""
        return PLACEHOLDER

    @property
    def patch_features(self) -> int:
        return 3 * self.patch_size ** 2


#: vision_config's fields (defaults: Gemma4VisionConfig's, transformers 5.x)
_FIELDS = (
    Field("hidden_size", POSITIVE, 768, null_default=True), Field("intermediate_size", POSITIVE, 3072, null_default=True),
    Field("num_hidden_layers", POSITIVE, 16, null_default=True, to="num_layers"),
    Field("num_attention_heads", POSITIVE, 12, null_default=True, to="num_heads"),
    Field("num_key_value_heads", POSITIVE, Same("num_heads"), null_default=True, to="num_kv_heads"),
    Field("patch_size", POSITIVE, 16, null_default=True), Field("pooling_kernel_size", POSITIVE, 3, null_default=True),
    Field("position_embedding_size", POSITIVE, 10240, null_default=True),
    Field("rms_norm_eps", POSITIVE_FLOAT, 1e-6, null_default=True),
    Field("standardize", BOOL, False, null_default=True), Field("use_clipped_linears", BOOL, False, null_default=True,
                                                                 to="clipped_linears"),
)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Gemma4VisionConfig:
    """Gemma 4's image-path config from its multimodal config.json dict; ConfigError naming
    the field for what is missing, malformed or not implemented."""
    if d.get("model_type") != MODEL_TYPE:
        raise ConfigError(f"{source}: model_type {d.get('model_type')!r} is not Gemma 4's multimodal {MODEL_TYPE!r}")
    text, v = d.get("text_config"), d.get("vision_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: field 'text_config' is missing or not an object")
    if not isinstance(v, dict):
        raise ConfigError(f"{source}: field 'vision_config' is missing or not an object (a text-only checkpoint "
                          "has no vision tower)")
    vs = f"{source}: vision_config"
    mt = v.get("model_type", "gemma4_vision")
    if mt != "gemma4_vision":
        raise ConfigError(f"{vs}: field 'model_type' = {mt!r} is not Gemma 4's vision tower ('gemma4_vision')")
    act = v.get("hidden_activation") or v.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in TANH_GELU:
        raise ConfigError(f"{vs}: field 'hidden_activation' = {act!r} is not supported ({', '.join(TANH_GELU)})")
    if v.get("attention_bias"):
        raise ConfigError(f"{vs}: field 'attention_bias' = true is not supported (Gemma 4's tower has no biases)")
    rope = v.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{vs}: field 'rope_parameters' must be an object, got {rope!r}")
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ConfigError(f"{vs}: rope_parameters.rope_type {rope.get('rope_type')!r} is not supported (axial)")
    f = read_fields(v, _FIELDS, vs)
    heads, kv = f["num_heads"], f["num_kv_heads"]
    head_dim = read_field(v, Field("head_dim", POSITIVE, f["hidden_size"] // heads, null_default=True), vs)
    if heads % kv:
        raise ConfigError(f"{vs}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})")
    if head_dim % 4:
        raise ConfigError(f"{vs}: head_dim ({head_dim}) must be a multiple of 4 (a rotary pair per axis)")
    text_hidden = read_field(text, Field("hidden_size"), f"{source}: text_config")
    ids = {"image": token_id_field(d, ("image_token_id", "image_token_index"), 258880, source),
           "boi": token_id_field(d, ("boi_token_id", "boi_token_index"), 255999, source),
           "eoi": token_id_field(d, ("eoi_token_id", "eoi_token_index"), 258882, source)}
    if len(set(ids.values())) != 3:
        raise ConfigError(f"{source}: the image, start-of-image and end-of-image token ids must differ, got {ids}")
    soft = read_field(v, Field("default_output_length", POSITIVE, d.get("vision_soft_tokens_per_image") or 280,
                                null_default=True), vs)
    return Gemma4VisionConfig(
        **f, head_dim=head_dim, text_hidden_size=text_hidden, default_output_length=soft,
        rope_theta=read_field(rope, Field("rope_theta", POSITIVE_FLOAT, 100.0, null_default=True), vs),
        image_token_index=ids["image"], boi_token_index=ids["boi"], eoi_token_index=ids["eoi"])


@attrs.frozen
class Gemma4VisionLayer:
    input_norm: mx.array
    post_attn_norm: mx.array
    pre_ff_norm: mx.array
    post_ff_norm: mx.array
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    q_norm: mx.array
    k_norm: mx.array
    gate: Linear
    up: Linear
    down: Linear
    # each linear's (input_min, input_max, output_min, output_max), float32 [4], in LINEARS'
    # order; None: not clipped (use_clipped_linears false)
    clips: tuple[mx.array, ...] | None = None


@attrs.frozen
class Gemma4VisionParams:
    patch: Linear  # [p * p * 3 -> hidden], inputs in (row, column, channel) order
    positions: mx.array  # [2, position_embedding_size, hidden]
    layers: tuple[Gemma4VisionLayer, ...]
    std_bias: mx.array | None  # [hidden] float32 (standardize)
    std_scale: mx.array | None
    projection: Linear  # embed_vision: [hidden -> text hidden]
    config: Gemma4VisionConfig = static_field()
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")


def is_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the image path (tower or projection)."""
    return name.startswith(TOWER_PREFIXES + EMBEDDER_PREFIXES)


def _clip_bounds(src: TensorSource, base: str, where: str) -> mx.array:
    return mx.stack([src.get(f"{base}.{n}", None, where).reshape(()).astype(mx.float32)
                     for n in ("input_min", "input_max", "output_min", "output_max")])


def assemble(cfg: Gemma4VisionConfig, src: TensorSource, opts: LoadOptions) -> Gemma4VisionParams:
    """The image path's params from a checkpoint's tensors (either prefix of
    TOWER_PREFIXES / EMBEDDER_PREFIXES)."""
    rd = Reader(src, opts)
    pre = _prefix(src, TOWER_PREFIXES, "patch_embedder.input_proj.weight", "vision tower", opts.where)
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d
    sizes = {"self_attn.q_proj": (q_rows, h), "self_attn.k_proj": (kv_rows, h), "self_attn.v_proj": (kv_rows, h),
             "self_attn.o_proj": (h, q_rows), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h),
             "mlp.down_proj": (h, f)}

    def layer(i: int) -> Gemma4VisionLayer:
        lp = f"{pre}encoder.layers.{i}."
        lins = [rd.linear(lp + n + ".linear", *sizes[n]) for n in LINEARS]
        clips = tuple(_clip_bounds(src, lp + n, opts.where) for n in LINEARS) if cfg.clipped_linears else None
        norms = [rd.vec(lp + n + ".weight", h) for n in ("input_layernorm", "post_attention_layernorm",
                                                         "pre_feedforward_layernorm", "post_feedforward_layernorm")]
        return Gemma4VisionLayer(*norms, *lins[:4], q_norm=rd.vec(lp + "self_attn.q_norm.weight", d),
                                 k_norm=rd.vec(lp + "self_attn.k_norm.weight", d), gate=lins[4], up=lins[5],
                                 down=lins[6], clips=clips)

    std = ((src.get(pre + "std_bias", (h,), opts.where).astype(mx.float32),
            src.get(pre + "std_scale", (h,), opts.where).astype(mx.float32)) if cfg.standardize else (None, None))
    ep = _prefix(src, EMBEDDER_PREFIXES, "embedding_projection.weight", "vision embedder", opts.where)
    table = src.get(pre + "patch_embedder.position_embedding_table", (2, cfg.position_embedding_size, h), opts.where)
    return Gemma4VisionParams(
        patch=rd.linear(pre + "patch_embedder.input_proj", h, cfg.patch_features),
        positions=table.astype(opts.dtype), layers=tuple(layer(i) for i in range(cfg.num_layers)),
        std_bias=std[0], std_scale=std[1], projection=rd.linear(ep + "embedding_projection", cfg.text_hidden_size, h),
        config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


def checkpoint_layout(cfg: Gemma4VisionConfig, tower: str = TOWER_PREFIXES[0],
                      embedder: str = EMBEDDER_PREFIXES[0]) -> dict[str, TensorSpec]:
    """The image path's tensors under Hugging Face's names (tiny test models), with the
    spread of their random values (clip bounds: finite, around +-4 / +-3)."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def S(*shape: int, scale: float = 0.1, center: float = 0.0) -> TensorSpec:
        return TensorSpec(tuple(shape), center=center, scale=scale)

    out = {tower + "patch_embedder.input_proj.weight": S(h, cfg.patch_features, scale=0.1),
           tower + "patch_embedder.position_embedding_table": S(2, cfg.position_embedding_size, h, scale=0.3)}
    sizes = {"self_attn.q_proj": (cfg.num_heads * d, h), "self_attn.k_proj": (cfg.num_kv_heads * d, h),
             "self_attn.v_proj": (cfg.num_kv_heads * d, h), "self_attn.o_proj": (h, cfg.num_heads * d),
             "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
    for i in range(cfg.num_layers):
        lp = f"{tower}encoder.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            out[lp + n + ".weight"] = S(h, center=1.0)
        out[lp + "self_attn.q_norm.weight"] = S(d, center=1.0)
        out[lp + "self_attn.k_norm.weight"] = S(d, center=1.0)
        for n in LINEARS:
            out[lp + n + ".linear.weight"] = S(*sizes[n], scale=0.15)
            if cfg.clipped_linears:
                for b, c in (("input_min", -4.0), ("input_max", 4.0), ("output_min", -3.0), ("output_max", 3.0)):
                    out[lp + n + "." + b] = S(scale=0.5, center=c)
    if cfg.standardize:
        out[tower + "std_bias"] = S(h, scale=0.5)
        out[tower + "std_scale"] = S(h, center=0.2, scale=0.02)
    out[embedder + "embedding_projection.weight"] = S(cfg.text_hidden_size, h, scale=0.15)
    return out


def _lin(x: mx.array, lin: Linear, clip: mx.array | None, num: Numerics) -> mx.array:
    """A Gemma4ClippableLinear: the input and output clipped to the stored bounds, if any."""
    if clip is None:
        return linear(x, lin, num)
    y = linear(mx.clip(x, clip[0], clip[1]).astype(x.dtype), lin, num)
    return mx.clip(y, clip[2], clip[3]).astype(y.dtype)


def _norm(x: mx.array, w: mx.array | None, eps: float) -> mx.array:
    """Gemma4RMSNorm: in float32, x * rsqrt(mean(x^2) + eps) (* w), cast back."""
    return mx.fast.rms_norm(x.astype(mx.float32), None if w is None else w.astype(mx.float32), eps).astype(x.dtype)


def rotary(cfg: Gemma4VisionConfig, positions: Int[mx.array, "B N 2"], dt: mx.Dtype) -> tuple[mx.array, mx.array]:
    """(cos, sin) [B, N, 1, head_dim] in `dt`: the first half of the head by the x
    positions, the second by the y ones (each half's frequencies twice)."""
    half = cfg.head_dim // 2
    inv = mx.array(1.0 / (cfg.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half))))
    ang = positions.astype(mx.float32)[..., None] * inv  # [B, N, 2, half / 2]
    ang = mx.concatenate([ang[:, :, 0], ang[:, :, 0], ang[:, :, 1], ang[:, :, 1]], axis=-1)[:, :, None, :]
    return mx.cos(ang).astype(dt), mx.sin(ang).astype(dt)


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate-half within each half of the head (x's half, y's half)."""
    q = x.shape[-1] // 4
    a1, a2, b1, b2 = (x[..., i * q:(i + 1) * q] for i in range(4))
    return x * cos + mx.concatenate([-a2, a1, -b2, b1], axis=-1) * sin


def _attention(x: mx.array, lp: Gemma4VisionLayer, cfg: Gemma4VisionConfig, cos: mx.array, sin: mx.array,
               keys: mx.array, num: Numerics) -> mx.array:
    """Every patch attends to every real patch of its image (keys: bool [B, N])."""
    b, n, _ = x.shape
    hq, hk, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    c = lp.clips or (None,) * len(LINEARS)
    q = _rotate(_norm(_lin(x, lp.q, c[0], num).reshape(b, n, hq, d), lp.q_norm, eps), cos, sin)
    k = _rotate(_norm(_lin(x, lp.k, c[1], num).reshape(b, n, hk, d), lp.k_norm, eps), cos, sin)
    v = _norm(_lin(x, lp.v, c[2], num).reshape(b, n, hk, d), None, eps)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    outs = []
    for j0 in range(0, n, QUERY_BLOCK):
        j1 = min(n, j0 + QUERY_BLOCK)
        mask = mx.broadcast_to(keys[:, None, None, :], (b, 1, j1 - j0, n))
        outs.append(attention(q[:, j0:j1], k, v, mask, 1.0, num))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return _lin(out, lp.o, c[3], num)


def tower(p: Gemma4VisionParams, patches: Float[mx.array, "B N F"], positions: Int[mx.array, "B N 2"]
          ) -> Float[mx.array, "B N D"]:
    """The encoder's last hidden state [B, N, hidden] of images' patches [B, N, p * p * 3]
    (values in [0, 1]) at their (x, y) positions [B, N, 2]; a position of (-1, -1) marks a
    padding patch (never attended to; its output is meaningless)."""
    cfg, num = p.config, p.numerics
    dt = getattr(mx, p.dtype)
    eps = cfg.rms_norm_eps
    pad = mx.all(positions < 0, axis=-1)  # [B, N]
    at = mx.maximum(positions, 0)
    x = linear((2 * (patches.astype(mx.float32) - 0.5)).astype(dt), p.patch, num)
    pos = p.positions[0][at[..., 0]] + p.positions[1][at[..., 1]]
    x = x + mx.where(pad[..., None], mx.zeros((), pos.dtype), pos)
    cos, sin = rotary(cfg, at, dt)
    keys = mx.logical_not(pad)
    for lp in p.layers:
        x = x + _norm(_attention(_norm(x, lp.input_norm, eps), lp, cfg, cos, sin, keys, num), lp.post_attn_norm, eps)
        c = lp.clips or (None,) * len(LINEARS)
        y = _norm(x, lp.pre_ff_norm, eps)
        y = _lin(gelu_tanh(_lin(y, lp.gate, c[4], num)) * _lin(y, lp.up, c[5], num), lp.down, c[6], num)
        x = x + _norm(y, lp.post_ff_norm, eps)
    return x


def pool_index(height: int, width: int, k: int, tokens: int | None = None) -> np.ndarray:
    """int32 [M, k * k]: the patches (row-major index into an image's height x width patch
    grid) averaged into each soft token, tokens row-major over the (height / k) x
    (width / k) grid; padded to `tokens` rows (gathering patch 0: dropped)."""
    th, tw = height // k, width // k
    blocks = (np.arange(th)[:, None] * k * width + np.arange(tw)[None, :] * k).reshape(-1)
    inner = (np.arange(k)[:, None] * width + np.arange(k)[None, :]).reshape(-1)
    out = np.zeros((th * tw if tokens is None else tokens, k * k), np.int32)
    out[:th * tw] = blocks[:, None] + inner[None, :]
    return out


def project(p: Gemma4VisionParams, feats: Float[mx.array, "B N D"], pool: Int[mx.array, "M K"]
            ) -> Float[mx.array, "B M H"]:
    """The pooler and the embedder: patch features -> soft-token embeddings [B, M, text hidden]."""
    cfg, dt = p.config, getattr(mx, p.dtype)
    # (the mean in float32, rounded to the working dtype, scaled and standardized in float32:
    # Hugging Face's Gemma4VisionPooler and Gemma4VisionModel, step for step)
    x = feats.astype(mx.float32)[:, pool].mean(axis=2).astype(dt).astype(mx.float32) * (cfg.hidden_size ** 0.5)
    if p.std_bias is not None:
        x = (x - p.std_bias) * p.std_scale
    x = x.astype(dt)
    return linear(_norm(x, None, cfg.rms_norm_eps), p.projection, p.numerics)


def positions_of(height: int, width: int) -> np.ndarray:
    """int32 [height * width, 2]: the (x, y) of each patch of a height x width grid, row-major."""
    gx, gy = np.meshgrid(np.arange(width), np.arange(height), indexing="xy")
    return np.stack([gx, gy], axis=-1).reshape(-1, 2).astype(np.int32)


def _check(p: Gemma4VisionParams, patches: Any, grid: tuple[int, int]) -> tuple[int, int]:
    cfg = p.config
    h, w = (int(g) for g in grid)
    k = cfg.pooling_kernel_size
    if h <= 0 or w <= 0 or h % k or w % k:
        raise ValueError(f"Gemma 4: a patch grid of {h} x {w} does not pool into whole {k} x {k} blocks")
    if max(h, w) > cfg.position_embedding_size:
        raise ValueError(f"Gemma 4: a patch grid of {h} x {w} exceeds the position table "
                         f"({cfg.position_embedding_size})")
    if patches.ndim != 2 or tuple(patches.shape) != (h * w, cfg.patch_features):
        raise ValueError(f"Gemma 4: patches must be [{h * w}, {cfg.patch_features}] for a {h} x {w} grid, "
                         f"got {list(patches.shape)}")
    return h, w


def encode_image(p: Gemma4VisionParams, patches: Float[mx.array, "N F"], grid: tuple[int, int]
                 ) -> Float[mx.array, "M H"]:
    """One image's soft-token embeddings [(h / k) * (w / k), text hidden] from its patches
    [h * w, p * p * 3] (row-major over the h x w patch grid, values in [0, 1]); eager,
    unpadded."""
    h, w = _check(p, patches, grid)
    feats = tower(p, patches[None], mx.array(positions_of(h, w))[None])
    return project(p, feats, mx.array(pool_index(h, w, p.config.pooling_kernel_size)))[0]


def _encode(p: Gemma4VisionParams, patches: mx.array, positions: mx.array, pool: mx.array) -> mx.array:
    return project(p, tower(p, patches, positions), pool)


_compiled = CompiledFunction(_encode, name="encode_images_gemma4")


def encode_image_compiled(p: Gemma4VisionParams, patches: Float[mx.array, "N F"], grid: tuple[int, int]
                          ) -> Float[mx.array, "M H"]:
    """`encode_image` compiled and bucketed: the patches padded to a size bucket of their
    count (padding at position (-1, -1): never a key) and the soft tokens to one of theirs
    (dropped), so one trace serves every image size in a bucket."""
    h, w = _check(p, patches, grid)
    k = p.config.pooling_kernel_size
    n, m = h * w, (h // k) * (w // k)
    nb, mb = size_bucket(n), size_bucket(m)
    pos = np.full((nb, 2), -1, np.int32)
    pos[:n] = positions_of(h, w)
    x = mx.pad(patches, ((0, nb - n), (0, 0)))
    return _compiled(p, x[None], mx.array(pos)[None], mx.array(pool_index(h, w, k, mb)))[0, :m]


def image_tokens(cfg: Gemma4VisionConfig, grid: tuple[int, int]) -> int:
    """The soft tokens of an image whose patch grid is `grid` (rows, columns)."""
    k = cfg.pooling_kernel_size
    return (grid[0] // k) * (grid[1] // k)


def image_token_runs(tokens: Sequence[int] | np.ndarray, cfg: Gemma4VisionConfig,
                     counts: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The [start, end) spans of the soft-token runs of a token sequence, checked: each run
    between a start-of-image and an end-of-image token and (given `counts`, one per image)
    of its image's length. ValueError naming the position otherwise."""
    t = np.asarray(tokens).reshape(-1)
    edges = np.diff(np.concatenate([[0], (t == cfg.image_token_index).astype(np.int8), [0]]))
    spans = list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))
    for a, b in spans:
        if a == 0 or t[a - 1] != cfg.boi_token_index or b == len(t) or t[b] != cfg.eoi_token_index:
            raise ValueError(f"image tokens at positions {a}..{b - 1} are not between a start-of-image "
                             f"({cfg.boi_token_index}) and an end-of-image ({cfg.eoi_token_index}) token")
    if counts is not None and [b - a for a, b in spans] != list(counts):
        raise ValueError(f"the prompt's image-token runs ({[b - a for a, b in spans]}) do not match the images' "
                         f"soft tokens ({list(counts)})")
    return spans
