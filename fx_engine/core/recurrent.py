"""Pure scans of recurrent layers over a step of T tokens per row, from a per-row state:
the causal depthwise convolution (LFM2, Mamba-2's conv) and the Mamba-2 SSM in its chunked
(SSD) form. Each returns the outputs, the state after each row's valid tokens and, when
asked (a verify step), the state after every position 0 .. T.

Padding (positions past a row's n_valid) never enters a state: conv inputs there are zeros
and the state is gathered at n_valid; the SSM's time step is 0 there (no decay, no input).
"""

from __future__ import annotations

import mlx.core as mx
from jaxtyping import Float, Int

__all__ = ["causal_conv", "gated_delta_scan", "ssd_scan", "SSD_CHUNK"]

#: Positions per block of the SSM's chunked scan (its intra-block matrices are [T, T] per head).
SSD_CHUNK = 64


def causal_conv(
    x: Float[mx.array, "B T C"], state: Float[mx.array, "B K1 C"], w: Float[mx.array, "C K"],
    n_valid: Int[mx.array, "B"], keep_steps: bool = False,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """A causal depthwise convolution with K = K1 + 1 taps (tap K - 1 on the current input,
    as mlx-lm's Conv1d over [state; x]): (out [B, T, C], the new state: the K - 1 inputs
    before each row's n_valid, per-position states [B, T + 1, K - 1, C] or None). x must
    already be zero past n_valid."""
    t, k = x.shape[1], w.shape[1]
    full = mx.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K - 1 + T, C]
    w = w.astype(x.dtype)
    out = full[:, 0:t] * w[:, 0]
    for j in range(1, k):
        out = out + full[:, j : j + t] * w[:, j]
    taps = mx.arange(k - 1, dtype=mx.int32)
    new = mx.take_along_axis(full, (n_valid[:, None] + taps[None, :])[..., None], axis=1)
    steps = None
    if keep_steps:
        steps = full[:, mx.arange(t + 1, dtype=mx.int32)[:, None] + taps[None, :]]
    return out, new, steps


def _heads(m: mx.array, heads: int) -> mx.array:
    """[B, T, G, N] -> [B, T, H, N]: head h reads group h // (H / G) (consecutive heads share)."""
    g = m.shape[2]
    return m if g == heads else mx.repeat(m, heads // g, axis=2)


def ssd_scan(
    x: Float[mx.array, "B T H P"], dt: Float[mx.array, "B T H"], a: Float[mx.array, "H"],
    b: Float[mx.array, "B T G N"], c: Float[mx.array, "B T G N"], state: Float[mx.array, "B H P N"],
    keep_steps: bool = False, chunk: int = SSD_CHUNK,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """The Mamba-2 recurrence S_t = exp(dt_t a) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t, in
    float32, by blocks of `chunk` positions (within a block its quadratic "attention" form,
    across blocks the carried state): (y [B, T, H, P] without the D skip, the state after the
    step, per-position states [B, T + 1, H, P, N] when keep_steps). dt is 0 at padding."""
    bsz, t, h, p = x.shape
    x, dt = x.astype(mx.float32), dt.astype(mx.float32)
    bh, ch = _heads(b, h).astype(mx.float32), _heads(c, h).astype(mx.float32)
    s = state.astype(mx.float32)
    ys, steps = [], [s[:, None]] if keep_steps else None
    size = t if keep_steps else min(chunk, t)
    for lo in range(0, t, size):
        hi = min(t, lo + size)
        n = hi - lo
        xc = x[:, lo:hi].transpose(0, 2, 1, 3)  # [B, H, L, P]
        bc = bh[:, lo:hi].transpose(0, 2, 1, 3)  # [B, H, L, N]
        cc = ch[:, lo:hi].transpose(0, 2, 1, 3)
        dtc = dt[:, lo:hi].transpose(0, 2, 1)  # [B, H, L]
        cs = mx.cumsum(dtc * a[None, :, None], axis=-1)  # [B, H, L]
        causal = mx.arange(n)[:, None] >= mx.arange(n)[None, :]
        decay = mx.where(causal, mx.exp(mx.where(causal, cs[..., :, None] - cs[..., None, :], 0.0)), 0.0)
        w = decay * dtc[..., None, :]  # [B, H, L(t), L(s)]: exp(cs_t - cs_s) dt_s, s <= t
        y = ((cc @ bc.transpose(0, 1, 3, 2)) * w) @ xc  # intra-block
        y = y + mx.exp(cs)[..., None] * (cc @ s.transpose(0, 1, 3, 2))  # from the carried state
        ys.append(y.transpose(0, 2, 1, 3))
        if keep_steps:  # the state after every position of the block
            xb = (xc[..., :, None] * bc[..., None, :]).reshape(bsz, h, n, p * bc.shape[-1])
            per = (w @ xb).reshape(bsz, h, n, p, -1) + mx.exp(cs)[..., None, None] * s[:, :, None]
            steps.append(per.transpose(0, 2, 1, 3, 4))
        last = cs[..., -1:]  # [B, H, 1]
        wl = mx.exp(last - cs) * dtc  # [B, H, L]
        s = mx.exp(last)[..., None] * s + (xc * wl[..., None]).transpose(0, 1, 3, 2) @ bc
    y = mx.concatenate(ys, axis=1) if len(ys) > 1 else ys[0]
    return y, s, (mx.concatenate(steps, axis=1) if keep_steps else None)


def gated_delta_scan(
    q: Float[mx.array, "B T H K"], k: Float[mx.array, "B T H K"], v: Float[mx.array, "B T H V"],
    log_g: Float[mx.array, "B T H"], beta: Float[mx.array, "B T H"], state: Float[mx.array, "B H V K"],
    keep_steps: bool = False, chunk: int = SSD_CHUNK,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5), per head:

        S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,   o_t = S_t q_t

    in float32, by blocks of `chunk` positions. Within a block, with G_t the product of the
    decays since the block's start, S_t = G_t S_0 + sum_{r<=t} (G_t / G_r) u_r k_r^T, where
    the pseudo-values u solve the unit lower-triangular system
    u_t + beta_t sum_{r<t} (G_t / G_r)(k_t . k_r) u_r = beta_t (v_t - G_t S_0 k_t)
    (one triangular solve per block and head instead of a loop over tokens). Returns
    (o [B, T, H, V], the state after the step, per-position states [B, T + 1, H, V, K] when
    keep_steps). Padding: beta 0 and log_g 0 there (the state passes through)."""
    bsz, t, h, dk = q.shape
    dv = v.shape[-1]
    f32 = mx.float32
    q, k, v = (a.astype(f32).transpose(0, 2, 1, 3) for a in (q, k, v))  # [B, H, T, *]
    lg, be = log_g.astype(f32).transpose(0, 2, 1), beta.astype(f32).transpose(0, 2, 1)  # [B, H, T]
    s = state.astype(f32)
    ys, steps = [], [s[:, None]] if keep_steps else None
    size = t if keep_steps else min(chunk, t)
    for lo in range(0, t, size):
        hi = min(t, lo + size)
        n = hi - lo
        qc, kc, vc = q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi]
        cs = mx.cumsum(lg[:, :, lo:hi], axis=-1)  # [B, H, L]
        bc = be[:, :, lo:hi]
        ar = mx.arange(n)
        incl = ar[:, None] >= ar[None, :]
        ratio = mx.where(incl, mx.exp(mx.where(incl, cs[..., :, None] - cs[..., None, :], 0.0)), 0.0)
        strict = (ar[:, None] > ar[None, :]).astype(f32)
        gam = mx.exp(cs)[..., None]  # [B, H, L, 1]
        a = (kc @ kc.transpose(0, 1, 3, 2)) * ratio * strict * bc[..., None]
        rhs = bc[..., None] * (vc - gam * (kc @ s.transpose(0, 1, 3, 2)))  # [B, H, L, V]
        # (MLX's linear algebra runs on the CPU stream only: on a GPU this op goes there)
        u = mx.linalg.solve_triangular(a + mx.eye(n, dtype=f32), rhs, upper=False, stream=mx.cpu)
        o = gam * (qc @ s.transpose(0, 1, 3, 2)) + ((qc @ kc.transpose(0, 1, 3, 2)) * ratio) @ u
        ys.append(o.transpose(0, 2, 1, 3))
        if keep_steps:  # S_t = G_t S_0 + sum_{r <= t} ratio[t, r] u_r k_r^T
            uk = (u[..., :, None] * kc[..., None, :]).reshape(bsz, h, n, dv * dk)
            per = (ratio @ uk).reshape(bsz, h, n, dv, dk) + gam[..., None] * s[:, :, None]
            steps.append(per.transpose(0, 2, 1, 3, 4))
        last = cs[..., -1:]
        w = mx.exp(last - cs)[..., None]  # [B, H, L, 1]
        s = mx.exp(last)[..., None] * s + (u * w).transpose(0, 1, 3, 2) @ kc
    y = mx.concatenate(ys, axis=1) if len(ys) > 1 else ys[0]
    return y, s, (mx.concatenate(steps, axis=1) if keep_steps else None)
