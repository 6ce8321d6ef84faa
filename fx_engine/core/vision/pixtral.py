"""Mistral 3's image path (config.json model_type `mistral3`: Mistral-Small-3.1 / 3.2
-24B-Instruct): the Pixtral vision tower, the multimodal projector with its patch merger,
and the prompt's image-token layout (a Mistral / Ministral 3 text model:
core/models/llama.py's `mistral3` wrapper).

Tower (transformers 5.x modeling_pixtral.PixtralVisionModel; mlx-vlm 0.7.10
mlx_vlm/models/pixtral/vision.py `PixtralVisionModel`), one image of any size whose sides
are multiples of patch_size (the processor makes them multiples of patch_size *
spatial_merge_size):

* patches: a conv with kernel = stride = patch_size, no bias (one matmul over each patch
  flattened in (channel, row, column) order; Hugging Face stores it [hidden, C, p, p],
  mlx-vlm's conversions [hidden, p, p, C]: both read). Patches row-major, gh x gw.
* ln_pre: RMSNorm, eps 1e-5 (hard-coded in Hugging Face; mlx-vlm's nn.RMSNorm default).
* 2-D rotary ("axial"): inv_freq = 1 / rope_theta^(2j / head_dim), j < head_dim / 2; the
  patch at (row r, column c) rotates by angles [r * inv_freq[0::2] | c * inv_freq[1::2]]
  repeated twice (rotate-half style over the whole head).
* layers: x + o(attn(RMSNorm(x))), then x + down(act(gate(y)) * up(y)) with y =
  RMSNorm(x) (both eps 1e-5); no biases; attention bidirectional over the image's patches
  (the block mask of a batch of images: each attends to itself only), scale
  head_dim^-0.5. act: vision_config.hidden_act (Mistral's folders: silu; mlx-vlm always
  uses silu, Hugging Face the config's: here silu or gelu).
* output: the hidden state `vision_feature_layer` (-1: the last layer's; k: after k
  layers, 0 being ln_pre's output), no final norm.

Projector (Mistral3MultiModalProjector): RMSNorm over the tower's hidden (eps: the text
model's rms_norm_eps), then the patch merger: the gh x gw grid's 2 x 2 blocks (m =
spatial_merge_size; trailing odd rows / columns dropped, as torch's unfold does) each
flattened in (channel, block row, block column) order into one [hidden * m * m] row,
blocks row-major, `merging_layer` [hidden * m^2 -> hidden] (no bias); then linear_1
[hidden -> text hidden], GELU (exact), linear_2 [text hidden -> text hidden] (biases where
multimodal_projector_bias). Result: [(gh / m) * (gw / m), text_hidden] per image, one row
per image token.

Prompt (transformers' PixtralProcessor, which Mistral 3 folders name; mlx-vlm's
Mistral3Processor does the same): the chat template writes "[IMG]" per image; the
processor replaces it with, for an image of H x W pixels after preprocessing (h = H /
(patch_size * m) rows, w = W / (patch_size * m) columns of image tokens), h rows of
"[IMG]" * w each followed by "[IMG_BREAK]", the last row's break replaced by "[IMG_END]".
The image rows take the `image_token_index` positions in order (row-major); the break /
end tokens are ordinary text embeddings. The text model is causal throughout (no
image-token attention rule: `ImageInput.bidirectional` is moot). `prompt_ids` lays one
image out given the break and end token ids (the tokenizer's: config.json does not name
them); `image_token_runs` finds its runs (one per row of image tokens).

Tensor names (under the tower's prefix: `vision_tower.` before transformers 4.52,
`model.vision_tower.` after, `vision_tower.vision_model.` in mlx-vlm's conversions):
patch_conv.weight, ln_pre.weight, transformer.layers.{i}.attention_norm.weight,
transformer.layers.{i}.attention.{q,k,v,o}_proj.weight, transformer.layers.{i}.ffn_norm.weight,
transformer.layers.{i}.feed_forward.{gate,up,down}_proj.weight; the projector's (under
`multi_modal_projector.` or `model.multi_modal_projector.`): norm.weight,
patch_merger.merging_layer.weight, linear_1.{weight,bias}, linear_2.{weight,bias}. Linears
may be MLX affine-quantized (.scales / .biases); the patch conv is always dense.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import mlx.core as mx
import numpy as np
from jaxtyping import Float

from fx_engine.core.checkpoint import Fused, Lin, LoadOptions, Reader, TensorSource, TensorSpec, Vec, read_tensors
from fx_engine.core.config import ConfigError
from fx_engine.core.nn import Linear, Numerics, attention, gelu, linear, rms_norm
from fx_engine.core.tree import CompiledFunction, static_field
from fx_engine.core.buckets import size_bucket
from fx_engine.core.vision.siglip import _patch_weight, tensor_prefix as _prefix

MODEL_TYPES = ("mistral3",)
#: the tower's tensors: mlx-vlm's conversions, transformers >= 4.52, earlier transformers
TOWER_PREFIXES = ("vision_tower.vision_model.", "model.vision_tower.", "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
#: the processor's strings (tokens of Mistral's tokenizer)
PLACEHOLDER, BREAK_TEXT, END_TEXT = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
#: the tower's RMSNorm eps (Hugging Face hard-codes it)
TOWER_EPS = 1e-5
#: hidden_act values of the tower's gated MLP
ACTS = ("silu", "gelu")
#: query rows per attention block: bounds one block's scores to [heads, QUERY_BLOCK, patches]
#: (a 1540-pixel image: 110 x 110 patches, 16 heads: ~400 MB a block in float32)
QUERY_BLOCK = 512


@attrs.frozen
class PixtralConfig:
    """What Mistral 3's image path reads from config.json (the tower: vision_config; the
    projector and the image token: top level; the text model's hidden size and eps)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int  # the layers run: up to vision_feature_layer
    num_heads: int
    patch_size: int
    text_hidden_size: int
    image_size: int = 1024  # the tower's largest side (informative: the rotary needs no table)
    num_channels: int = 3
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    text_rms_norm_eps: float = 1e-5
    spatial_merge_size: int = 2
    projector_bias: bool = False
    image_token_index: int = 10
    model_type: str = "mistral3"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def factor(self) -> int:
        """Pixels a side of one image token (patch_size * spatial_merge_size)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def placeholder(self) -> str:
        return PLACEHOLDER

    def token_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of image tokens of a preprocessed H x W image."""
        return height // self.factor, width // self.factor


def _int(d: dict[str, Any], key: str, default: int | None, source: str, minimum: int = 1) -> int:
    v = d.get(key)
    if v is None:
        if default is None:
            raise ConfigError(f"{source}: field '{key}' is missing")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{source}: field '{key}' must be an integer >= {minimum}, got {v!r}")
    return v


def _float(d: dict[str, Any], key: str, default: float, source: str) -> float:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ConfigError(f"{source}: field '{key}' must be a positive number, got {v!r}")
    return float(v)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> PixtralConfig:
    """Mistral 3's image-path config from its config.json dict; ConfigError naming the field
    for what is missing, malformed or not implemented."""
    if d.get("model_type") not in MODEL_TYPES:
        raise ConfigError(f"{source}: model_type {d.get('model_type')!r} is not Mistral 3's ({', '.join(MODEL_TYPES)})")
    text, vision = d.get("text_config"), d.get("vision_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: field 'text_config' is missing or not an object")
    if not isinstance(vision, dict):
        raise ConfigError(f"{source}: field 'vision_config' is missing or not an object")
    vs = f"{source}: vision_config"
    if vision.get("model_type", "pixtral") != "pixtral":
        raise ConfigError(f"{vs}: field 'model_type' = {vision.get('model_type')!r} is not supported (pixtral)")
    hidden = _int(vision, "hidden_size", 1024, vs)
    heads = _int(vision, "num_attention_heads", 16, vs)
    if hidden % heads:
        raise ConfigError(f"{vs}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
    head_dim = vision.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise ConfigError(f"{vs}: head_dim ({head_dim}) is not hidden_size / num_attention_heads ({hidden // heads}), "
                          "which the attention uses")
    if (hidden // heads) % 4:
        raise ConfigError(f"{vs}: head_dim {hidden // heads} is not a multiple of 4 (the 2-D rotary's halves)")
    layers = _int(vision, "num_hidden_layers", 24, vs)
    act = vision.get("hidden_act") or "gelu"
    if act not in ACTS:
        raise ConfigError(f"{vs}: field 'hidden_act' = {act!r} is not supported ({', '.join(ACTS)})")
    rope = vision.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{vs}: field 'rope_parameters' must be an object, got {rope!r}")
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ConfigError(f"{vs}: rope_parameters.rope_type {rope.get('rope_type')!r} is not supported (axial)")
    theta = _float({"rope_theta": vision.get("rope_theta", rope.get("rope_theta"))}, "rope_theta", 10000.0, vs)
    channels = _int(vision, "num_channels", 3, vs)
    if channels != 3:
        raise ConfigError(f"{vs}: num_channels = {channels} is not supported (3)")
    feature = d.get("vision_feature_layer", -1)
    if isinstance(feature, bool) or not isinstance(feature, int) or not -(layers + 1) <= feature <= layers:
        raise ConfigError(f"{source}: field 'vision_feature_layer' must be one layer index in "
                          f"[-{layers + 1}, {layers}] (several layers are not supported), got {feature!r}")
    act_p = d.get("projector_hidden_act") or "gelu"
    if act_p != "gelu":
        raise ConfigError(f"{source}: field 'projector_hidden_act' = {act_p!r} is not supported (gelu)")
    bias = d.get("multimodal_projector_bias", False)
    if not isinstance(bias, bool):
        raise ConfigError(f"{source}: field 'multimodal_projector_bias' must be true or false, got {bias!r}")
    found = {k: d[k] for k in ("image_token_index", "image_token_id") if d.get(k) is not None}
    for k, v in found.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{source}: field '{k}' must be a token id (an integer >= 0), got {v!r}")
    if len(set(found.values())) > 1:
        raise ConfigError(f"{source}: fields 'image_token_index' and 'image_token_id' disagree ({found})")
    return PixtralConfig(
        hidden_size=hidden, intermediate_size=_int(vision, "intermediate_size", 4096, vs),
        num_layers=feature if feature >= 0 else layers + 1 + feature, num_heads=heads,
        patch_size=_int(vision, "patch_size", 16, vs), text_hidden_size=_int(text, "hidden_size", None,
                                                                           f"{source}: text_config"),
        image_size=_int(vision, "image_size", 1024, vs), num_channels=channels, rope_theta=theta, hidden_act=act,
        text_rms_norm_eps=_float(text, "rms_norm_eps", 1e-5, f"{source}: text_config"),
        spatial_merge_size=_int(d, "spatial_merge_size", 2, source), projector_bias=bias,
        image_token_index=next(iter(found.values()), 10))


@attrs.frozen
class PixtralLayer:
    attention_norm: mx.array
    qkv: Linear  # q | k | v rows, no bias
    o: Linear
    ffn_norm: mx.array
    gate_up: Linear  # gate | up rows
    down: Linear


@attrs.frozen
class PixtralParams:
    patch: Linear  # [C * p * p -> hidden], inputs in (channel, row, column) order, no bias
    ln_pre: mx.array
    layers: tuple[PixtralLayer, ...]
    norm: mx.array  # the projector's RMSNorm
    merge: Linear  # [hidden * m^2 -> hidden]
    linear_1: Linear
    linear_2: Linear
    config: PixtralConfig = static_field()
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")


_LAYER = (
    Vec("attention_norm", "attention_norm.weight", "hidden_size"),
    Fused("qkv", (("attention.q_proj", "hidden_size"), ("attention.k_proj", "hidden_size"),
                  ("attention.v_proj", "hidden_size")), "hidden_size"),
    Lin("o", "attention.o_proj", "hidden_size", "hidden_size"),
    Vec("ffn_norm", "ffn_norm.weight", "hidden_size"),
    Fused("gate_up", (("feed_forward.gate_proj", "intermediate_size"), ("feed_forward.up_proj", "intermediate_size")),
          "hidden_size"),
    Lin("down", "feed_forward.down_proj", "hidden_size", "intermediate_size"),
)


def is_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the image path (tower or projector)."""
    return name.startswith(TOWER_PREFIXES + PROJECTOR_PREFIXES)


def assemble(cfg: PixtralConfig, src: TensorSource, opts: LoadOptions) -> PixtralParams:
    """The image path's params from a checkpoint's tensors (any prefix of TOWER_PREFIXES /
    PROJECTOR_PREFIXES; the layers past vision_feature_layer are not read)."""
    rd = Reader(src, opts)
    pre = _prefix(src, TOWER_PREFIXES, "patch_conv.weight", "vision tower", opts.where)
    patch = Linear(weight=_patch_weight(cfg, src, pre + "patch_conv.weight", opts.where))
    layers = tuple(PixtralLayer(**read_tensors(rd, _LAYER, cfg, pre + "transformer.layers.{i}.", i=i))
                   for i in range(cfg.num_layers))
    pp = _prefix(src, PROJECTOR_PREFIXES, "linear_1.weight", "multimodal projector", opts.where)
    h, ht, m = cfg.hidden_size, cfg.text_hidden_size, cfg.spatial_merge_size
    return PixtralParams(
        patch=rd.finish(patch), ln_pre=rd.vec(pre + "ln_pre.weight", h), layers=layers,
        norm=rd.vec(pp + "norm.weight", h), merge=rd.linear(pp + "patch_merger.merging_layer", h, h * m * m),
        linear_1=rd.linear(pp + "linear_1", ht, h, cfg.projector_bias),
        linear_2=rd.linear(pp + "linear_2", ht, ht, cfg.projector_bias),
        config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


def checkpoint_layout(cfg: PixtralConfig, tower: str = "model.vision_tower.",
                      projector: str = "model.multi_modal_projector.") -> dict[str, TensorSpec]:
    """The image path's tensors under Hugging Face's names (transformers >= 4.52's by
    default), with a tiny test model's spread of random values."""
    h, f, c, p, ht, m = (cfg.hidden_size, cfg.intermediate_size, cfg.num_channels, cfg.patch_size,
                         cfg.text_hidden_size, cfg.spatial_merge_size)

    def S(*shape: int, scale: float = 0.1, center: float = 0.0) -> TensorSpec:
        return TensorSpec(tuple(shape), center=center, scale=scale)

    out = {tower + "patch_conv.weight": S(h, c, p, p, scale=0.15), tower + "ln_pre.weight": S(h, center=1.0)}
    for i in range(cfg.num_layers):
        pre = f"{tower}transformer.layers.{i}."
        out[pre + "attention_norm.weight"] = S(h, center=1.0)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[pre + f"attention.{n}.weight"] = S(h, h, scale=0.15)
        out[pre + "ffn_norm.weight"] = S(h, center=1.0)
        out[pre + "feed_forward.gate_proj.weight"] = S(f, h, scale=0.15)
        out[pre + "feed_forward.up_proj.weight"] = S(f, h, scale=0.15)
        out[pre + "feed_forward.down_proj.weight"] = S(h, f, scale=0.15)
    out[projector + "norm.weight"] = S(h, center=1.0)
    out[projector + "patch_merger.merging_layer.weight"] = S(h, h * m * m, scale=0.1)
    out[projector + "linear_1.weight"] = S(ht, h, scale=0.15)
    out[projector + "linear_2.weight"] = S(ht, ht, scale=0.15)
    if cfg.projector_bias:
        out[projector + "linear_1.bias"] = S(ht, scale=0.05)
        out[projector + "linear_2.bias"] = S(ht, scale=0.05)
    return out


def rotary(cfg: PixtralConfig, gh: int, gw: int) -> tuple[mx.array, mx.array]:
    """(cos, sin) [gh * gw, head_dim] float32 of the patches of a gh x gw grid (row-major)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
    inv = inv.astype(np.float32)
    rows = np.repeat(np.arange(gh, dtype=np.float32), gw)
    cols = np.tile(np.arange(gw, dtype=np.float32), gh)
    ang = np.concatenate([rows[:, None] * inv[None, 0::2], cols[:, None] * inv[None, 1::2]], axis=1)
    ang = mx.array(np.concatenate([ang, ang], axis=1))
    return mx.cos(ang), mx.sin(ang)


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    rot = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def patchify(pixels: Float[mx.array, "B C H W"], patch: int) -> Float[mx.array, "B N F"]:
    """[B, C, H, W] -> [B, (H/p) * (W/p), C * p * p] (the conv's row-major patches)."""
    b, c, hh, ww = pixels.shape
    gh, gw = hh // patch, ww // patch
    x = pixels[:, :, :gh * patch, :gw * patch].reshape(b, c, gh, patch, gw, patch).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, gh * gw, c * patch * patch)


def _attention(x: mx.array, lp: PixtralLayer, cfg: PixtralConfig, cos: mx.array, sin: mx.array,
               keys: mx.array, num: Numerics) -> mx.array:
    """Every patch attends to every valid patch of its image; keys: bool [N] (padding False)."""
    b, n, _ = x.shape
    hq, d = cfg.num_heads, cfg.head_dim
    q, k, v = mx.split(linear(x, lp.qkv, num), 3, axis=-1)
    cq, sq = cos[None, :, None, :].astype(x.dtype), sin[None, :, None, :].astype(x.dtype)
    q = _rotate(q.reshape(b, n, hq, d), cq, sq)
    k = _rotate(k.reshape(b, n, hq, d), cq, sq).transpose(0, 2, 1, 3)
    v = v.reshape(b, n, hq, d).transpose(0, 2, 1, 3)
    outs = []
    for j0 in range(0, n, QUERY_BLOCK):
        j1 = min(n, j0 + QUERY_BLOCK)
        mask = mx.broadcast_to(keys[None, None, None, :], (b, 1, j1 - j0, n))
        outs.append(attention(q[:, j0:j1], k, v, mask, d ** -0.5, num))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return linear(out, lp.o, num)


def _patches(p: PixtralParams, pixels: mx.array) -> tuple[mx.array, int, int]:
    """Images [B, C, H, W] as patches [B, gh * gw, C * P * P] in the params' dtype, and the
    patch grid (gh, gw); a ValueError for a wrong shape or an image smaller than a patch."""
    cfg = p.config
    if pixels.ndim != 4 or pixels.shape[1] != cfg.num_channels:
        raise ValueError(f"Pixtral: pixels must be [B, {cfg.num_channels}, H, W] (channels first), "
                         f"got {list(pixels.shape)}")
    gh, gw = pixels.shape[2] // cfg.patch_size, pixels.shape[3] // cfg.patch_size
    if not gh or not gw:
        raise ValueError(f"Pixtral: a {pixels.shape[3]}x{pixels.shape[2]} image is smaller than one patch")
    return patchify(pixels.astype(getattr(mx, p.dtype)), cfg.patch_size), gh, gw


@attrs.frozen
class Geometry:
    """What the tower and projector need from an image size, as array inputs (so that a
    compiled encoder traces once per padded size, not per image size): the patches'
    rotary cos / sin [N, head_dim], which of the N (padded) patches are real (keys), and
    the merger's gather: [M, m * m] patch indexes of each merged token (row-major blocks,
    each block's patches row-major; padding tokens gather patch 0 and are dropped)."""

    cos: mx.array
    sin: mx.array
    keys: mx.array  # bool [N]
    merge: mx.array  # int32 [M, m * m]


def geometry(cfg: PixtralConfig, gh: int, gw: int, tokens: int | None = None, merged: int | None = None) -> Geometry:
    """The Geometry of a gh x gw patch grid, padded to `tokens` patches and `merged` image
    tokens (None: unpadded)."""
    n, m = gh * gw, cfg.spatial_merge_size
    h2, w2 = gh // m, gw // m
    tokens = n if tokens is None else tokens
    merged = h2 * w2 if merged is None else merged
    if tokens < n or merged < h2 * w2:
        raise ValueError(f"Pixtral: cannot pad {n} patches / {h2 * w2} image tokens to {tokens} / {merged}")
    cos, sin = rotary(cfg, gh, gw)
    pad = mx.zeros((tokens - n, cos.shape[1]), cos.dtype)
    blocks = (np.arange(h2)[:, None] * m * gw + np.arange(w2)[None, :] * m).reshape(-1)
    inner = (np.arange(m)[:, None] * gw + np.arange(m)[None, :]).reshape(-1)
    merge = np.zeros((merged, m * m), np.int32)
    merge[:h2 * w2] = blocks[:, None] + inner[None, :]
    return Geometry(cos=mx.concatenate([cos, pad]), sin=mx.concatenate([sin, pad]),
                    keys=mx.array(np.arange(tokens) < n), merge=mx.array(merge))


def _tower(p: PixtralParams, patches: Float[mx.array, "B N F"], geo: Geometry) -> Float[mx.array, "B N D"]:
    cfg, num = p.config, p.numerics
    x = rms_norm(linear(patches, p.patch, num), p.ln_pre, TOWER_EPS)
    act = mx.sigmoid if cfg.hidden_act == "silu" else None
    for lp in p.layers:
        x = x + _attention(rms_norm(x, lp.attention_norm, TOWER_EPS), lp, cfg, geo.cos, geo.sin, geo.keys, num)
        gu = linear(rms_norm(x, lp.ffn_norm, TOWER_EPS), lp.gate_up, num)
        g, u = mx.split(gu, 2, axis=-1)
        g = g * act(g) if act is not None else gelu(g)
        x = x + linear(g * u, lp.down, num)
    return x


def tower(p: PixtralParams, pixels: Float[mx.array, "B C H W"]) -> Float[mx.array, "B N D"]:
    """The tower's patch features [B, gh * gw, hidden] (the vision_feature_layer state) of
    images [B, C, H, W] of one size (each image attends to itself only)."""
    patches, gh, gw = _patches(p, pixels)
    return _tower(p, patches, geometry(p.config, gh, gw))


def merge_patches(feats: Float[mx.array, "B N D"], merge: Float[mx.array, "M K"]) -> Float[mx.array, "B M E"]:
    """The patch merger's unfold: [B, N, D] -> [B, M, D * m * m] through the Geometry's
    gather, each m x m block flattened in (channel, row, column) order, blocks row-major
    (torch's unfold: trailing odd rows / columns dropped)."""
    b, _, d = feats.shape
    x = feats[:, merge]  # [B, M, m * m, D]
    return x.transpose(0, 1, 3, 2).reshape(b, merge.shape[0], d * merge.shape[1])


def project(p: PixtralParams, feats: Float[mx.array, "B N D"], geo: Geometry) -> Float[mx.array, "B M H"]:
    """The multimodal projector: patch features -> image token embeddings."""
    cfg, num = p.config, p.numerics
    x = rms_norm(feats, p.norm, cfg.text_rms_norm_eps)
    x = linear(merge_patches(x, geo.merge), p.merge, num)
    return linear(gelu(linear(x, p.linear_1, num)), p.linear_2, num)


def _encode(p: PixtralParams, patches: Float[mx.array, "B N F"], geo: Geometry) -> Float[mx.array, "B M H"]:
    return project(p, _tower(p, patches, geo), geo)


def encode_images(p: PixtralParams, pixels: Float[mx.array, "N C H W"]) -> Float[mx.array, "N M H"]:
    """Images [N, 3, H, W] of one size (preprocessed, channels first) -> their token
    embeddings [N, (H / f) * (W / f), text_hidden], f = patch_size * spatial_merge_size,
    rows row-major, in the params' dtype (eager, unpadded)."""
    patches, gh, gw = _patches(p, pixels)
    return _encode(p, patches, geometry(p.config, gh, gw))


_compiled = CompiledFunction(_encode, name="encode_images_pixtral")


def encode_images_compiled(p: PixtralParams, pixels: Float[mx.array, "N C H W"]) -> Float[mx.array, "N M H"]:
    """`encode_images` compiled and bucketed by image size: the patches padded to a size
    bucket of their count and the image tokens to one of theirs (padding patches are never
    keys; padding tokens are dropped), so one trace serves every image size in the bucket."""
    cfg = p.config
    patches, gh, gw = _patches(p, pixels)
    m = cfg.spatial_merge_size
    merged = (gh // m) * (gw // m)
    tokens = size_bucket(gh * gw)
    patches = mx.pad(patches, ((0, 0), (0, tokens - gh * gw), (0, 0)))
    return _compiled(p, patches, geometry(cfg, gh, gw, tokens, size_bucket(merged)))[:, :merged]


def prompt_ids(cfg: PixtralConfig, rows: int, cols: int, break_id: int, end_id: int) -> list[int]:
    """One image's tokens (the processor's expansion of "[IMG]"): `rows` times
    ([image_token_index] * cols + [break_id]), the last break_id replaced by end_id."""
    out: list[int] = []
    for _ in range(rows):
        out += [cfg.image_token_index] * cols + [break_id]
    out[-1] = end_id
    return out


def image_token_runs(tokens: Sequence[int] | np.ndarray, cfg: PixtralConfig,
                     grids: Sequence[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """The [start, end) spans of the image-token runs of a token sequence (one per row of an
    image's tokens), checked against the images' token grids (rows, cols) when given: each
    image `rows` runs of `cols` tokens, in order. ValueError otherwise."""
    t = np.asarray(tokens).reshape(-1)
    edges = np.diff(np.concatenate([[0], (t == cfg.image_token_index).astype(np.int8), [0]]))
    spans = list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))
    if grids is not None:
        want = [c for r, c in grids for _ in range(r)]
        if len(spans) != len(want) or any(b - a != c for (a, b), c in zip(spans, want)):
            raise ValueError(f"the prompt's image tokens ({len(spans)} run(s) of "
                             f"{sorted({b - a for a, b in spans})} tokens) do not match the images' token grids "
                             f"{list(grids)} (rows x columns)")
    return spans
