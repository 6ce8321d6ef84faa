"""The SigLIP vision tower (`siglip_vision_model`), as Gemma 3 uses it, as one pure forward.

Architecture (Hugging Face's SiglipVisionTransformer; mlx-vlm's gemma3 `VisionModel`):
non-overlapping p x p patches, each flattened and projected (the patch "conv", here a
matmul over the flattened patches), plus one learned position embedding per patch (no
class token, no interpolation: the image is the configured size); then pre-norm encoder
layers, each x + attn(LN1(x)) followed by x + fc2(gelu_tanh(fc1(LN2(x)))), the attention
bidirectional over every patch (no mask) with biases on q, k, v and out, scale
head_dim^-0.5; then a final LayerNorm (`post_layernorm`). The attention-pooling head
(`vision_use_head`) is not run: Gemma 3 reads the last hidden state.

Layouts:
* pixels: [B, C, H, W], channels first (as Hugging Face's image processors return
  `pixel_values` and as mlx-vlm's Gemma 3 `Model` takes them), H = W = image_size,
  already resized / rescaled / normalized (fx_engine/loading/images.py).
* output: [B, N, hidden], N = (image_size / patch_size)^2 patches in row-major order
  (patch (r, c) at r * side + c), as the conv's flatten(2).transpose(1, 2) orders them.
* the patch projection: a `Linear` [C * p * p -> hidden] whose inputs are in (channel,
  row, column) order: Hugging Face's conv weight [hidden, C, p, p] flattened, or
  mlx-vlm's converted [hidden, p, p, C] transposed back.

Tensor names (under the tower's prefix, e.g. `vision_tower.vision_model.`):
embeddings.patch_embedding.{weight,bias}, embeddings.position_embedding.weight,
encoder.layers.{i}.{layer_norm1,layer_norm2}.{weight,bias},
encoder.layers.{i}.self_attn.{q,k,v,out}_proj.{weight,bias},
encoder.layers.{i}.mlp.{fc1,fc2}.{weight,bias}, post_layernorm.{weight,bias}. mlx-vlm's
conversions use the same names; only the patch weight's layout differs (channels last).
Linears may be MLX affine-quantized (`.scales` / `.biases`), as an mlx-community folder
that quantized its vision tower stores them; the patch projection (a conv in mlx-vlm,
which MLX does not quantize) is always dense.

One difference from mlx-vlm 0.7.10: its post_layernorm uses LayerNorm's default eps
(1e-5) instead of the config's layer_norm_eps; Hugging Face uses layer_norm_eps, and so
does this module (tests/models/test_vision_gemma3.py sets mlx-vlm's to the config's).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float

from fx_engine.core.checkpoint import (Fused, Lin, LoadOptions, Norm, Reader, TensorSource, TensorSpec, WeightsError,
                                       dequantized, read_tensors)
from fx_engine.core.config import FLOAT, POSITIVE, ConfigError, Field, read_fields
from fx_engine.core.nn import Linear, Numerics, attention, gelu_tanh, layer_norm, linear
from fx_engine.core.tree import static_field

#: vision_config model_types read as SigLIP (mlx-vlm also names Gemma 3's tower these;
#: Idefics3 / SmolVLM's tower is the same architecture: core/vision/idefics3.py)
MODEL_TYPES = ("siglip_vision_model", "gemma3_vision", "gemma3", "idefics3_vision", "idefics3", "smolvlm_vision")
#: hidden_act values computed as GELU's tanh form (mlx-vlm uses that form whatever it says)
TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_tanh")
#: query rows per attention block: bounds the score matrix of one block to
#: [B, heads, QUERY_BLOCK, patches] (Gemma 3's 4096 patches x 16 heads: 256 MB per image
#: in float32 instead of 1 GB for all queries at once)
QUERY_BLOCK = 1024


@attrs.frozen
class SiglipConfig:
    """A SigLIP vision tower's sizes (Hugging Face's SiglipVisionConfig fields)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int = 224
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    model_type: str = "siglip_vision_model"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def patch_features(self) -> int:
        """Inputs of the patch projection: C * p * p."""
        return self.num_channels * self.patch_size ** 2


# vision_config's fields (required: what mlx-vlm requires; defaults: SiglipVisionConfig's
# and mlx-vlm's, which agree)
_FIELDS = (
    Field("hidden_size"), Field("intermediate_size"), Field("num_hidden_layers", to="num_layers"),
    Field("num_attention_heads", to="num_heads"), Field("patch_size"), Field("image_size", POSITIVE, 224),
    Field("num_channels", POSITIVE, 3), Field("layer_norm_eps", FLOAT, 1e-6, null_default=True),
)


def config_from_hf(d: Any, source: str = "config.json: vision_config") -> SiglipConfig:
    """A SiglipConfig from a `vision_config` dict; ConfigError naming the field for what is
    missing, malformed or not implemented."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected an object, got {type(d).__name__}")
    mt = d.get("model_type", "siglip_vision_model")
    if mt not in MODEL_TYPES:
        raise ConfigError(f"{source}: field 'model_type' = {mt!r} is not supported (a SigLIP vision tower: "
                          f"{', '.join(MODEL_TYPES)})")
    act = d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in TANH_GELU:
        raise ConfigError(f"{source}: field 'hidden_act' = {act!r} is not supported ({', '.join(TANH_GELU)})")
    f = read_fields(d, _FIELDS, source)
    if not f["layer_norm_eps"] > 0:
        raise ConfigError(f"{source}: field 'layer_norm_eps' must be > 0, got {f['layer_norm_eps']!r}")
    if f["image_size"] % f["patch_size"]:
        raise ConfigError(f"{source}: image_size ({f['image_size']}) is not a multiple of patch_size "
                          f"({f['patch_size']})")
    if f["hidden_size"] % f["num_heads"]:
        raise ConfigError(f"{source}: hidden_size ({f['hidden_size']}) is not a multiple of num_attention_heads "
                          f"({f['num_heads']})")
    return SiglipConfig(model_type=mt, **f)


@attrs.frozen
class SiglipLayer:
    norm1: tuple[mx.array, mx.array]  # LayerNorm (weight, bias)
    qkv: Linear  # q | k | v rows, with their biases
    o: Linear
    norm2: tuple[mx.array, mx.array]
    fc1: Linear
    fc2: Linear


@attrs.frozen
class SiglipParams:
    patch: Linear  # [C * p * p -> hidden], inputs in (channel, row, column) order, with bias
    position: mx.array  # [num_patches, hidden]
    layers: tuple[SiglipLayer, ...]
    post_norm: tuple[mx.array, mx.array]
    config: SiglipConfig = static_field()
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")


_LAYER = (
    Norm("norm1", "layer_norm1"),
    Fused("qkv", (("self_attn.q_proj", "hidden_size"), ("self_attn.k_proj", "hidden_size"),
                  ("self_attn.v_proj", "hidden_size")), "hidden_size", bias=True),
    Lin("o", "self_attn.out_proj", "hidden_size", "hidden_size", bias=True),
    Norm("norm2", "layer_norm2"),
    Lin("fc1", "mlp.fc1", "intermediate_size", "hidden_size", bias=True),
    Lin("fc2", "mlp.fc2", "hidden_size", "intermediate_size", bias=True),
)


def tensor_prefix(src: TensorSource, prefixes: tuple[str, ...], probe: str, what: str, where: str) -> str:
    """The first of `prefixes` under which the checkpoint holds `probe` (where a tower's or
    projector's tensors live: Hugging Face's or mlx-vlm's names); a WeightsError naming
    `what` and the names looked for when none does. (The image towers' shared helper.)"""
    for p in prefixes:
        if src.has(p + probe):
            return p
    raise WeightsError(f"{where}: no {what} tensors (looked for {', '.join(repr(p + probe) for p in prefixes)})")


def _patch_weight(cfg: SiglipConfig, src: TensorSource, name: str, where: str) -> mx.array:
    """The patch conv's weight as [hidden, C * p * p] in (channel, row, column) order, from
    Hugging Face's [hidden, C, p, p] or mlx-vlm's converted [hidden, p, p, C]."""
    if src.has(name[: -len(".weight")] + ".scales"):
        raise WeightsError(f"{src.origin.get(name, where)}: '{name}' is quantized; a quantized patch "
                           "embedding is not supported")
    w = src.get(name, None, where)
    h, c, p = cfg.hidden_size, cfg.num_channels, cfg.patch_size
    hf, mlx = (h, c, p, p), (h, p, p, c)
    shape = tuple(w.shape)
    if hf == mlx:
        raise WeightsError(f"{src.origin[name]}: '{name}' {shape}: with num_channels == patch_size the "
                           "channels-first and channels-last layouts cannot be told apart")
    if shape == mlx:
        w = w.transpose(0, 3, 1, 2)
    elif shape != hf:
        raise WeightsError(f"{src.origin[name]}: tensor '{name}' has shape {shape}, expected {hf} "
                           f"(Hugging Face) or {mlx} (mlx-vlm)")
    return w.reshape(h, c * p * p)


def assemble(cfg: SiglipConfig, src: TensorSource, opts: LoadOptions, prefix: str) -> SiglipParams:
    """The tower's params from the tensors under `prefix` (e.g. "vision_tower.vision_model.")."""
    rd = Reader(src, opts)
    h = cfg.hidden_size
    patch_name = prefix + "embeddings.patch_embedding"
    patch = Linear(weight=_patch_weight(cfg, src, patch_name + ".weight", opts.where),
                   bias=src.get(patch_name + ".bias", (h,), opts.where))
    pos = rd.raw(prefix + "embeddings.position_embedding", cfg.num_patches, h)
    layers = tuple(SiglipLayer(**read_tensors(rd, _LAYER, cfg, prefix + "encoder.layers.{i}.", i=i))
                   for i in range(cfg.num_layers))
    post = read_tensors(rd, (Norm("post_norm", "post_layernorm"),), cfg, prefix)["post_norm"]
    return SiglipParams(patch=rd.finish(patch), position=dequantized(pos, opts.dtype).weight, layers=layers,
                        post_norm=post, config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


def checkpoint_layout(cfg: SiglipConfig, prefix: str) -> dict[str, TensorSpec]:
    """The tower's tensors as Hugging Face stores them (names, shapes, and the spread of a
    tiny test model's random values)."""
    h, f, c, p = cfg.hidden_size, cfg.intermediate_size, cfg.num_channels, cfg.patch_size

    def S(*shape: int, scale: float = 0.1, center: float = 0.0) -> TensorSpec:
        return TensorSpec(tuple(shape), center=center, scale=scale)

    def norm(name: str) -> dict[str, TensorSpec]:
        return {name + ".weight": S(h, center=1.0), name + ".bias": S(h, scale=0.05)}

    out = {prefix + "embeddings.patch_embedding.weight": S(h, c, p, p, scale=0.15),
           prefix + "embeddings.patch_embedding.bias": S(h, scale=0.05),
           prefix + "embeddings.position_embedding.weight": S(cfg.num_patches, h, scale=0.3)}
    for i in range(cfg.num_layers):
        pre = f"{prefix}encoder.layers.{i}."
        out.update(norm(pre + "layer_norm1"))
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[pre + f"self_attn.{n}.weight"] = S(h, h, scale=0.15)
            out[pre + f"self_attn.{n}.bias"] = S(h, scale=0.05)
        out.update(norm(pre + "layer_norm2"))
        out[pre + "mlp.fc1.weight"] = S(f, h, scale=0.15)
        out[pre + "mlp.fc1.bias"] = S(f, scale=0.05)
        out[pre + "mlp.fc2.weight"] = S(h, f, scale=0.15)
        out[pre + "mlp.fc2.bias"] = S(h, scale=0.05)
    out.update(norm(prefix + "post_layernorm"))
    return out


def patchify(pixels: Float[mx.array, "B C H W"], patch: int) -> Float[mx.array, "B N F"]:
    """[B, C, H, W] -> [B, (H/p) * (W/p), C * p * p]: each patch flattened in (channel, row,
    column) order, patches row-major (the conv's output order)."""
    b, c, hh, ww = pixels.shape
    gh, gw = hh // patch, ww // patch
    x = pixels.reshape(b, c, gh, patch, gw, patch).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, gh * gw, c * patch * patch)


def _attention(x: mx.array, lp: SiglipLayer, cfg: SiglipConfig, num: Numerics) -> mx.array:
    b, n, _ = x.shape
    hq, d = cfg.num_heads, cfg.head_dim
    q, k, v = mx.split(linear(x, lp.qkv, num), 3, axis=-1)
    q = q.reshape(b, n, hq, d)
    k = k.reshape(b, n, hq, d).transpose(0, 2, 1, 3)
    v = v.reshape(b, n, hq, d).transpose(0, 2, 1, 3)
    outs = []
    for j0 in range(0, n, QUERY_BLOCK):  # every query sees every patch
        j1 = min(n, j0 + QUERY_BLOCK)
        mask = mx.broadcast_to(mx.array(True), (b, 1, j1 - j0, n))
        outs.append(attention(q[:, j0:j1], k, v, mask, d ** -0.5, num))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return linear(out, lp.o, num)


def forward(p: SiglipParams, pixels: Float[mx.array, "B C H W"]) -> Float[mx.array, "B N D"]:
    """Patch features [B, num_patches, hidden] (after post_layernorm) of pixels [B, C, H, W]
    (H = W = image_size), in the params' dtype."""
    cfg, num = p.config, p.numerics
    want = (cfg.num_channels, cfg.image_size, cfg.image_size)
    if pixels.ndim != 4 or tuple(pixels.shape[1:]) != want:
        raise ValueError(f"SigLIP: pixels must be [B, {want[0]}, {want[1]}, {want[2]}] (channels first), "
                         f"got {list(pixels.shape)}")
    dt = getattr(mx, p.dtype)
    eps = cfg.layer_norm_eps
    x = linear(patchify(pixels.astype(dt), cfg.patch_size), p.patch, num) + p.position
    for lp in p.layers:
        x = x + _attention(layer_norm(x, *lp.norm1, eps), lp, cfg, num)
        x = x + linear(gelu_tanh(linear(layer_norm(x, *lp.norm2, eps), lp.fc1, num)), lp.fc2, num)
    return layer_norm(x, *p.post_norm, eps)
