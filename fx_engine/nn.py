"""Shared pure layers: linear (dense or affine-quantized), norms, RoPE, attention.

Everything here is a pure function of arrays and static metadata. `Numerics` is static
metadata carried by the params pytree; it selects the batch-invariant matmul mode.
"""

from __future__ import annotations

import attrs
import mlx.core as mx

from .tree import static_field


@attrs.frozen
class Numerics:
    """Static numerics policy (part of the compile key).

    batch_invariant: every matmul runs on fixed-size row tiles (`tile` rows, zero-padded),
    so one row's arithmetic never depends on how many other rows share the GEMM (the batch,
    or the prefill chunk). With an optimized BLAS the kernel choice and blocking depend on M,
    which otherwise changes a row's result in the last bits.
    """

    batch_invariant: bool = False
    tile: int = 8


@attrs.frozen
class Linear:
    """y = x @ W.T (+ bias). Dense (float weight [out, in]) or MLX affine-quantized."""

    weight: mx.array
    bias: mx.array | None = None
    scales: mx.array | None = None
    biases: mx.array | None = None
    group_size: int = static_field(default=0)
    bits: int = static_field(default=0)

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


def _matmul_rows(x: mx.array, lin: Linear) -> mx.array:
    if lin.quantized:
        return mx.quantized_matmul(
            x, lin.weight, lin.scales, lin.biases,
            transpose=True, group_size=lin.group_size, bits=lin.bits,
        )
    return x @ lin.weight.T


def _tiled(fn, x2: mx.array, tile: int) -> mx.array:
    """Apply a row-wise matmul on fixed-size row tiles: [M, K] -> [M, N]."""
    m = x2.shape[0]
    pad = (-m) % tile
    if pad:
        x2 = mx.concatenate([x2, mx.zeros((pad, x2.shape[1]), x2.dtype)], axis=0)
    xt = x2.reshape(-1, tile, x2.shape[1])  # batched GEMM: every call has M = tile
    y = fn(xt)
    y = y.reshape(-1, y.shape[-1])
    return y[:m] if pad else y


def linear(x: mx.array, lin: Linear, numerics: Numerics) -> mx.array:
    if numerics.batch_invariant:
        lead = x.shape[:-1]
        y = _tiled(lambda t: _matmul_rows(t, lin), x.reshape(-1, x.shape[-1]), numerics.tile)
        y = y.reshape(*lead, y.shape[-1])
    else:
        y = _matmul_rows(x, lin)
    if lin.bias is not None:
        y = y + lin.bias
    return y


def embed(tokens: mx.array, table: Linear) -> mx.array:
    """Look up rows of an embedding table (dequantizing only the gathered rows)."""
    if table.quantized:
        return mx.dequantize(
            table.weight[tokens], table.scales[tokens], table.biases[tokens],
            group_size=table.group_size, bits=table.bits,
        )
    return table.weight[tokens]


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


def rope(
    x: mx.array, offsets: mx.array, *, base: float | None, scale: float,
    traditional: bool, freqs: mx.array | None,
) -> mx.array:
    """RoPE on x [B, H, T, D] with a per-row start position offsets [B] (int32)."""
    return mx.fast.rope(
        x, x.shape[-1], traditional=traditional, base=base, scale=scale,
        offset=offsets, freqs=freqs,
    )


def attention(
    q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float, numerics: Numerics
) -> mx.array:
    """Softmax attention of q [B, Hq, T, D] over k/v [B, Hk, S, D] with a bool mask [B,1,T,S].

    The default path is MLX's SDPA. The batch-invariant path spells out the same math with
    the query axis cut into fixed tiles, so a query's scores never depend on the chunk size.
    """
    if not numerics.batch_invariant:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    b, hq, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    rep = hq // hk
    tile = numerics.tile
    pad = (-t) % tile
    if pad:
        q = mx.concatenate([q, mx.zeros((b, hq, pad, d), q.dtype)], axis=2)
        mask = mx.concatenate([mask, mx.ones((b, 1, pad, s), mx.bool_)], axis=2)
    tp = t + pad
    # [B, Hk, rep, nT, tile, D]: every GEMM has M = tile rows.
    qt = (q * scale).reshape(b, hk, rep, tp // tile, tile, d)
    kt = k[:, :, None, None]
    vt = v[:, :, None, None]
    scores = qt @ kt.swapaxes(-1, -2)  # [B, Hk, rep, nT, tile, S]
    m = mask.reshape(b, 1, 1, tp // tile, tile, s)
    scores = mx.where(m, scores, mx.finfo(scores.dtype).min)
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype)
    out = (probs @ vt).reshape(b, hq, tp, d)
    return out[:, :, :t] if pad else out


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return gate * mx.sigmoid(gate) * up
