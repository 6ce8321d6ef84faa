"""The blocks the model families are built from: attention (Llama's, with its variants),
RoPE tables, dense MLPs, routed experts (routing, the mixture, reading their stacks), and
the sizes the families' checkpoint tables name (the reader and the tables' entries are
core/checkpoint.py's `Reader` and `read_tensors`, re-exported here).

Each block is a pure function over a small frozen record plus the few config fields it
reads, so a family composes them instead of reaching into another family's private
helpers; no family module is imported here (the registry imports the families, the
families import this).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.cache import (LayerSpec, StepGeometry, attend_entry, fused_write, write_entry,
                                  write_rotated_entry)
from fx_engine.core.checkpoint import Fused, Lin, LoadOptions, Reader, finish_experts, fuse_experts
from fx_engine.core.nn import (Linear, Numerics, add_rms_norm, apply_rope, layer_norm, linear, rms_norm, rope_tables,
                               routed_mixture, scaled_rope_freqs, scaled_rope_mscale, shard_group, swiglu_fused)

__all__ = ["Attention", "DenseMlp", "decoder_layer", "Experts", "GATE_UP", "GGUF_GROUPED_EXPERT_NAMES", "HF_EXPERT_NAMES",
           "HF_LAYER", "QKV", "Reader", "STACKED_EXPERT_NAMES", "SWIGLU_MLP", "apply_partial_rope", "attention_sizes",
           "head_norm_attention",
           "expert_stacks", "grouped_route", "mixture", "read_shared_expert", "rope_freqs", "rope_in", "rope_mscale",
           "route", "scaled_rope", "self_attention", "swiglu_mlp"]


# ---------------------------------------------------------------- checkpoint names and sizes

# Hugging Face's names of the Llama-style blocks most families share (their tables,
# `checkpoint.read_tensors`): a layer's prefix, q|k|v and gate|up as (name, rows)
HF_LAYER = "model.layers.{i}."
QKV = (("self_attn.q_proj", "q_width"), ("self_attn.k_proj", "kv_width"), ("self_attn.v_proj", "kv_width"))
GATE_UP = (("mlp.gate_proj", "intermediate_size"), ("mlp.up_proj", "intermediate_size"))
# a SwiGLU MLP without biases (`DenseMlp`'s fields) under the layer's prefix
SWIGLU_MLP = (Fused("gate_up", GATE_UP, "hidden_size"),
              Lin("down", "mlp.down_proj", "hidden_size", "intermediate_size"))



def attention_sizes(cfg: Any, whole_qk_norms: bool = False) -> dict[str, Any]:
    """The sizes and flags the families' checkpoint tables (`checkpoint.read_tensors`) name
    beyond their config's fields: the q and k/v projections' widths, the q/k norms' (per
    head, or over the whole projections: OLMo's) and whether the output head is untied."""
    hd = cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    return {"q_width": q, "kv_width": kv, "q_norm_width": q if whole_qk_norms else hd,
            "k_norm_width": kv if whole_qk_norms else hd, "untied": not getattr(cfg, "tie_word_embeddings", True)}


# ---------------------------------------------------------------- RoPE


def rope_in(positions: mx.array, dims: int, dtype: mx.Dtype, *, base: float, traditional: bool = False,
            scale: float = 1.0, freqs: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """RoPE tables over `dims` rotated dims, computed in float32 and applied in the
    activation dtype (no silent upcast)."""
    cos, sin, perm = rope_tables(positions, dims, base=base, scale=scale, freqs=freqs, traditional=traditional)
    return cos.astype(dtype), sin.astype(dtype), perm.astype(dtype)


def rope_mscale(cfg: Any) -> float:
    """The factor on the rotated dims of q and k (see `nn.scaled_rope_mscale`)."""
    return scaled_rope_mscale(dict(cfg.rope_scaling or ()), cfg.max_position_embeddings)


def rope_type_of(rope_scaling: Any) -> str:
    """The RoPE scaling's kind ("default" when none): Hugging Face spells the key `type`
    in older configs and `rope_type` in newer ones."""
    if not rope_scaling:
        return "default"
    d = dict(rope_scaling)
    return str(d.get("type") or d.get("rope_type") or "default")


def rope_freqs(cfg: Any) -> mx.array | None:
    """The per-pair rotation periods of a scaled RoPE (see `nn.scaled_rope_freqs`)."""
    return scaled_rope_freqs(dict(cfg.rope_scaling or ()), cfg.head_dim, cfg.rope_theta)


def scaled_rope(p: Any, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The Llama config's RoPE tables (rope_theta, linear / llama3 / YaRN scaling with its
    precomputed `p.rope_freqs` and mscale) over the whole head."""
    return scaled_rope_over(p.config, positions, p.config.head_dim, p.rope_freqs, getattr(mx, p.dtype))


def config_rope(cfg: Any, positions: mx.array, dtype: mx.Dtype, dims: int | None = None,
                ) -> tuple[mx.array, mx.array, mx.array]:
    """`scaled_rope_over` the config's rotated dims (`dims`, else the whole head) with the
    scaled periods computed here: for families whose params hold no precomputed
    `rope_freqs` (a trace-time constant under mx.compile)."""
    dims = dims or cfg.head_dim
    freqs = scaled_rope_freqs(dict(cfg.rope_scaling or ()), dims, cfg.rope_theta)
    return scaled_rope_over(cfg, positions, dims, freqs, dtype)


def scaled_rope_over(cfg: Any, positions: mx.array, dims: int, freqs: mx.array | None,
                     dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """RoPE tables over `dims` rotated dims with the config's scaling: linear's position
    scale, `freqs` (the scaled periods over those dims: `nn.scaled_rope_freqs`), YaRN's /
    longrope's mscale. A partial rotary scales the frequencies of the rotated dims only
    (Hugging Face's dim = head_dim * partial_rotary_factor)."""
    scale = 1.0
    if cfg.rope_type == "linear":
        scale = 1.0 / float(dict(cfg.rope_scaling)["factor"])
    cos, sin, perm = rope_tables(positions, dims, base=cfg.rope_theta, scale=scale, freqs=freqs,
                                 traditional=cfg.rope_traditional)
    m = rope_mscale(cfg)
    if m != 1.0:  # rotation is linear: scaling the tables scales the rotated q and k
        cos, sin = cos * m, sin * m
    # tables in float32, applied in the activation dtype (no silent upcast)
    return cos.astype(dtype), sin.astype(dtype), perm.astype(dtype)


def apply_partial_rope(x: mx.array, rope: tuple, head_dim: int, num: Numerics, traditional: bool) -> mx.array:
    """RoPE over the first rope-table-width dims of each head (partial rotary: the rest
    pass through, as mlx-lm's nn.RoPE(dims < head_dim) does)."""
    rd = rope[0].shape[-1]
    if rd == head_dim:
        return apply_rope(x, *rope, num, traditional)
    return mx.concatenate([apply_rope(x[..., :rd], *rope, None, traditional), x[..., rd:]], axis=-1)


# ---------------------------------------------------------------- attention


@attrs.frozen
class Attention:
    """An attention block's projections alone (`self_attention` reads these; no q/k norms):
    the hybrid families' attention layers."""

    qkv: Linear
    o: Linear
    q_norm: None = None
    k_norm: None = None


def self_attention(
    p: Any, lp: Any, x: mx.array, entry: Any, spec: LayerSpec,
    rope: tuple[mx.array, mx.array, mx.array] | None, geo: StepGeometry,
) -> tuple[mx.array, Any]:
    """The Llama family's attention block on normalized x [B*T, H] -> (o_proj output
    [B*T, H], the written cache entry). lp holds qkv (fused), o and optional q_norm/k_norm:
    per head (qwen3: a weight of head_dim) or over the whole projection (OLMoE: a weight of
    heads * head_dim; with one head the two are the same), and optional sinks [heads]
    (GPT-OSS's attention sinks). rope None: no positional rotation (SmolLM3's NoPE layers).
    x and the output are the step's packed rows when it packs (`StepGeometry.pack`)."""
    cfg, num = p.config, p.numerics
    b, t = geo.positions.shape
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    qkv = geo.unpack(linear(x, lp.qkv, num))  # (packed rows: attention reads the B*T layout)
    scale = getattr(cfg, "attention_multiplier", None) or d**-0.5
    beta = getattr(cfg, "attn_temp_beta", 0.0)
    if (lp.q_norm is None and rope is not None and not beta and fused_write(entry, spec, num)
            and rope[0].shape == rope[1].shape == (b, t, 1, d) and qkv.dtype == rope[0].dtype == mx.float32
            and entry.keys.shape[1] == hk and entry.keys.shape[3] == d and qkv.shape == (b * t, (hq + 2 * hk) * d)):
        # The common layer (no q/k norms, RoPE over whole heads, a dense cache): one node
        # from the projection to q and the written cache, the same values as below.
        q, entry = write_rotated_entry(entry, qkv, hq, rope, cfg.rope_traditional, geo)
        o = attend_entry(entry, spec, q, geo, scale, num, sinks=getattr(lp, "sinks", None), flat=True)
        return linear(geo.pack(o), lp.o, num), entry
    widths = getattr(cfg, "qk_norm_width", ())  # (over every head, but this rank holds some heads)
    whole = lp.q_norm is not None and (lp.q_norm.shape[-1] != d or bool(widths))
    if whole:  # norms over whole projections
        qkv = mx.concatenate([rms_norm(qkv[:, : hq * d], lp.q_norm, eps, num, widths[0] if widths else None,
                                       shard_group(lp.o)),
                              rms_norm(qkv[:, hq * d : (hq + hk) * d], lp.k_norm, eps, num,
                                       widths[1] if widths else None, shard_group(lp.o)),
                              qkv[:, (hq + hk) * d :]], axis=-1)
    qkv = qkv.reshape(b, t, hq + 2 * hk, d)
    qk = qkv[:, :, : hq + hk]
    per_head = lp.q_norm is not None and not whole
    late = per_head and getattr(cfg, "qk_norm_after_rope", False)  # (Hunyuan's: on the rotated heads)
    if per_head and not late:  # qwen3: per-head, before RoPE
        qk = _head_rms_norms(qk, lp, hq, eps)
    if rope is not None:
        qk = apply_partial_rope(qk, rope, d, num, cfg.rope_traditional)  # q and k together: one pass
    if late:
        qk = _head_rms_norms(qk, lp, hq, eps)
    q = qk[:, :, :hq]
    if beta:  # ministral3: a query temperature growing with the position (Llama 4's)
        pos = geo.positions.astype(mx.float32)
        temp = 1 + beta * mx.log(1 + mx.floor(pos / cfg.attn_temp_max_pos))
        q = q * temp[:, :, None, None].astype(q.dtype)
    k = qk[:, :, hq:].transpose(0, 2, 1, 3)
    v = qkv[:, :, hq + hk :].transpose(0, 2, 1, 3)
    # Write first, then attend over the written arrays (so the update can be in place).
    entry = write_entry(entry, spec, k, v, geo, num)
    o = attend_entry(entry, spec, q, geo, scale, num, sinks=getattr(lp, "sinks", None))
    return linear(geo.pack(o.reshape(b * t, hq * d)), lp.o, num), entry


def _head_rms_norms(qk: mx.array, lp: Any, hq: int, eps: float) -> mx.array:
    """q heads [..., :hq, d] and k heads [..., hq:, d] each RMS-normalized with their weight."""
    return mx.concatenate([rms_norm(qk[:, :, :hq], lp.q_norm, eps), rms_norm(qk[:, :, hq:], lp.k_norm, eps)], axis=2)


def head_norm_attention(
    p: Any, lp: Any, x: mx.array, entry: Any, spec: LayerSpec,
    rope: tuple[mx.array, mx.array, mx.array] | None, geo: StepGeometry, traditional: bool,
) -> tuple[mx.array, Any]:
    """Attention whose optional q/k norms are LayerNorms over each head with a weight per
    head (lp.q_norm [heads, head_dim], lp.k_norm [kv_heads, head_dim], no bias: Command R+'s,
    StableLM 2 12B's), then RoPE over the rope tables' leading dims of each head (None: no
    rotation; interleaved pairs where `traditional`); lp: qkv (fused q | k | v), o, q_norm,
    k_norm. Normalized x [B*T, H] -> (o_proj output [B*T, H], the written cache entry)."""
    cfg, num = p.config, p.numerics
    b, t = geo.positions.shape
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = linear(x, lp.qkv, num).reshape(b, t, hq + 2 * hk, d)
    qk = qkv[:, :, : hq + hk]
    if lp.q_norm is not None:
        eps = cfg.rms_norm_eps
        qk = mx.concatenate([lp.q_norm * layer_norm(qk[:, :, :hq], None, None, eps),
                             lp.k_norm * layer_norm(qk[:, :, hq:], None, None, eps)], axis=2)
    if rope is not None:
        qk = apply_partial_rope(qk, rope, d, num, traditional)  # q and k together: one pass
    k, v = qk[:, :, hq:].transpose(0, 2, 1, 3), qkv[:, :, hq + hk :].transpose(0, 2, 1, 3)
    entry = write_entry(entry, spec, k, v, geo, num)  # (write first: the update may be in place)
    o = attend_entry(entry, spec, qk[:, :, :hq], geo, d**-0.5, num)
    return linear(o.reshape(b * t, hq * d), lp.o, num), entry


def decoder_layer(
    p: Any, lp: Any, h: mx.array, entry: Any, spec: LayerSpec,
    rope: tuple[mx.array, mx.array, mx.array] | None, geo: StepGeometry,
) -> tuple[mx.array, Any]:
    """The Llama decoder's layer on the residual stream h: pre-norm attention, then a
    pre-norm SwiGLU MLP (lp: attn_norm, qkv, o, mlp_norm, gate_up, down), each branch
    times granite's residual_multiplier."""
    cfg, num = p.config, p.numerics
    a, entry = self_attention(p, lp, rms_norm(h, lp.attn_norm, cfg.rms_norm_eps, num), entry, spec, rope, geo)
    m = getattr(cfg, "residual_multiplier", 1.0)
    h, x = add_rms_norm(h, a if m == 1.0 else a * m, lp.mlp_norm, cfg.rms_norm_eps, num)
    if m == 1.0:  # (the residual add inside the down projection's node)
        return swiglu_mlp(x, lp.gate_up, lp.down, num, residual=h), entry
    return h + swiglu_mlp(x, lp.gate_up, lp.down, num) * m, entry


# ---------------------------------------------------------------- MLPs


@attrs.frozen
class DenseMlp:
    """A gated SwiGLU MLP: gate|up fused rows, then down."""

    gate_up: Linear
    down: Linear


def swiglu_mlp(x: mx.array, gate_up: Linear, down: Linear, num: Numerics,
               residual: mx.array | None = None) -> mx.array:
    """down(silu(gate(x)) * up(x)) with gate|up fused: one matmul in, one out. residual:
    returned as residual + that (`linear`'s: the add in the down projection's node)."""
    return linear(swiglu_fused(linear(x, gate_up, num), num), down, num, residual=residual)


# ---------------------------------------------------------------- routed experts


@attrs.frozen
class Experts:
    """A layer's routed experts: the router [E, H], the stacked expert MLPs (gate_up
    [E, 2F, H] fused, down [E, H, F]; dense ones stored transposed for gather_mm), and
    qwen2_moe's shared expert with its gate [1, H]."""

    router: Linear
    gate_up: Linear
    down: Linear
    shared_gate_up: Linear | None = None
    shared_down: Linear | None = None
    shared_gate: Linear | None = None  # None: the shared expert is added ungated
    correction_bias: mx.array | None = None  # grouped sigmoid routing's selection bias [E]


def route(logits: Float[mx.array, "N E"], k: int, softmax_then_topk: bool = True,
          norm_topk_prob: bool = False) -> tuple[Int[mx.array, "N K"], Float[mx.array, "N K"]]:
    """Each token's top-k experts and their weights (as mlx-lm computes them): softmax over
    all experts then the k largest (renormalized if norm_topk_prob), or the k largest logits
    then a softmax over those (mixtral, gpt_oss)."""
    if not softmax_then_topk:  # the k largest logits, softmax over them
        idx = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        return idx, mx.softmax(mx.take_along_axis(logits, idx, axis=-1), axis=-1, precise=True)
    probs = mx.softmax(logits, axis=-1, precise=True)
    idx = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
    w = mx.take_along_axis(probs, idx, axis=-1)
    if norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    return idx, w


def grouped_route(
    logits: Float[mx.array, "N E"], correction_bias: mx.array | None, k: int, n_group: int, topk_group: int,
    norm_topk_prob: bool, scale: float, norm_eps: float = 0.0,
) -> tuple[Int[mx.array, "N K"], Float[mx.array, "N K"]]:
    """DeepSeek-V3's routing (Hugging Face's DeepseekV3TopkRouter; GLM-4.5's and
    Nemotron-H's are the same): sigmoid scores plus a correction bias choose the top-k
    experts within the topk_group best of n_group groups (a group scored by its two best;
    the other groups' experts are out, -inf: mlx-lm's 0 let them in over experts whose
    biased score is negative); the weights are the sigmoid scores themselves, renormalized
    if norm_topk_prob (at k = 1 too: a weight of 1; `norm_eps` added to their sum, LFM2-MoE's
    1e-6), times `scale`. No correction bias (None): the scores alone choose (LFM2-MoE
    without use_expert_bias)."""
    scores = mx.sigmoid(logits.astype(mx.float32))
    chosen = scores if correction_bias is None else scores + correction_bias
    if n_group > 1:
        grouped = mx.unflatten(chosen, axis=-1, shape=(n_group, -1))
        best = mx.topk(grouped, 2, axis=-1).sum(axis=-1, keepdims=True)  # [N, G, 1]
        drop = n_group - topk_group
        if drop:
            worst = mx.argpartition(best, kth=drop - 1, axis=-2)[..., :drop, :]
            grouped = mx.put_along_axis(grouped, worst, mx.array(-mx.inf), axis=-2)
        chosen = mx.flatten(grouped, -2, -1)
    idx = mx.argpartition(-chosen, kth=k - 1, axis=-1)[..., :k]
    w = mx.take_along_axis(scores, idx, axis=-1)
    if norm_topk_prob:
        w = w / (w.sum(axis=-1, keepdims=True) + norm_eps if norm_eps else w.sum(axis=-1, keepdims=True))
    return idx, w * scale


def mixture(cfg: Any, ex: Experts, x: mx.array, num: Numerics) -> mx.array:
    """A routed-experts MLP on x [N, H]: each token's top-k SwiGLU experts weighted by the
    router (softmax or, with `cfg.grouped_sigmoid`, DeepSeek-V3's grouped sigmoid), plus a
    shared expert (sigmoid-gated where it has a gate). Reads the MoE config's routing fields
    (top_k, softmax_then_topk, norm_topk_prob, and the grouped ones)."""
    logits = linear(x, ex.router, num)
    if cfg.grouped_sigmoid:
        idx, w = grouped_route(logits, ex.correction_bias, cfg.top_k, cfg.n_group, cfg.topk_group,
                               cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.topk_norm_eps)
    else:
        idx, w = route(logits, cfg.top_k, cfg.softmax_then_topk, cfg.norm_topk_prob)
    y = routed_mixture(x, ex.gate_up, ex.down, idx, w, lambda gu: swiglu_fused(gu, num), num)  # [N, H]
    if ex.shared_gate_up is not None:
        s = swiglu_mlp(x, ex.shared_gate_up, ex.shared_down, num)
        y = y + (s if ex.shared_gate is None else mx.sigmoid(linear(x, ex.shared_gate, num)) * s)
    return y


# mlx-lm's stacked expert names (its sanitized `switch_mlp`), and Hugging Face's one tensor
# per expert (gate, up, down) under the MoE block
STACKED_EXPERT_NAMES = ("switch_mlp.gate_proj", "switch_mlp.up_proj", "switch_mlp.down_proj")
HF_EXPERT_NAMES = ("experts.{e}.gate_proj", "experts.{e}.up_proj", "experts.{e}.down_proj")

# llama.cpp's names of DeepSeek-V3-style routed experts (deepseek2, glm4moe) -> Hugging
# Face's / mlx-lm's: the router, its selection bias, the stacks and the shared experts
GGUF_GROUPED_EXPERT_NAMES = (
    (r"\.ffn_gate_inp\.", ".mlp.gate."), (r"\.exp_probs_b\.bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.ffn_(gate|up|down)_exps\.", r".mlp.switch_mlp.\1_proj."),
    (r"\.ffn_(gate|up|down)_shexp\.", r".mlp.shared_experts.\1_proj."),
)


def expert_stacks(gate: Linear, up: Linear, down: Linear, opts: LoadOptions) -> dict[str, Linear]:
    """The `Experts` fields gate_up (gate|up stacks fused) and down, finished."""
    fused = fuse_experts(gate, up, opts.dtype, opts.keep_quantized)
    return {"gate_up": fused, "down": finish_experts(down, opts.dtype, opts.keep_quantized)}


def read_shared_expert(rd: Reader, hidden: int, width: int, pre: str, gate_name: str | None,
                       names: tuple[str, str, str]) -> dict[str, Any]:
    """The `Experts` fields of a shared expert of `width` features (none: {}): gate|up
    fused, down, and its sigmoid gate [1, H] where `gate_name` names one."""
    if not width:
        return {}
    out = {"shared_gate_up": rd.fused([rd.raw(pre + n, width, hidden) for n in names[:2]]),
           "shared_down": rd.linear(pre + names[2], hidden, width)}
    if gate_name is not None:
        out["shared_gate"] = rd.linear(gate_name, 1, hidden)
    return out

