"""The Llama family as one pure forward: llama (2/3, rope scaling linear/llama3), mistral,
qwen2 (q/k/v bias), qwen3 (q/k RMSNorm), SmolLM2; tied or untied embeddings.

Projections are fused at load time (q|k|v into one matrix, gate|up into one): fewer graph
nodes, and on CPU each node costs ~10 us to evaluate whatever its size.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.cache import (KVCache, LayerSpec, StepGeometry, advanced, attend_entry, dense_layout, write_entry)
from fx_engine.core.config import ModelConfig
from fx_engine.core.nn import (Linear, Numerics, apply_rope, embed, linear, rms_norm, rope_tables, swiglu_fused)
from fx_engine.core.tree import static_field


@attrs.frozen
class LayerParams:
    attn_norm: mx.array
    qkv: Linear  # fused [q; k; v] rows
    o: Linear
    mlp_norm: mx.array
    gate_up: Linear  # fused [gate; up] rows
    down: Linear
    q_norm: mx.array | None = None
    k_norm: mx.array | None = None


@attrs.frozen
class Params:
    __fx_memo_flatten__ = True  # immutable and flattened every step: memoize (fx_engine.core.tree)
    embed: Linear
    layers: tuple[LayerParams, ...]
    norm: mx.array
    lm_head: Linear | None  # None: tied to the embedding
    rope_freqs: mx.array | None  # precomputed for llama3 scaling, else None
    config: ModelConfig = static_field()
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")  # activation/cache dtype name


def _rope(p: Params, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    cfg = p.config
    scale = 1.0
    if cfg.rope_type == "linear":
        scale = 1.0 / float(dict(cfg.rope_scaling)["factor"])
    cos, sin, perm = rope_tables(
        positions, cfg.head_dim, base=cfg.rope_theta, scale=scale,
        freqs=p.rope_freqs, traditional=cfg.rope_traditional,
    )
    dt = _dtype(p)  # tables in float32, applied in the activation dtype (no silent upcast)
    return cos.astype(dt), sin.astype(dt), perm.astype(dt)


def _layer(
    p: Params, lp: LayerParams, h: mx.array, entry: Any, spec: LayerSpec,
    rope: tuple[mx.array, mx.array, mx.array], geo: StepGeometry,
) -> tuple[mx.array, Any]:
    cfg, num = p.config, p.numerics
    b, t = geo.positions.shape
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = rms_norm(h, lp.attn_norm, cfg.rms_norm_eps, num)
    qkv = linear(x, lp.qkv, num).reshape(b, t, hq + 2 * hk, d)
    if lp.q_norm is not None:  # qwen3: per-head RMSNorm on q and k before RoPE
        qk = mx.concatenate(
            [rms_norm(qkv[:, :, :hq], lp.q_norm, cfg.rms_norm_eps),
             rms_norm(qkv[:, :, hq : hq + hk], lp.k_norm, cfg.rms_norm_eps)], axis=2)
    else:
        qk = qkv[:, :, : hq + hk]
    qk = apply_rope(qk, *rope, num, cfg.rope_traditional)  # q and k together: one pass per layer
    q = qk[:, :, :hq]
    k = qk[:, :, hq:].transpose(0, 2, 1, 3)
    v = qkv[:, :, hq + hk :].transpose(0, 2, 1, 3)
    # Write first, then attend over the written arrays (so the update can be in place).
    entry = write_entry(entry, spec, k, v, geo, num)
    o = attend_entry(entry, spec, q, geo, d**-0.5, num)
    o = o.reshape(b * t, hq * d)
    h = h + linear(o, lp.o, num)
    x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps, num)
    gu = linear(x, lp.gate_up, num)
    h = h + linear(swiglu_fused(gu, num), lp.down, num)
    return h, entry


def cache_specs(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    """One dense full-attention cache entry per layer."""
    return dense_layout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def forward(
    p: Params, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Run T tokens per row from each row's current length; advance lengths by n_valid.

    span (static): attend over cache slots [0, span) only; the caller guarantees
    max(lengths) + T <= span <= capacity (see `span_bucket`). None: the whole capacity.

    Returns the final-norm hidden states [B, T, hidden] and the new cache. Positions past
    a row's n_valid (and past the capacity) are computed but written to the cache's sink
    slot: a row's valid entries are never touched by another row's step.
    """
    b, t = tokens.shape
    geo = StepGeometry(cache, n_valid.astype(mx.int32), t, span)
    # The residual stream is kept 2-D [B*T, hidden]: matmuls on 2-D inputs need no
    # flatten/unflatten nodes (each graph node costs ~10 us on CPU).
    h = embed(tokens.reshape(-1), p.embed).astype(_dtype(p))
    rope = _rope(p, geo.positions)  # shared by every layer
    entries = []
    for lp, entry, spec in zip(p.layers, cache.layers, cache.layout):
        h, entry = _layer(p, lp, h, entry, spec, rope, geo)
        entries.append(entry)
    h = rms_norm(h, p.norm, p.config.rms_norm_eps, p.numerics).reshape(b, t, -1)
    return h, advanced(cache, entries, geo)


def _dtype(p: Params) -> mx.Dtype:
    return getattr(mx, p.dtype)


def hidden_to_logits(p: Params, h: Float[mx.array, "*N H"]) -> Float[mx.array, "*N V"]:
    head = p.lm_head if p.lm_head is not None else p.embed
    return linear(h, head, p.numerics).astype(mx.float32)
