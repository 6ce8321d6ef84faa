// Part of fx-engine's native kernels: pointwise kernels: RMSNorm, SwiGLU, RoPE.
// Not a standalone header: kernels.cpp includes the kernel families in order, inside its
// anonymous namespace, as one translation unit (one compile, everything inlinable).
#pragma once

// ---------------------------------------------------------------- rms norm
void rms_norm_cpu(const float* x, const float* w, float eps, float* out, int64_t M, int D) {
  const int D16 = D - D % VL;
  const int per = std::max(1, 65536 / std::max(D, 1));
  pool().run(static_cast<int>((M + per - 1) / per), [&](int c) {
    const int64_t r1 = std::min<int64_t>(M, (c + 1) * static_cast<int64_t>(per));
    for (int64_t r = c * static_cast<int64_t>(per); r < r1; ++r) {
      const float* xr = x + r * D;
      float* o = out + r * D;
      v16 acc = v16{};
      for (int j = 0; j < D16; j += VL) {
        const v16 v = load(xr + j);
        acc += v * v;
      }
      float ss = hsum(acc);
      for (int j = D16; j < D; ++j) ss += xr[j] * xr[j];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
      for (int j = 0; j < D16; j += VL) store(o + j, (load(xr + j) * inv) * load(w + j));
      for (int j = D16; j < D; ++j) o[j] = (xr[j] * inv) * w[j];
    }
  });
}

// ---------------------------------------------------------------- swiglu
// gu [M, 2F] (the fused gate|up projection) -> silu(gate) * up [M, F], as
// fx_engine.nn.swiglu computes it: g / (1 + fast_exp(-g)) * u, in one pass (MLX's graph
// for it is seven nodes plus two slices).
void swiglu_cpu(const float* gu, float* out, int64_t M, int F) {
  const int F16 = F - F % VL;
  const int per = std::max(1, 32768 / std::max(F, 1));
  pool().run(static_cast<int>((M + per - 1) / per), [&](int c) {
    const int64_t r1 = std::min<int64_t>(M, (c + 1) * static_cast<int64_t>(per));
    for (int64_t r = c * static_cast<int64_t>(per); r < r1; ++r) {
      const float* g = gu + r * 2 * F;
      const float* u = g + F;
      float* o = out + r * F;
      for (int j = 0; j < F16; j += VL) {
        const v16 gv = load(g + j);
        store(o + j, gv / (1.0f + vexp(v16{} - gv)) * load(u + j));
      }
      if (F16 < F) {  // the tail through one padded vector
        alignas(64) float tg[VL] = {}, tu[VL] = {}, to[VL];
        for (int j = F16; j < F; ++j) tg[j - F16] = g[j], tu[j - F16] = u[j];
        const v16 gv = load(tg);
        store(to, gv / (1.0f + vexp(v16{} - gv)) * load(tu));
        for (int j = F16; j < F; ++j) o[j] = to[j - F16];
      }
    }
  });
}

// ---------------------------------------------------------------- rope
// x [N, H, D] rotated with per-token tables cos/sin [N, D] (sin already signed, as
// fx_engine.nn.rope_tables builds them): out[d] = x[d] * cos[d] + x[partner(d)] * sin[d],
// partner(d) = d ^ 1 (traditional: adjacent pairs) or (d + D/2) mod D (halves). Replaces
// the `x @ P` permutation matmul, which called into BLAS once per layer.
void rope_cpu(const float* x, const float* c, const float* sn, float* out, int64_t N, int H,
              int D, bool traditional) {
  const int half = D / 2;
  for (int64_t n = 0; n < N; ++n) {
    const float* cn = c + n * D;
    const float* sv = sn + n * D;
    for (int h = 0; h < H; ++h) {
      const float* xr = x + (n * H + h) * D;
      float* o = out + (n * H + h) * D;
      if (traditional) {
        for (int d = 0; d < D; ++d) o[d] = xr[d] * cn[d] + xr[d ^ 1] * sv[d];
      } else {
        for (int d = 0; d < half; ++d) o[d] = xr[d] * cn[d] + xr[d + half] * sv[d];
        for (int d = half; d < D; ++d) o[d] = xr[d] * cn[d] + xr[d - half] * sv[d];
      }
    }
  }
}
