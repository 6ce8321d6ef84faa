"""LFM2 (`lfm2`, Liquid AI) and LFM2-MoE (`lfm2_moe`): gated short convolutions and
attention, following mlx-lm 0.32's lfm2.py and lfm2_moe.py (the parity oracles).

Most layers are a gated short convolution instead of attention:

    B, C, x = split(in_proj(u), 3);   y = out_proj(C * causal_depthwise_conv(B * x))

with a kernel of `conv_L_cache` (K) taps and no activation. The conv's state is the last K - 1
rows of B * x: a recurrent cache entry of [K - 1, hidden] per row (`cache.RecState`), whose
size does not depend on the context. The other layers (`full_attn_idxs`) are the Llama
family's attention with per-head q/k RMSNorms (Qwen 3's), RoPE over the whole head. Every
layer has a SwiGLU MLP; the final norm is the checkpoint's `embedding_norm` (applied at the
end, despite its name), and the output head is always the tied embedding.

Padding positions (beyond a row's n_valid) enter the conv as zeros and the state is taken
after each row's last valid token, so rows at different positions and chunk sizes give the
same state as one token at a time. A verify step (`keep_steps`) keeps the state after every
position (the window ending there: a gather), and `cache.commit` selects per row.

LFM2-MoE (LFM2-8B-A1B, LFM2-24B-A2B) is the same decoder whose MLPs from layer
`num_dense_layers` on are routed experts (Hugging Face's Lfm2MoeSparseMoeBlock): sigmoid
scores, the top-k chosen by score + `expert_bias` (use_expert_bias), weighted by the
unbiased scores, renormalized over the k with 1e-6 in the sum (norm_topk_prob) and times
routed_scaling_factor: `blocks.grouped_route` with one group. Its dense MLPs are
`intermediate_size` wide as written (dense LFM2's 2/3 adjustment does not apply).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry, recurrent_entry
import fx_engine.core.models.llama as llama
from fx_engine.core.checkpoint import (GGUF_COMMON_NAMES, Embedding, Fused, Lin, LoadOptions, Reader, TensorSource,
                                       TensorSpec, Vec, WeightsError, read_experts, read_tensors, renamed)
from fx_engine.core.config import (BOOL, FLOAT, INT, POSITIVE, ConfigError, Field, Same, check_rope_scaling, gguf_hf_config,
                                   gguf_ints, gguf_value, listed_eos, positive_int, read_fields)
from fx_engine.core.models.blocks import (HF_LAYER, QKV, STACKED_EXPERT_NAMES, Experts, attention_sizes, decoder_layer,
                                          expert_stacks, mixture, rope_freqs, self_attention, swiglu_mlp)
from fx_engine.core.models.family import Family
from fx_engine.core.models.llama import LayerParams
from fx_engine.core.models.moe import MoEConfig, MoELayer, fused_hf_experts
from fx_engine.core.models.skeleton import PipelineStage, cut_layers
from fx_engine.core.models.ssm import conv_weight
from fx_engine.core.nn import Linear, Numerics, linear, rms_norm
from fx_engine.core.splits import (head_range, split, split_attention, split_cols, split_experts, split_head, split_mlp,
                                   split_rows)
from fx_engine.core.recurrent import causal_conv
from fx_engine.core.tree import static_field


@attrs.frozen
class Lfm2Config(MoEConfig):
    """Dense LFM2 has no routed layers (moe_layers empty); LFM2-MoE's routing fields are
    MoEConfig's (grouped_sigmoid with one group)."""

    conv_kernel: int = 3  # conv_L_cache: taps of the short convolution
    conv_bias: bool = False
    conv_layers: tuple[bool, ...] = ()  # per layer: a short convolution (else attention)
    conv_channels: int = 0  # a tensor-parallel shard's channels of each convolution (0: hidden_size)
    expert_bias: bool = False  # LFM2-MoE's use_expert_bias: the routed layers' selection bias


def _ff_dim(d: dict[str, Any], source: str) -> int:
    """mlx-lm's (and Hugging Face's) MLP width: block_ff_dim, shrunk to 2/3, scaled by
    block_ffn_dim_multiplier and rounded up to block_multiple_of when auto-adjusting."""
    ff = d.get("block_ff_dim") or d.get("intermediate_size")
    if not ff:
        raise ConfigError(f"{source}: field 'block_ff_dim' (or 'intermediate_size') is required")
    ff = int(ff)
    if d.get("block_auto_adjust_ff_dim", True):
        ff = int(2 * ff / 3)
        mult = d.get("block_ffn_dim_multiplier")
        if mult is not None:  # (Hugging Face's Lfm2MLP rounds only with a multiplier)
            ff = int(mult * ff)
            m = int(d.get("block_multiple_of", 256))
            ff = m * ((ff + m - 1) // m)
    return ff


# config.json's fields read as they are (`read_fields`, in this order), by Lfm2Config's names
_FIELDS = (
    Field("num_hidden_layers", to="num_layers"), Field("hidden_size"), Field("num_attention_heads", to="num_heads"),
    Field("num_key_value_heads", default=Same("num_heads"), or_default=True, to="num_kv_heads"),
    Field("conv_L_cache", default=3, to="conv_kernel"), Field("vocab_size"),
    Field("norm_eps", FLOAT, 1e-5, to="rms_norm_eps"), Field("max_position_embeddings", INT, 128000),
    Field("conv_bias", BOOL, False),
)


# LFM2-MoE's routing fields (Hugging Face's Lfm2MoeConfig defaults), by MoEConfig's names
_MOE_FIELDS = (
    Field("num_experts", POSITIVE, 32), Field("num_experts_per_tok", POSITIVE, 4, to="top_k"),
    Field("moe_intermediate_size", POSITIVE, 1792), Field("num_dense_layers", INT, 2),
    Field("norm_topk_prob", BOOL, True), Field("use_expert_bias", BOOL, True),
    Field("routed_scaling_factor", FLOAT, 1.0),
)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Lfm2Config:
    mt = d.get("model_type", "lfm2")
    f = read_fields(d, _FIELDS, source)
    layers, hidden = f["num_layers"], f["hidden_size"]
    attn = _attention_layers(d, layers, source)
    if d.get("block_dim", hidden) != hidden:
        raise ConfigError(f"{source}: block_dim != hidden_size is not supported")
    if f["conv_kernel"] < 2:
        raise ConfigError(f"{source}: conv_L_cache must be >= 2, got {f['conv_kernel']}")
    rope = d.get("rope_theta", 1_000_000.0)  # (lifted from rope_parameters by hf_config.normalize)
    head_dim = positive_int(d.get("head_dim") or hidden // f["num_heads"], "head_dim", source)  # (HF reads it)
    moe: dict[str, Any] = {"expert_bias": False}
    if mt == "lfm2_moe":
        m = read_fields(d, _MOE_FIELDS, source)
        if m["top_k"] > m["num_experts"]:
            raise ConfigError(f"{source}: num_experts_per_tok ({m['top_k']}) exceeds num_experts ({m['num_experts']})")
        dense = m.pop("num_dense_layers")
        if not 0 <= dense <= layers:
            raise ConfigError(f"{source}: num_dense_layers ({dense}) must be in [0, {layers}]")
        bias = m.pop("use_expert_bias")
        moe = {**m, "moe_layers": tuple(i >= dense for i in range(layers)), "grouped_sigmoid": True,
               "topk_norm_eps": 1e-6, "expert_bias": bias}
        ff = positive_int(d.get("intermediate_size", 7168), "intermediate_size", source)  # as written
    else:
        ff = _ff_dim(d, source)
    return Lfm2Config(
        model_type=mt, **f, head_dim=head_dim, intermediate_size=ff,
        rope_theta=float(rope), rope_scaling=check_rope_scaling(d.get("rope_scaling"), source),
        tie_word_embeddings=True, qk_norm=True, bos_token_id=d.get("bos_token_id"),
        eos_token_ids=listed_eos(d), conv_layers=tuple(i not in attn for i in range(layers)),
        **moe,
    )


def _attention_layers(d: dict[str, Any], layers: int, source: str) -> list[int]:
    """The layers that attend (the others convolve): full_attn_idxs, or layer_types'
    "full_attention" entries."""
    attn = d.get("full_attn_idxs")
    if attn is None:
        types = d.get("layer_types")
        if not isinstance(types, list) or len(types) != layers:
            raise ConfigError(f"{source}: 'full_attn_idxs' or 'layer_types' ({layers} entries) is required")
        if set(types) - {"conv", "full_attention"}:  # (no other kind exists: never read as something else)
            raise ConfigError(f"{source}: layer_types entries must be 'conv' or 'full_attention', got "
                              f"{sorted(set(map(str, types)) - {'conv', 'full_attention'})}")
        attn = [i for i, t in enumerate(types) if t == "full_attention"]
    if not attn or any(not isinstance(i, int) or not 0 <= i < layers for i in attn):
        raise ConfigError(f"{source}: full_attn_idxs must list at least one layer in [0, {layers})")
    return attn


@attrs.frozen
class ConvLayer:
    attn_norm: mx.array  # operator_norm
    in_proj: Linear  # [3 * hidden, hidden]: B, C, x
    conv_w: mx.array  # [hidden, K]: tap j multiplies the input j - K + 1 steps back
    conv_b: mx.array | None
    out_proj: Linear
    mlp_norm: mx.array
    gate_up: Linear | None = None  # None: routed experts
    down: Linear | None = None
    experts: Experts | None = None  # LFM2-MoE's routed layers


@attrs.frozen
class Lfm2Params:
    __fx_memo_flatten__ = True
    embed: Linear
    layers: tuple[Any, ...]  # ConvLayer | llama.LayerParams | moe.MoELayer (LFM2-MoE's routed attention layers)
    norm: mx.array  # embedding_norm (the final norm)
    config: Lfm2Config = static_field()
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")
    pipeline: PipelineStage | None = static_field(default=None)  # a stage's (core/parallel.stage_params)

    @property
    def lm_head(self) -> None:  # always tied
        return None

    @property
    def rope_freqs(self) -> mx.array | None:  # (the scaled periods, when the config scales RoPE)
        return rope_freqs(self.config)


def cache_specs(cfg: Lfm2Config) -> tuple[LayerSpec, ...]:
    """Conv layers: a recurrent entry (the last K - 1 rows of B * x); attention: dense K/V."""
    return tuple(LayerSpec(0, 0, state=((cfg.conv_kernel - 1, cfg.conv_channels or cfg.hidden_size),)) if conv
                 else LayerSpec(cfg.num_kv_heads, cfg.head_dim) for conv in cfg.conv_layers)


def short_conv(p: Lfm2Params, lp: ConvLayer, x: mx.array, entry: Any, spec: LayerSpec,
               geo: StepGeometry) -> tuple[mx.array, Any]:
    """The gated short convolution on normalized x [B*T, H] -> (out_proj output, entry)."""
    cfg, num = p.config, p.numerics
    b, t = geo.positions.shape
    hid = cfg.conv_channels or cfg.hidden_size
    bcx = linear(x, lp.in_proj, num).reshape(b, t, 3, hid)
    gate, c, v = bcx[:, :, 0], bcx[:, :, 1], bcx[:, :, 2]
    bx = mx.where(geo.valid[..., None], gate * v, 0.0)  # padding enters as zeros
    (state,) = entry.arrays
    conv, new, steps = causal_conv(bx, state, lp.conv_w, geo.n_valid, geo.keep_steps)
    if lp.conv_b is not None:
        conv = conv + lp.conv_b.astype(conv.dtype)
    y = linear((c * conv).reshape(b * t, hid), lp.out_proj, num)
    steps = None if steps is None else [steps.astype(state.dtype)]
    return y, recurrent_entry(spec, [new.astype(state.dtype)], steps, geo)


def _layer(p: Lfm2Params, lp: Any, h: mx.array, entry: Any, spec: LayerSpec, rope: Any,
           geo: StepGeometry) -> tuple[mx.array, Any]:
    experts = getattr(lp, "experts", None)
    if not isinstance(lp, ConvLayer) and experts is None:
        return decoder_layer(p, lp, h, entry, spec, rope, geo)
    cfg, num = p.config, p.numerics
    x = rms_norm(h, lp.attn_norm, cfg.rms_norm_eps, num)
    if isinstance(lp, ConvLayer):
        a, entry = short_conv(p, lp, x, entry, spec, geo)
    else:
        a, entry = self_attention(p, lp, x, entry, spec, rope, geo)
    h = h + a
    x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps, num)
    if experts is not None:
        return h + mixture(cfg, experts, x, num), entry
    return h + swiglu_mlp(x, lp.gate_up, lp.down, num), entry


def forward(p: Lfm2Params, cache: KVCache, tokens: mx.array, n_valid: mx.array,
            span: int | None = None) -> tuple[mx.array, KVCache]:
    """Same contract as `skeleton.decoder_step` (the Llama decoder, conv layers among its own)."""
    return llama.forward(p, cache, tokens, n_valid, span, layer_fn=_layer)


def hidden_to_logits(p: Lfm2Params, h: mx.array) -> mx.array:
    return llama.hidden_to_logits(p, h)


# Each layer's params from its tensors under model.layers.{i}. (`read_tensors`): a conv
# operator (its conv weight is `conv_weight`'s: either axis order) or Llama's attention with
# per-head q/k norms, then the MLP; the whole model's (the head is the embedding)
CONV = (
    Vec("attn_norm", "operator_norm.weight", "hidden_size"),
    Lin("in_proj", "conv.in_proj", "conv_in_width", "hidden_size", bias="conv_bias"),
    Vec("conv_b", "conv.conv.bias", "hidden_size", when="conv_bias"),
    Lin("out_proj", "conv.out_proj", "hidden_size", "hidden_size", bias="conv_bias"),
)
ATTENTION = (
    Vec("attn_norm", "operator_norm.weight", "hidden_size"),
    Fused("qkv", QKV, "hidden_size"),
    Lin("o", "self_attn.out_proj", "hidden_size", "q_width"),
    Vec("q_norm", "self_attn.q_layernorm.weight", "head_dim"),
    Vec("k_norm", "self_attn.k_layernorm.weight", "head_dim"),
)
MLP = (
    Vec("mlp_norm", "ffn_norm.weight", "hidden_size"),
    Fused("gate_up", (("feed_forward.w1", "intermediate_size"), ("feed_forward.w3", "intermediate_size")),
          "hidden_size"),
    Lin("down", "feed_forward.w2", "hidden_size", "intermediate_size"),
)
TOP = (Embedding("embed", "model.embed_tokens"), Vec("norm", "model.embedding_norm.weight", "hidden_size"))
# LFM2-MoE's per-expert Hugging Face names (gate, up, down) under feed_forward.; mlx-lm's
# conversions stack them as switch_mlp.* (`STACKED_EXPERT_NAMES`) and call the dense MLPs'
# w1 / w3 / w2 gate_proj / up_proj / down_proj (read back under Hugging Face's names)
HF_EXPERTS = ("experts.{e}.w1", "experts.{e}.w3", "experts.{e}.w2")
_MLX_MOE_NAMES = ((r"\.feed_forward\.gate_proj\.", ".feed_forward.w1."), (r"\.feed_forward\.up_proj\.", ".feed_forward.w3."),
                  (r"\.feed_forward\.down_proj\.", ".feed_forward.w2."))


def _experts(cfg: Lfm2Config, src: TensorSource, rd: Reader, opts: LoadOptions, i: int) -> Experts:
    """Layer i's routed experts: the router (feed_forward.gate), the stacks (one tensor per
    expert, transformers 5's fused gate_up_proj / down_proj, or mlx-lm's switch_mlp) and
    the selection bias (feed_forward.expert_bias, float32) where use_expert_bias."""
    e, f, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    b = HF_LAYER.format(i=i) + "feed_forward."
    if src.has(b + "experts.gate_up_proj"):
        gate, up, down = fused_hf_experts(src, b + "experts.", e, f, h, opts.where)
    else:
        gate, up, down = (read_experts(src, b + stacked, b + one, e, o, n, opts.quant_for, opts.where)
                          for stacked, one, (o, n) in zip(STACKED_EXPERT_NAMES, HF_EXPERTS, ((f, h), (f, h), (h, f))))
    bias = src.get(b + "expert_bias", (e,), opts.where).astype(mx.float32) if cfg.expert_bias else None
    return Experts(router=rd.linear(b + "gate", e, h), **expert_stacks(gate, up, down, opts), correction_bias=bias)


def assemble(cfg: Lfm2Config, src: TensorSource, opts: LoadOptions) -> Lfm2Params:
    if cfg.moe_layers and any(".feed_forward.gate_proj." in n for n in src.tensors):
        src = renamed(src, _MLX_MOE_NAMES)  # an mlx-lm conversion of LFM2-MoE
    rd, sizes = Reader(src, opts), {**attention_sizes(cfg), "conv_in_width": 3 * cfg.hidden_size}

    def layer(i: int, conv: bool) -> Any:
        routed = bool(cfg.moe_layers) and cfg.moe_layers[i]
        if routed:
            mlp = {**read_tensors(rd, MLP[:1], cfg, HF_LAYER, i, sizes), "experts": _experts(cfg, src, rd, opts, i)}
        else:
            mlp = read_tensors(rd, MLP, cfg, HF_LAYER, i, sizes)
        if not conv:
            return (MoELayer if routed else LayerParams)(**read_tensors(rd, ATTENTION, cfg, HF_LAYER, i, sizes), **mlp)
        w = conv_weight(src, HF_LAYER.format(i=i) + "conv.conv.weight", cfg.hidden_size, cfg.conv_kernel, opts.where)
        return ConvLayer(**read_tensors(rd, CONV, cfg, HF_LAYER, i, sizes), conv_w=w.astype(opts.dtype), **mlp)

    return Lfm2Params(layers=tuple(layer(i, conv) for i, conv in enumerate(cfg.conv_layers)),
                      **read_tensors(rd, TOP, cfg), config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


def checkpoint_layout(cfg: Lfm2Config) -> dict[str, TensorSpec]:
    """Hugging Face's names and shapes (the conv weight as [H, 1, K])."""
    h, hd, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, hk = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out = {"model.embed_tokens.weight": TensorSpec((cfg.vocab_size, h), scale=0.5),
           "model.embedding_norm.weight": TensorSpec((h,), center=1.0, scale=0.1)}
    e, mf = cfg.num_experts, cfg.moe_intermediate_size
    for i, conv in enumerate(cfg.conv_layers):
        p = f"model.layers.{i}."
        if cfg.moe_layers and cfg.moe_layers[i]:  # LFM2-MoE's published layout: one tensor per expert
            out[p + "feed_forward.gate.weight"] = TensorSpec((e, h))
            if cfg.expert_bias:  # (centred off 0: sigmoid scores + bias, where the bias can decide)
                out[p + "feed_forward.expert_bias"] = TensorSpec((e,), center=0.1, scale=0.3)
            for j in range(e):
                for n, shape in (("w1", (mf, h)), ("w3", (mf, h)), ("w2", (h, mf))):
                    out[p + f"feed_forward.experts.{j}.{n}.weight"] = TensorSpec(shape)
        else:
            for n, shape in (("feed_forward.w1", (ff, h)), ("feed_forward.w3", (ff, h)),
                             ("feed_forward.w2", (h, ff))):
                out[p + n + ".weight"] = TensorSpec(shape)
        for n in ("operator_norm", "ffn_norm"):
            out[p + n + ".weight"] = TensorSpec((h,), center=1.0, scale=0.1)
        if conv:
            out[p + "conv.in_proj.weight"] = TensorSpec((3 * h, h))
            out[p + "conv.conv.weight"] = TensorSpec((h, 1, cfg.conv_kernel), scale=0.3)
            out[p + "conv.out_proj.weight"] = TensorSpec((h, h))
            if cfg.conv_bias:
                for n, rows in (("conv.in_proj.bias", 3 * h), ("conv.conv.bias", h), ("conv.out_proj.bias", h)):
                    out[p + n] = TensorSpec((rows,), scale=0.05)
        else:
            for n, shape in (("self_attn.q_proj", (hq, h)), ("self_attn.k_proj", (hk, h)),
                             ("self_attn.v_proj", (hk, h)), ("self_attn.out_proj", (h, hq))):
                out[p + n + ".weight"] = TensorSpec(shape)
            for n in ("self_attn.q_layernorm", "self_attn.k_layernorm"):
                out[p + n + ".weight"] = TensorSpec((hd,), center=1.0, scale=0.1)
    return out


# llama.cpp's names (convert_hf_to_gguf.py's LFM2Model, gguf-py's TensorNameMap) -> Hugging
# Face's: the final norm as token_embd_norm (older converters) or output_norm, the conv
# weight squeezed to [C, K] (`conv_weight` reads it), nothing permuted (NEOX RoPE)
GGUF_TO_HF = (
    (r"^(token_embd_norm|output_norm)\.", "model.embedding_norm."), (r"\.attn_norm\.", ".operator_norm."),
    (r"\.shortconv\.(conv|in_proj|out_proj)\.", r".conv.\1."), (r"\.attn_output\.", ".self_attn.out_proj."),
    (r"\.attn_q_norm\.", ".self_attn.q_layernorm."), (r"\.attn_k_norm\.", ".self_attn.k_layernorm."),
    (r"\.ffn_gate\.", ".feed_forward.w1."), (r"\.ffn_up\.", ".feed_forward.w3."), (r"\.ffn_down\.", ".feed_forward.w2."),
) + GGUF_COMMON_NAMES


# lfm2moe's routed layers (convert_hf_to_gguf.py's LFM2MoeModel): the router, the stacks
# [E, out, in] and the selection bias (expert_bias, written as exp_probs_b.bias)
GGUF_MOE_TO_HF = (
    (r"\.ffn_gate_inp\.", ".feed_forward.gate."), (r"\.exp_probs_b\.bias$", ".feed_forward.expert_bias"),
    (r"\.ffn_(gate|up|down)_exps\.", r".feed_forward.switch_mlp.\1_proj."),
)


def config_from_gguf(md: dict[str, Any], source: str) -> Lfm2Config:
    """LFM2 from llama.cpp's lfm2 metadata: attention.head_count_kv per layer (0 on the
    convolution layers, the KV heads on the attention ones), shortconv.l_cache, and
    feed_forward_length as the MLP's width already adjusted. LFM2-MoE (lfm2moe) adds
    expert_count, expert_used_count, expert_feed_forward_length, leading_dense_block_count
    and expert_gating_func (sigmoid: 2); llama.cpp always renormalizes the top-k weights,
    needs the selection bias and writes no routed_scaling_factor (1)."""
    arch = md.get("general.architecture", "lfm2")
    kv = f"{arch}.attention.head_count_kv"
    per_layer = gguf_ints(md, kv)
    if per_layer is None:
        raise ConfigError(f"{source}: GGUF metadata '{kv}' must list each layer's KV heads "
                          "(0 on convolution layers)")
    heads = {x for x in per_layer if x}
    if len(heads) != 1:
        raise ConfigError(f"{source}: {kv} {per_layer}: expected one KV head count on the "
                          "attention layers and 0 on the others")
    d = gguf_hf_config({k: v for k, v in md.items() if k != kv}, arch, source, "lfm2",
                       rope_theta=1_000_000.0, context=128000)
    if len(per_layer) != d["num_hidden_layers"]:
        raise ConfigError(f"{source}: {kv} has {len(per_layer)} entries for "
                          f"{d['num_hidden_layers']} layers")
    ff = d.pop("intermediate_size")
    d.update(num_key_value_heads=heads.pop(), norm_eps=d.pop("rms_norm_eps"), block_ff_dim=ff,
             block_auto_adjust_ff_dim=False, conv_L_cache=int(gguf_value(md, arch, "shortconv.l_cache", source)),
             full_attn_idxs=[i for i, x in enumerate(per_layer) if x])
    if arch == "lfm2moe":
        def val(key: str, default: Any = ...) -> Any:
            return gguf_value(md, arch, key, source, default)

        if int(val("expert_gating_func", 2)) != 2:
            raise ConfigError(f"{source}: lfm2moe.expert_gating_func {val('expert_gating_func')!r}: LFM2-MoE "
                              "routes by sigmoid scores (2)")
        d.update(model_type="lfm2_moe", intermediate_size=ff, num_experts=int(val("expert_count")),
                 num_experts_per_tok=int(val("expert_used_count")),
                 moe_intermediate_size=int(val("expert_feed_forward_length")),
                 num_dense_layers=int(val("leading_dense_block_count", 0)), norm_topk_prob=True,
                 use_expert_bias=True)
    return config_from_hf(d, source)


def assemble_gguf(cfg: Lfm2Config, src: TensorSource, opts: LoadOptions) -> Lfm2Params:
    src = renamed(src, GGUF_MOE_TO_HF + GGUF_TO_HF)
    conv = next((i for i, c in enumerate(cfg.conv_layers) if c), None)  # (the metadata has no conv_bias key)
    cfg = attrs.evolve(cfg, conv_bias=conv is not None and src.has(f"model.layers.{conv}.conv.in_proj.bias"))
    if src.has("lm_head.weight"):  # LFM2's head is the embedding; a separate one would go unread
        raise WeightsError(f"{src.origin['lm_head.weight']}: an LFM2 file with its own output head: fx-engine's "
                           "LFM2 ties the head to the embedding")
    return assemble(cfg, src, opts)


def layer_range(p: Lfm2Params, start: int, end: int) -> Lfm2Params:
    return cut_layers(p, start, end, per_layer=("conv_layers", "moe_layers"))


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    if model_type == "lfm2_moe":  # LFM2-8B-A1B's layout, small: a dense layer, then routed ones
        return {"model_type": "lfm2_moe", "architectures": ["Lfm2MoeForCausalLM"], "vocab_size": 384,
                "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
                "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "num_dense_layers": 1, "num_experts": 8,
                "num_experts_per_tok": 2, "norm_topk_prob": True, "use_expert_bias": True,
                "routed_scaling_factor": 1.0, "rope_theta": 1_000_000.0,
                "layer_types": ["conv", "full_attention", "conv", "full_attention"], "tie_word_embeddings": True,
                "bos_token_id": 1, "eos_token_id": 2, **overrides}
    return {"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "vocab_size": 384,
            "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 2048, "norm_eps": 1e-5,
            "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 192,
            "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": True, "rope_theta": 1_000_000.0,
            "layer_types": ["conv", "full_attention", "conv", "conv"], "tie_embedding": True,
            "bos_token_id": 1, "eos_token_id": 2, **overrides}


def tensor_split(p: Lfm2Params, rank: int, size: int) -> Lfm2Params:
    """Rank `rank` of `size`'s shard (core/parallel.py): each short convolution's channels
    (their B, C, x rows of in_proj, taps and out_proj columns, summed: the convolution is
    per channel), attention heads, MLP features (each expert's, the router replicated),
    the vocabulary."""
    cfg = p.config
    h = cfg.hidden_size
    q0, q1, k0, k1 = head_range(cfg.num_heads, cfg.num_kv_heads, rank, size)
    units = [lp.out_proj.quant.group_size for lp in p.layers if isinstance(lp, ConvLayer) and lp.out_proj.quantized]
    c0, c1 = split(h, size, rank, max([1] + units))
    layers = []
    for i, lp in enumerate(p.layers):
        name = f"layer {i}"
        if isinstance(lp, ConvLayer):
            lp = attrs.evolve(lp, in_proj=split_rows(lp.in_proj, [(c0, c1), (h + c0, h + c1), (2 * h + c0, 2 * h + c1)]),
                              conv_w=lp.conv_w[c0:c1], conv_b=None if lp.conv_b is None else lp.conv_b[c0:c1],
                              out_proj=split_cols(lp.out_proj, c0, c1, f"{name} out_proj"))
        else:
            lp = split_attention(lp, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rank, size, name)
        if getattr(lp, "experts", None) is not None:
            layers.append(attrs.evolve(lp, experts=split_experts(lp.experts, rank, size, i)))
        else:
            layers.append(split_mlp(lp, rank, size, name))
    small = attrs.evolve(cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0, conv_channels=c1 - c0)
    return split_head(attrs.evolve(p, layers=tuple(layers), config=small), rank, size)


FAMILY = Family(
    name="lfm2", model_types=("lfm2", "lfm2_moe"), config_type=Lfm2Config, params_type=Lfm2Params,
    config_from_hf=config_from_hf, assemble=assemble, cache_specs=cache_specs, forward=forward,
    hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout,
    tensor_split=tensor_split, layer_range=layer_range, tiny_config=tiny_config,
    gguf_architectures=("lfm2", "lfm2moe"), config_from_gguf=config_from_gguf, assemble_gguf=assemble_gguf,
)

__all__ = ["FAMILY", "Lfm2Config", "Lfm2Params", "ConvLayer", "short_conv"]
