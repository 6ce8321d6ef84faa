"""DeepSeek-V3 (`deepseek_v3`), Kimi K2 (`kimi_k2`, the same architecture) and DeepSeek-V2 /
V2.5 / V2-Lite / Coder-V2 (`deepseek_v2`), following mlx-lm 0.32's deepseek_v3.py and
deepseek_v2.py (the parity oracles).

Multi-head latent attention (MLA): queries through a low-rank pair (q_a -> RMSNorm -> q_b,
or one q_proj), each head's query split into a "nope" part (dn dims) and a RoPE part (dr);
keys and values are never expanded per head: the cache holds, per token, the compressed
latent c = RMSNorm(kv_a(x)[:r]) (r = kv_lora_rank) and one shared RoPE key
k_pe = rope(kv_a(x)[r:]) (dr dims), a `LayerSpec` with value_dim (what mlx-lm stores too).
Attention runs in the absorbed form for every step: q_nope is mapped into the latent space
per head (W_UK, from kv_b_proj), scores are q_lat . c + q_pe . k_pe, the output is mapped
out of it per head (W_UV), then o_proj. RoPE is interleaved ("traditional"; Hugging Face's
rope_interleave, which a config may turn off) over dr dims,
with YaRN's mscale_all_dim squared folded into the attention scale.
MoE layers (from `first_k_dense_replace`, every `moe_layer_freq`): sigmoid router scores
plus a correction bias choose the top-k experts within the `topk_group` best of `n_group`
groups (each group scored by its two best); the weights are the sigmoid scores (without the
bias), renormalized if `norm_topk_prob`, times `routed_scaling_factor`; shared experts
(one SwiGLU of n_shared_experts * moe_intermediate_size) are added for every token.
DeepSeek-V2 routes by softmax scores instead (`topk_method` greedy: the top-k of all
experts; group_limited_greedy: within the topk_group groups holding the best single
scores), no correction bias, the weights the scores times routed_scaling_factor.
Checkpoints: Hugging Face's (kv_b_proj, per-expert tensors) and mlx-lm's sanitized ones
(embed_q / unembed_out, switch_mlp stacks; mlx-community's quantized folders); the original
FP8 checkpoints (weight_scale_inv) are dequantized as they are read (`loading.fp8`). The
multi-token-prediction layer is the drafter's (`core.drafters.mtp`), not read here.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry, attend_latent, write_entry
from fx_engine.core.checkpoint import (GGUF_COMMON_NAMES, Embedding, Lin, LoadOptions, Reader, TensorSource,
                                       TensorSpec, Vec, WeightsError, dequantized, finish_experts, fuse_experts,
                                       read_experts, read_linear, read_tensors, renamed)
from fx_engine.core.config import (BOOL, FLOAT, INT, INT_OR_ZERO, MAYBE_POSITIVE, BaseConfig, ConfigError, Field,
                                   check_rope_scaling, gguf_grouped_experts, gguf_hf_config, gguf_value, gguf_yarn,
                                   read_fields, token_ids)
from fx_engine.core.models.blocks import (GGUF_GROUPED_EXPERT_NAMES, HF_LAYER, SWIGLU_MLP, grouped_route,
                                          read_shared_expert, swiglu_mlp)
from fx_engine.core.models.family import Family
from fx_engine.core.models.skeleton import PipelineStage, cut_layers, decoder_step, stage_logits
from fx_engine.core.nn import (Linear, Numerics, apply_rope, linear, matmul_t, rms_norm, rope_tables, routed_mixture,
                               scaled_rope_freqs, scaled_rope_mscale, swiglu_fused)
from fx_engine.core.splits import split, split_cols, split_experts, split_mlp, split_rows, split_vocab
from fx_engine.core.tree import static_field


@attrs.frozen
class DeepseekConfig(BaseConfig):
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    attn_scale: float
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    num_experts: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    top_k: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    # "noaux_tc": DeepSeek-V3's sigmoid routing with the correction bias; DeepSeek-V2's
    # softmax routing, "greedy" or "group_limited_greedy"
    topk_method: str = "noaux_tc"
    # RoPE on adjacent pairs (Hugging Face's rope_interleave, default true: the checkpoints'
    # layout); false: on the two halves of the rotated dims
    rope_interleave: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()


# config.json's fields read as they are (`read_fields`, in this order), by DeepseekConfig's names
_FIELDS = (
    Field("num_hidden_layers", to="num_layers"), Field("num_attention_heads", to="num_heads"), Field("hidden_size"),
    Field("qk_nope_head_dim"), Field("qk_rope_head_dim"), Field("v_head_dim"), Field("kv_lora_rank"),
    Field("q_lora_rank", MAYBE_POSITIVE, None),  # None: queries not low-rank (DeepSeek-V2-Lite)
    Field("vocab_size"), Field("intermediate_size"), Field("rms_norm_eps", FLOAT, 1e-6, or_default=True),
    Field("rope_theta", FLOAT, 10000.0, or_default=True), Field("max_position_embeddings", INT, 4096, or_default=True),
    Field("attention_bias", BOOL, False),
)
# the routed experts' (when n_routed_experts is given)
_EXPERT_FIELDS = (
    Field("n_routed_experts", to="num_experts"), Field("num_experts_per_tok", to="top_k"),
    Field("n_group", default=1, null_default=True), Field("topk_group", default=1, null_default=True),
    Field("moe_intermediate_size"), Field("n_shared_experts", INT_OR_ZERO, 0, to="num_shared_experts"),
    Field("routed_scaling_factor", FLOAT, 1.0, or_default=True), Field("norm_topk_prob", BOOL, True),
    Field("first_k_dense_replace", INT_OR_ZERO, 0), Field("moe_layer_freq", default=1, null_default=True),
)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> DeepseekConfig:
    f = read_fields(d, _FIELDS, source)
    if d.get("mlp_bias"):  # (DeepseekV2Config's; its released models have none)
        raise ConfigError(f"{source}: field 'mlp_bias' = true is not supported")
    dn, dr, layers = f["qk_nope_head_dim"], f["qk_rope_head_dim"], f["num_layers"]
    if dr % 2:
        raise ConfigError(f"{source}: field 'qk_rope_head_dim' must be even, got {dr}")
    scaling = check_rope_scaling(d.get("rope_scaling"), source)
    moe = _experts(d, layers, source) if d.get("n_routed_experts") is not None else {"moe_layers": (False,) * layers}
    bos, eos = token_ids(d)
    return DeepseekConfig(
        model_type=d["model_type"], **f, num_kv_heads=1, head_dim=dn + dr, attn_scale=_attn_scale(dn + dr, scaling),
        rope_scaling=scaling, rope_interleave=bool(d.get("rope_interleave", True)), bos_token_id=bos,
        eos_token_ids=eos, **moe,
    )


def _attn_scale(head_dim: int, scaling: tuple[tuple[str, Any], ...] | None) -> float:
    """head_dim^-0.5, times mlx-lm's YaRN fold (its mscale squared) when the scaling has
    mscale_all_dim and stretches the context."""
    sd, scale = dict(scaling or ()), float(head_dim) ** -0.5
    if sd and sd.get("mscale_all_dim") and float(sd.get("factor", 1)) > 1:
        s = 0.1 * float(sd["mscale_all_dim"]) * math.log(float(sd["factor"])) + 1.0
        scale *= s * s
    return scale


def _experts(d: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """DeepseekConfig's routed-expert fields: DeepSeek-V3's grouped sigmoid routing, or
    DeepSeek-V2's softmax routing (its `topk_method`; never renormalized: Hugging Face's
    DeepseekV2TopkRouter reads no norm_topk_prob, so a config that sets it is refused),
    routed layers from first_k_dense_replace on, every moe_layer_freq-th."""
    v2 = d["model_type"] == "deepseek_v2"
    e = read_fields(d, _EXPERT_FIELDS, source)
    experts, top_k, groups, topk_group = e["num_experts"], e["top_k"], e["n_group"], e["topk_group"]
    method = d.get("topk_method") or ("greedy" if v2 else "noaux_tc")
    if v2 and method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(f"{source}: topk_method {method!r} is not supported for deepseek_v2 "
                          "(greedy, group_limited_greedy)")
    if v2 and d.get("norm_topk_prob"):
        raise ConfigError(f"{source}: field 'norm_topk_prob' = true is not supported for deepseek_v2 "
                          "(Hugging Face's DeepSeek-V2 router never renormalizes; no released model sets it)")
    if not v2 and (method != "noaux_tc" or (d.get("scoring_func") or "sigmoid") != "sigmoid"):
        raise ConfigError(f"{source}: topk_method {d.get('topk_method')!r} / scoring_func "
                          f"{d.get('scoring_func')!r} is not supported (noaux_tc with sigmoid)")
    if v2:
        e["norm_topk_prob"] = False
        if method == "greedy":  # (groups play no part)
            groups = topk_group = e["n_group"] = e["topk_group"] = 1
    if experts % groups or topk_group > groups or top_k > experts:
        raise ConfigError(f"{source}: n_routed_experts ({experts}) must split into n_group "
                          f"({groups}) groups, topk_group ({topk_group}) <= n_group, "
                          f"num_experts_per_tok ({top_k}) <= n_routed_experts")
    if groups > 1 and experts // groups < 2:
        raise ConfigError(f"{source}: each of the n_group groups needs at least 2 experts")
    first, freq = e.pop("first_k_dense_replace"), e.pop("moe_layer_freq")
    return {**e, "topk_method": method, "moe_layers": tuple(i >= first and i % freq == 0 for i in range(layers))}


@attrs.frozen
class MLA:
    q_a: Linear | None  # None: one q_proj (q_b holds it)
    q_a_norm: mx.array | None
    q_b: Linear  # -> heads * (dn + dr)
    kv_a: Linear  # -> r + dr
    kv_a_norm: mx.array
    w_uk: mx.array  # [H, dn, r]: q_nope -> the latent space
    w_uv: mx.array  # [H, r, dv]: the latent output -> each head's values
    o: Linear


@attrs.frozen
class RoutedExperts:
    router: mx.array  # [E, H]
    correction_bias: mx.array | None  # [E] (DeepSeek-V2: None)
    gate_up: Linear
    down: Linear
    shared_gate_up: Linear | None = None
    shared_down: Linear | None = None


@attrs.frozen
class DeepseekLayer:
    attn_norm: mx.array
    attn: MLA
    mlp_norm: mx.array
    experts: RoutedExperts | None = None
    gate_up: Linear | None = None  # dense layers
    down: Linear | None = None


@attrs.frozen
class DeepseekParams:
    __fx_memo_flatten__ = True
    embed: Linear
    layers: tuple[DeepseekLayer, ...]
    norm: mx.array
    lm_head: Linear
    rope_freqs: mx.array | None
    config: DeepseekConfig = static_field()
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")
    pipeline: PipelineStage | None = static_field(default=None)  # a stage's (core/parallel.stage_params)


def cache_specs(cfg: DeepseekConfig) -> tuple[LayerSpec, ...]:
    """One latent entry per layer: keys the latent (r), values the shared RoPE key (dr)."""
    return tuple(LayerSpec(1, cfg.kv_lora_rank, value_dim=cfg.qk_rope_head_dim)
                 for _ in range(cfg.num_layers))


def per_head(x: mx.array, w: mx.array, num: Numerics) -> mx.array:
    """x [N, H, a] @ w [H, a, b] -> [N, H, b], one matmul per head. In batch-invariant mode
    every matmul has M = numerics.tile rows (padded), so a row's result never depends on
    how many rows the step has."""
    n = x.shape[0]
    xh = x.transpose(1, 0, 2)  # [H, N, a]
    if not num.batch_invariant:
        return (xh @ w).transpose(1, 0, 2)
    pad = (-n) % num.tile
    if pad:
        xh = mx.pad(xh, [(0, 0), (0, pad), (0, 0)])
    h, m, a = xh.shape
    y = xh.reshape(h, m // num.tile, num.tile, a) @ w[:, None]
    return y.reshape(h, m, -1)[:, :n].transpose(1, 0, 2)


def _attention(p: DeepseekParams, at: MLA, x: mx.array, entry: Any, spec: LayerSpec,
               rope: tuple, geo: StepGeometry) -> tuple[mx.array, Any]:
    cfg, num = p.config, p.numerics
    b, t = geo.positions.shape
    hq, dn, dr, eps = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, 1e-6
    qa = x if at.q_a is None else rms_norm(linear(x, at.q_a, num), at.q_a_norm, eps, num)
    q = linear(qa, at.q_b, num).reshape(b * t, hq, dn + dr)
    ckv = linear(x, at.kv_a, num)  # [N, r + dr]
    r = cfg.kv_lora_rank
    latent = rms_norm(ckv[:, :r], at.kv_a_norm, eps, num)
    k_pe = apply_rope(ckv[:, r:].reshape(b, t, 1, dr), *rope, None, cfg.rope_interleave)
    q_pe = apply_rope(q[:, :, dn:].reshape(b, t, hq, dr), *rope, None, cfg.rope_interleave)
    entry = write_entry(entry, spec, latent.reshape(b, t, 1, r).transpose(0, 2, 1, 3),
                        k_pe.transpose(0, 2, 1, 3), geo, num)
    q_lat = per_head(q[:, :, :dn], at.w_uk, num).reshape(b, t, hq, r)
    o = attend_latent(entry, spec, q_lat, q_pe, geo, cfg.attn_scale, num)  # [B, T, H * r]
    o = per_head(o.reshape(b * t, hq, r), at.w_uv, num).reshape(b * t, hq * cfg.v_head_dim)
    return linear(o, at.o, num), entry


def softmax_route(logits: Float[mx.array, "N E"], k: int, n_group: int, topk_group: int, scale: float
                  ) -> tuple[Int[mx.array, "N K"], Float[mx.array, "N K"]]:
    """DeepSeek-V2's routing (Hugging Face's DeepseekV2TopkRouter): softmax scores in float32;
    the top-k experts, among those of the topk_group groups (of n_group) whose best single
    score is highest where groups are limited; the weights the chosen scores times `scale`."""
    scores = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    chosen = scores
    if n_group > 1 and topk_group < n_group:
        grouped = mx.unflatten(scores, axis=-1, shape=(n_group, -1))
        worst = mx.argpartition(grouped.max(axis=-1, keepdims=True), kth=n_group - topk_group - 1,
                                axis=-2)[..., : n_group - topk_group, :]
        chosen = mx.flatten(mx.put_along_axis(grouped, worst, mx.array(-mx.inf), axis=-2), -2, -1)
    idx = mx.argpartition(-chosen, kth=k - 1, axis=-1)[..., :k]
    return idx, mx.take_along_axis(scores, idx, axis=-1) * scale


def _mlp(cfg: DeepseekConfig, lp: DeepseekLayer, x: mx.array, num: Numerics) -> mx.array:
    if lp.experts is None:
        return swiglu_mlp(x, lp.gate_up, lp.down, num)
    ex = lp.experts
    if cfg.topk_method == "noaux_tc":
        idx, w = grouped_route(matmul_t(x, ex.router, num), ex.correction_bias, cfg.top_k, cfg.n_group, cfg.topk_group,
                               cfg.norm_topk_prob, cfg.routed_scaling_factor)
    else:
        idx, w = softmax_route(matmul_t(x, ex.router, num), cfg.top_k, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
    y = routed_mixture(x, ex.gate_up, ex.down, idx, w, lambda gu: swiglu_fused(gu, num), num)
    if ex.shared_gate_up is not None:
        y = y + swiglu_mlp(x, ex.shared_gate_up, ex.shared_down, num)
    return y


def forward(
    p: DeepseekParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Same contract as `skeleton.decoder_step` (latent attention, routed MLPs)."""
    cfg, num = p.config, p.numerics

    def layers(h: mx.array, geo: StepGeometry) -> tuple[mx.array, list[Any]]:
        rope = _rope(p, geo.positions)
        entries = []
        for lp, entry, spec in zip(p.layers, cache.layers, cache.layout):
            geo.layer_input(h)  # the stream entering this layer (skeleton.Capture)
            a, entry = _attention(p, lp.attn, rms_norm(h, lp.attn_norm, cfg.rms_norm_eps, num), entry, spec, rope,
                                  geo)
            h = h + a
            h = h + _mlp(cfg, lp, rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps, num), num)
            entries.append(entry)
        return h, entries

    return decoder_step(p, cache, tokens, n_valid, span, layers)


def _rope(p: DeepseekParams, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The tables of the shared RoPE key's dims (interleaved pairs unless rope_interleave is
    false; linear or YaRN scaling,
    YaRN's mscale on cos and sin)."""
    cfg, dt = p.config, getattr(mx, p.dtype)
    scale = 1.0
    sd = dict(cfg.rope_scaling or ())
    if (sd.get("type") or sd.get("rope_type")) == "linear":
        scale = 1.0 / float(sd["factor"])
    cos, sin, perm = rope_tables(positions, cfg.qk_rope_head_dim, base=cfg.rope_theta, scale=scale,
                                 freqs=p.rope_freqs, traditional=cfg.rope_interleave)
    m = scaled_rope_mscale(sd, cfg.max_position_embeddings)
    return cos.astype(dt) * m, sin.astype(dt) * m, perm.astype(dt)


def hidden_to_logits(p: DeepseekParams, h: Float[mx.array, "*N H"]) -> Float[mx.array, "*N V"]:
    return stage_logits(p, h, lambda: linear(h, p.lm_head, p.numerics).astype(mx.float32))


# ------------------------------------------------------------------ checkpoints


def _head_maps(cfg: DeepseekConfig, src: TensorSource, pre: str, opts: LoadOptions) -> tuple[mx.array, mx.array]:
    """W_UK [H, dn, r] and W_UV [H, r, dv] (float), from Hugging Face's kv_b_proj
    [H * (dn + dv), r] or mlx-lm's embed_q [H, r, dn] / unembed_out [H, dv, r]."""
    h, dn, dv, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    dt = opts.dtype
    if src.has(pre + "kv_b_proj.weight"):
        kv_b = dequantized(read_linear(src, pre + "kv_b_proj", h * (dn + dv), r,
                                       opts.quant_for(pre + "kv_b_proj"), False, opts.where), dt).weight
        kv_b = kv_b.reshape(h, dn + dv, r)
        return mx.contiguous(kv_b[:, :dn, :]), mx.contiguous(kv_b[:, dn:, :].swapaxes(-1, -2))

    def multi(name: str, out_f: int, in_f: int) -> mx.array:
        w = src.get(name + ".weight", None, opts.where)
        if src.has(name + ".scales"):
            sc = src.get(name + ".scales", None, opts.where)
            q = opts.quant_for(name) or {}
            gs = int(q.get("group_size", in_f // sc.shape[-1]))
            bits = int(q.get("bits", w.shape[-1] * 32 // in_f))
            w = mx.dequantize(w, sc, src.get(name + ".biases", tuple(sc.shape), opts.where),
                              group_size=gs, bits=bits)
        if tuple(w.shape) != (h, out_f, in_f):
            raise WeightsError(f"{src.origin[name + '.weight']}: '{name}.weight' has shape "
                               f"{tuple(w.shape)}, expected {(h, out_f, in_f)}")
        return w.astype(dt)

    w_uk = multi(pre + "embed_q", r, dn).swapaxes(-1, -2)  # [H, dn, r]
    w_uv = multi(pre + "unembed_out", dv, r).swapaxes(-1, -2)  # [H, r, dv]
    return mx.contiguous(w_uk), mx.contiguous(w_uv)


# Each layer's params from its tensors under model.layers.{i}. (`read_tensors`): the
# attention's (under self_attn.: queries low-rank or one q_proj, DeepSeek-V2-Lite's; the
# per-head maps are `_head_maps`'), the norms, a dense layer's MLP (`SWIGLU_MLP`); routed
# layers' experts are `_routed_experts`'. The whole model's: the head is its own.
ATTENTION = (
    Lin("q_a", "q_a_proj", "q_lora_rank", "hidden_size", bias="attention_bias", when="q_lora_rank"),
    Vec("q_a_norm", "q_a_layernorm.weight", "q_lora_rank", when="q_lora_rank"),
    Lin("q_b", "q_b_proj", "q_width", "q_lora_rank", when="q_lora_rank"),
    Lin("q_b", "q_proj", "q_width", "hidden_size", when="q_whole"),
    Lin("kv_a", "kv_a_proj_with_mqa", "kv_a_width", "hidden_size", bias="attention_bias"),
    Vec("kv_a_norm", "kv_a_layernorm.weight", "kv_lora_rank"),
    Lin("o", "o_proj", "hidden_size", "o_width", bias="attention_bias"),
)
NORMS = (Vec("attn_norm", "input_layernorm.weight", "hidden_size"),
         Vec("mlp_norm", "post_attention_layernorm.weight", "hidden_size"))
TOP = (
    Embedding("embed", "model.embed_tokens", lookup_only=True),
    Vec("norm", "model.norm.weight", "hidden_size"),
    Lin("lm_head", "lm_head", "vocab_size", "hidden_size"),
)


def assemble(cfg: DeepseekConfig, src: TensorSource, opts: LoadOptions) -> DeepseekParams:
    rd = Reader(src, opts)
    hq, dn, dr, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    sizes = {"q_width": hq * (dn + dr), "kv_a_width": cfg.kv_lora_rank + dr, "o_width": hq * dv,
             "q_whole": not cfg.q_lora_rank}

    def layer(i: int) -> DeepseekLayer:
        a = HF_LAYER.format(i=i) + "self_attn."
        w_uk, w_uv = _head_maps(cfg, src, a, opts)
        attn = MLA(**read_tensors(rd, ATTENTION, cfg, a, sizes=sizes), w_uk=w_uk, w_uv=w_uv)
        mlp = (dict(experts=_routed_experts(cfg, rd, HF_LAYER.format(i=i) + "mlp.")) if cfg.moe_layers[i]
               else read_tensors(rd, SWIGLU_MLP, cfg, HF_LAYER, i))
        return DeepseekLayer(**read_tensors(rd, NORMS, cfg, HF_LAYER, i), attn=attn, **mlp)

    return DeepseekParams(
        layers=tuple(layer(i) for i in range(cfg.num_layers)), **read_tensors(rd, TOP, cfg),
        rope_freqs=scaled_rope_freqs(dict(cfg.rope_scaling or ()), dr, cfg.rope_theta),
        config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


def _routed_experts(cfg: DeepseekConfig, rd: Reader, m: str) -> RoutedExperts:
    """A routed layer's experts under `m` (its mlp.): stacked (mlx-lm) or one tensor per
    expert (Hugging Face), the router and its selection bias, the shared experts."""
    src, opts, h = rd.src, rd.opts, cfg.hidden_size
    e, f, dtype, keep = cfg.num_experts, cfg.moe_intermediate_size, opts.dtype, opts.keep_quantized
    gate, up, down = (read_experts(src, m + "switch_mlp." + n, m + "experts.{e}." + n, e, o, k, opts.quant_for,
                                   opts.where) for n, (o, k) in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))))
    shared = read_shared_expert(rd, h, cfg.num_shared_experts * f, m + "shared_experts.", None,
                                ("gate_proj", "up_proj", "down_proj"))
    return RoutedExperts(
        router=src.get(m + "gate.weight", (e, h), opts.where).astype(dtype),
        correction_bias=(src.get(m + "gate.e_score_correction_bias", (e,), opts.where).astype(mx.float32)
                         if cfg.topk_method == "noaux_tc" else None),
        gate_up=fuse_experts(gate, up, dtype, keep), down=finish_experts(down, dtype, keep), **shared)


def checkpoint_layout(cfg: DeepseekConfig) -> dict[str, TensorSpec]:
    """Hugging Face's tensors (kv_b_proj, one tensor per expert)."""
    h, hq, dn, dr, dv, r = (cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.kv_lora_rank)
    out = {"model.embed_tokens.weight": TensorSpec((cfg.vocab_size, h), scale=0.5)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        if cfg.q_lora_rank:
            out[a + "q_a_proj.weight"] = TensorSpec((cfg.q_lora_rank, h))
            out[a + "q_a_layernorm.weight"] = TensorSpec((cfg.q_lora_rank,), center=1.0)
            out[a + "q_b_proj.weight"] = TensorSpec((hq * (dn + dr), cfg.q_lora_rank), scale=0.15)
        else:
            out[a + "q_proj.weight"] = TensorSpec((hq * (dn + dr), h))
        out[a + "kv_a_proj_with_mqa.weight"] = TensorSpec((r + dr, h))
        out[a + "kv_a_layernorm.weight"] = TensorSpec((r,), center=1.0)
        out[a + "kv_b_proj.weight"] = TensorSpec((hq * (dn + dv), r), scale=0.15)
        out[a + "o_proj.weight"] = TensorSpec((h, hq * dv))
        if cfg.attention_bias:
            for n, rows in (("q_a_proj", cfg.q_lora_rank), ("kv_a_proj_with_mqa", r + dr), ("o_proj", h)):
                if rows:
                    out[a + n + ".bias"] = TensorSpec((rows,), scale=0.05)
        if cfg.moe_layers[i]:
            e, f = cfg.num_experts, cfg.moe_intermediate_size
            out[m + "gate.weight"] = TensorSpec((e, h), scale=0.3)
            if cfg.topk_method == "noaux_tc":
                out[m + "gate.e_score_correction_bias"] = TensorSpec((e,), scale=0.1)
            for j in range(e):
                for n, shape in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
                    out[f"{m}experts.{j}.{n}.weight"] = TensorSpec(shape)
            if cfg.num_shared_experts:
                s = cfg.num_shared_experts * f
                for n, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
                    out[m + "shared_experts." + n + ".weight"] = TensorSpec(shape)
        else:
            ff = cfg.intermediate_size
            for n, shape in (("gate_proj", (ff, h)), ("up_proj", (ff, h)), ("down_proj", (h, ff))):
                out[m + n + ".weight"] = TensorSpec(shape)
        out[p + "input_layernorm.weight"] = TensorSpec((h,), center=1.0)
        out[p + "post_attention_layernorm.weight"] = TensorSpec((h,), center=1.0)
    out["model.norm.weight"] = TensorSpec((h,), center=1.0)
    out["lm_head.weight"] = TensorSpec((cfg.vocab_size, h), scale=0.2)
    return out


def layer_range(p: DeepseekParams, start: int, end: int) -> DeepseekParams:
    return cut_layers(p, start, end, per_layer=("moe_layers",))


# DeepSeek-V2-Lite's shape: one q_proj, softmax routing over every expert, two shared
# experts, no renormalization (mlx-lm's deepseek_v2 needs a rope_scaling: YaRN, as released)
_V2 = {"architectures": ["DeepseekV2ForCausalLM"], "q_lora_rank": None, "n_group": 1, "topk_group": 1,
       "topk_method": "greedy", "n_shared_experts": 2, "routed_scaling_factor": 1.0, "norm_topk_prob": False}


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    if model_type == "deepseek_v2":
        return {k: v for k, v in tiny_config("deepseek_v3", {}).items() if k != "scoring_func"} | {
            "model_type": model_type, **_V2, **overrides}
    return {"model_type": model_type, "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
            "num_hidden_layers": 3, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1,
            "moe_intermediate_size": 32, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1,
            "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "rms_norm_eps": 1e-6, "vocab_size": 384, "rope_theta": 10000.0, "max_position_embeddings": 2048,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            **overrides}


# llama.cpp's deepseek2 names -> Hugging Face's / mlx-lm's (newer converters split kv_b into
# k_b [H, r, dn] and v_b [H, dv, r]: mlx-lm's embed_q and unembed_out exactly)
_GGUF_TO_HF = (
    (r"\.attn_q_a_norm\.", ".self_attn.q_a_layernorm."), (r"\.attn_q_a\.", ".self_attn.q_a_proj."),
    (r"\.attn_q_b\.", ".self_attn.q_b_proj."), (r"\.attn_kv_a_norm\.", ".self_attn.kv_a_layernorm."),
    (r"\.attn_kv_a_mqa\.", ".self_attn.kv_a_proj_with_mqa."), (r"\.attn_kv_b\.", ".self_attn.kv_b_proj."),
    (r"\.attn_k_b\.", ".self_attn.embed_q."), (r"\.attn_v_b\.", ".self_attn.unembed_out."),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
) + GGUF_GROUPED_EXPERT_NAMES + GGUF_COMMON_NAMES


def assemble_gguf(cfg: DeepseekConfig, src: TensorSource, opts: LoadOptions) -> DeepseekParams:
    """DeepSeek-V3 / Kimi K2 from llama.cpp's deepseek2 names (renamed only: its RoPE is
    the interleaved one on the checkpoint's own rows, as here)."""
    return assemble(cfg, renamed(src, _GGUF_TO_HF), opts)


def config_from_gguf(md: dict[str, Any], source: str) -> DeepseekConfig:
    """From llama.cpp's deepseek2 metadata: DeepSeek-V3's sigmoid routing (expert_gating_func
    2), or DeepSeek-V2's softmax (1; files without the key are V2's, as llama.cpp reads them)."""
    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, "deepseek2", key, source, default)

    r, dr = int(val("attention.kv_lora_rank")), int(val("rope.dimension_count"))
    mla = val("attention.key_length_mla", None)  # newer files: key_length is r + dr there
    dk = int(mla) if mla is not None else int(val("attention.key_length"))
    experts = gguf_grouped_experts(md, "deepseek2", source, softmax=True)
    d = gguf_hf_config(md, "deepseek2", source, "deepseek_v2" if experts.get("topk_method") else "deepseek_v3")
    m = float(val("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1  # llama.cpp's 0.1 * mscale_all_dim
    d.update(experts, n_shared_experts=experts["n_shared_experts"] or None, head_dim=None,
             num_key_value_heads=d["num_attention_heads"], q_lora_rank=int(val("attention.q_lora_rank", 0) or 0) or None,
             kv_lora_rank=r, qk_nope_head_dim=dk - dr, qk_rope_head_dim=dr,
             v_head_dim=int(val("attention.value_length_mla", None) or val("attention.value_length")),
             rope_scaling=gguf_yarn(md, "deepseek2", source, mscale=m, mscale_all_dim=m))
    return config_from_hf(d, source)

def tensor_split(p: DeepseekParams, rank: int, size: int) -> DeepseekParams:
    """Rank `rank` of `size`'s tensor-parallel shard (core/parallel.py): each rank a run of
    query heads (their q_b rows, W_UK / W_UV slices and o_proj columns, summed over the
    ranks); the latent projection (kv_a) and so the latent cache are replicated (every
    head reads all of it); MLPs and experts split by their intermediate features."""
    cfg = p.config
    h0, h1 = split(cfg.num_heads, size, rank)
    dq, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    layers = []
    for i, lp in enumerate(p.layers):
        at = lp.attn
        at = attrs.evolve(at, q_b=split_rows(at.q_b, [(h0 * dq, h1 * dq)], keep_origin=True), w_uk=at.w_uk[h0:h1],
                          w_uv=at.w_uv[h0:h1], o=split_cols(at.o, h0 * dv, h1 * dv, f"layer {i} o_proj"))
        if lp.experts is not None:
            layers.append(attrs.evolve(lp, attn=at, experts=split_experts(lp.experts, rank, size, i)))
            continue
        layers.append(split_mlp(attrs.evolve(lp, attn=at), rank, size, f"layer {i}"))
    return attrs.evolve(p, layers=tuple(layers), embed=split_vocab(p.embed, rank, size),
                        lm_head=split_vocab(p.lm_head, rank, size),
                        config=attrs.evolve(cfg, num_heads=h1 - h0))


FAMILY = Family(
    name="deepseek", model_types=("deepseek_v3", "kimi_k2", "deepseek_v2"), config_type=DeepseekConfig,
    params_type=DeepseekParams, config_from_hf=config_from_hf, assemble=assemble,
    cache_specs=cache_specs, forward=forward, hidden_to_logits=hidden_to_logits,
    checkpoint_layout=checkpoint_layout, layer_range=layer_range, tensor_split=tensor_split, tiny_config=tiny_config,
    gguf_architectures=("deepseek2",), config_from_gguf=config_from_gguf, assemble_gguf=assemble_gguf,
)
