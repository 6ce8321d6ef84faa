"""Gemma 3 (`gemma3_text`) and Gemma 4 (`gemma4_text`) text models as one pure forward,
following mlx-lm 0.32's implementations (the parity oracle).

Shared by both: sliding-window layers (a ring cache entry each) interleaved with global
layers, each kind with its own RoPE; per-head RMSNorm on q and k; "sandwich" norms around
attention and MLP; a GELU-tanh gated MLP; the embedding scaled by sqrt(hidden).
Gemma 3 stores its norms as (1 + weight): the loader folds the 1 in, so every norm here is a
plain RMSNorm. Gemma 4 adds: global layers with their own head_dim, KV heads and partial
("proportional") RoPE, keys reused as values (k_eq_v), an unscaled RMSNorm on values,
attention scale 1, the last `num_kv_shared_layers` layers attending over an earlier layer's
cache entry instead of their own, per-layer input embeddings, a per-layer output scalar,
double-wide MLPs in KV-shared layers, tanh soft-capped logits, and (the MoE variant)
routed experts beside the dense MLP.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry, advanced, attend_entry, write_entry
from fx_engine.core.config import GemmaConfig, RopeSpec
from fx_engine.core.nn import (Linear, Numerics, apply_rope, embed, expert_linear, fast_exp, linear, rms_norm, rope_tables)
from fx_engine.core.tree import static_field


@attrs.frozen
class MoEBlock:
    """Gemma 4's routed experts beside the dense MLP (mlx-lm's Router + SwitchGLU).

    Expert stacks are `Linear`s with a leading expert axis: gate_up [E, 2F, H] (fused),
    down [E, H, F] (dense ones stored transposed for `gather_mm`, quantized ones as packed
    rows for `gather_qmm`)."""

    router: Linear  # [E, H]
    router_scale: mx.array  # [H], already multiplied by H ** -0.5
    per_expert_scale: mx.array  # [E]
    gate_up: Linear
    down: Linear
    pre_norm: mx.array  # pre_feedforward_layernorm_2
    post_norm: mx.array  # post_feedforward_layernorm_2
    post_mlp_norm: mx.array  # post_feedforward_layernorm_1 (the dense MLP's output)
    top_k: int = static_field(default=1)


@attrs.frozen
class GemmaLayer:
    attn_norm: mx.array
    qkv: Linear  # fused [q; k; v] rows ([q; k] with k_eq_v; [q] in KV-shared layers)
    q_norm: mx.array
    k_norm: mx.array | None  # None in KV-shared layers
    o: Linear
    post_attn_norm: mx.array
    pre_ff_norm: mx.array
    gate_up: Linear  # fused [gate; up] rows
    down: Linear
    post_ff_norm: mx.array
    # Gemma 4 per-layer inputs and output scalar
    pli_gate: Linear | None = None
    pli_proj: Linear | None = None
    pli_norm: mx.array | None = None
    layer_scalar: mx.array | None = None
    moe: MoEBlock | None = None


@attrs.frozen
class GemmaParams:
    __fx_memo_flatten__ = True  # immutable and flattened every step (fx_engine.core.tree)
    embed: Linear
    layers: tuple[GemmaLayer, ...]
    norm: mx.array
    lm_head: Linear | None  # None: tied to the embedding
    embed_per_layer: Linear | None = None  # Gemma 4: [vocab, layers * hidden_per_layer]
    per_layer_proj: Linear | None = None
    per_layer_proj_norm: mx.array | None = None
    config: GemmaConfig = static_field(default=None)
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")


def cache_specs(cfg: GemmaConfig) -> tuple[LayerSpec, ...]:
    """One entry per layer that computes K/V (KV-shared layers have none): sliding layers
    get a window (a ring once `finish_layout` adds the headroom), global layers none."""
    return tuple(
        LayerSpec(cfg.layer_kv_heads(i), cfg.layer_head_dim(i),
                  window=cfg.sliding_window if cfg.is_sliding(i) else None)
        for i in range(cfg.first_shared_layer)
    )


def _rope(cfg: GemmaConfig, spec: RopeSpec, head_dim: int, positions: mx.array, dt: mx.Dtype):
    freqs = None
    if spec.rotary_fraction < 1.0 or spec.freq_factor != 1.0:
        # mlx-lm's ProportionalRoPE: periods factor * theta^(2i / head_dim) for the rotated
        # pairs, infinite (no rotation) for the rest.
        rotated = int(head_dim * spec.rotary_fraction)
        exps = mx.arange(0, rotated, 2, dtype=mx.float32) / head_dim
        freqs = mx.concatenate([
            spec.freq_factor * (spec.theta ** exps),
            mx.full(((head_dim - rotated) // 2,), mx.inf),
        ])
    cos, sin, perm = rope_tables(positions, head_dim, base=spec.theta, scale=spec.scale,
                                 freqs=freqs, traditional=cfg.rope_traditional)
    return cos.astype(dt), sin.astype(dt), perm.astype(dt)


def gelu_tanh(x: mx.array) -> mx.array:
    """GELU, tanh approximation: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi)(x +
    0.044715 x^3); the sigmoid from `fast_exp` (MLX's CPU tanh/exp cost ~25 ns/element)."""
    xf = x.astype(mx.float32)
    u = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)
    return (xf / (1.0 + fast_exp(-2.0 * u))).astype(x.dtype)


def _add(h: mx.array, r: mx.array, clip: bool) -> mx.array:
    """Residual add; Gemma 3 clips float16 sums to the finite range (mlx-lm's clip_residual)."""
    if not clip or h.dtype != mx.float16:
        return h + r
    bound = float(mx.finfo(mx.float16).max)
    return mx.clip(h.astype(mx.float32) + r.astype(mx.float32), -bound, bound).astype(mx.float16)


def _mlp(gate_up: Linear, down: Linear, x: mx.array, num: Numerics) -> mx.array:
    gu = linear(x, gate_up, num)
    f = gu.shape[-1] // 2
    return linear(gelu_tanh(gu[..., :f]) * gu[..., f:], down, num)


def _experts(moe: MoEBlock, h: mx.array, eps: float, num: Numerics) -> mx.array:
    """Route each token [N, H] to its top-k experts (softmax over the k router scores, times
    a per-expert scale) and sum their GELU-gated MLPs; the router reads the residual stream,
    the experts its pre_feedforward_layernorm_2 normalisation (mlx-lm's gemma4_text)."""
    k = moe.top_k
    scores = linear(rms_norm(h, moe.router_scale, eps, num), moe.router, num)  # [N, E]
    idx = mx.argpartition(scores, kth=-k, axis=-1)[..., -k:]  # [N, k]
    w = mx.softmax(mx.take_along_axis(scores, idx, axis=-1), axis=-1) * moe.per_expert_scale[idx]
    x = rms_norm(h, moe.pre_norm, eps, num)[:, None, None, :]  # [N, 1, 1, H]
    gu = expert_linear(x, moe.gate_up, idx)  # [N, k, 1, 2F]
    f = gu.shape[-1] // 2
    y = expert_linear(gelu_tanh(gu[..., :f]) * gu[..., f:], moe.down, idx)[:, :, 0]  # [N, k, H]
    y = (w[..., None].astype(y.dtype) * y).sum(axis=-2)
    return rms_norm(y, moe.post_norm, eps, num)


def forward(
    p: GemmaParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Same contract as `fx_engine.core.models.llama.forward`."""
    cfg, num = p.config, p.numerics
    b, t = tokens.shape
    dt = getattr(mx, p.dtype)
    eps = cfg.rms_norm_eps
    clip = not cfg.is_gemma4
    geo = StepGeometry(cache, n_valid.astype(mx.int32), t, span)
    flat = tokens.reshape(-1)
    h = embed(flat, p.embed).astype(dt) * mx.array(cfg.embed_scale, dt)
    ropes = {}
    for kind, spec in (("sliding", cfg.rope_sliding), ("full", cfg.rope_full)):
        dims = {cfg.layer_head_dim(i) for i in range(cfg.num_layers)
                if cfg.is_sliding(i) == (kind == "sliding")}
        for d in dims:
            ropes[kind, d] = _rope(cfg, spec, d, geo.positions, dt)
    pli = None
    if p.embed_per_layer is not None:  # Gemma 4 per-layer inputs [B*T, L, hidden_per_layer]
        n_l, hpl = cfg.num_layers, cfg.hidden_size_per_layer_input
        tok_part = embed(flat, p.embed_per_layer).astype(dt) * (hpl**0.5)
        proj = linear(h, p.per_layer_proj, num) * (cfg.hidden_size**-0.5)
        proj = rms_norm(proj.reshape(-1, n_l, hpl), p.per_layer_proj_norm, eps, num)
        pli = (proj + tok_part.reshape(-1, n_l, hpl)) * (2.0**-0.5)

    entries = list(cache.layers)
    for i, lp in enumerate(p.layers):
        src = cfg.kv_source(i)
        spec = cache.layout[src]
        hq, d = cfg.num_heads, cfg.layer_head_dim(i)
        hk = cfg.layer_kv_heads(i)
        x = rms_norm(h, lp.attn_norm, eps, num)
        qkv = linear(x, lp.qkv, num).reshape(b, t, -1, d)
        rope = ropes["sliding" if cfg.is_sliding(i) else "full", d]
        q = rms_norm(qkv[:, :, :hq], lp.q_norm, eps, num)
        if src == i:  # this layer computes and stores K/V
            k_raw = qkv[:, :, hq : hq + hk]
            v_raw = k_raw if cfg.k_eq_v(i) else qkv[:, :, hq + hk :]
            k = rms_norm(k_raw, lp.k_norm, eps, num)
            v = mx.fast.rms_norm(v_raw, None, eps) if cfg.v_norm else v_raw
            qk = apply_rope(mx.concatenate([q, k], axis=2), *rope, num, cfg.rope_traditional)
            q, k = qk[:, :, :hq], qk[:, :, hq:]
            entries[i] = write_entry(entries[i], spec, k.transpose(0, 2, 1, 3),
                                     v.transpose(0, 2, 1, 3), geo, num)
        else:
            q = apply_rope(q, *rope, num, cfg.rope_traditional)
        o = attend_entry(entries[src], spec, q, geo, cfg.attn_scale, num).reshape(b * t, hq * d)
        h = _add(h, rms_norm(linear(o, lp.o, num), lp.post_attn_norm, eps, num), clip)
        r = _mlp(lp.gate_up, lp.down, rms_norm(h, lp.pre_ff_norm, eps, num), num)
        if lp.moe is not None:
            r = rms_norm(r, lp.moe.post_mlp_norm, eps, num) + _experts(lp.moe, h, eps, num)
        h = _add(h, rms_norm(r, lp.post_ff_norm, eps, num), clip)
        if pli is not None and lp.pli_gate is not None:
            g = gelu_tanh(linear(h, lp.pli_gate, num)) * pli[:, i]
            h = h + rms_norm(linear(g, lp.pli_proj, num), lp.pli_norm, eps, num)
        if lp.layer_scalar is not None:
            h = h * lp.layer_scalar
    h = rms_norm(h, p.norm, eps, num).reshape(b, t, -1)
    return h, advanced(cache, entries, geo)


def hidden_to_logits(p: GemmaParams, h: Float[mx.array, "*N H"]) -> Float[mx.array, "*N V"]:
    head = p.lm_head if p.lm_head is not None else p.embed
    out = linear(h, head, p.numerics).astype(mx.float32)
    cap = p.config.final_logit_softcapping
    if cap is not None:
        out = mx.tanh(out / cap) * cap
    return out

