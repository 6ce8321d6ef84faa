// Part of fx-engine's native kernels: attention: masked softmax and attend (decode/verify and prefill).
// Not a standalone header: kernels.cpp includes the kernel families in order, inside its
// anonymous namespace, as one translation unit (one compile, everything inlinable).
#pragma once

// ---------------------------------------------------------------- masked softmax
// exp(x) in float32 from multiply-adds: the same polynomial, rounding trick and exponent
// construction as fx_engine.nn.fast_exp (see there for why not libm's exp).
inline v16 vexp(v16 x) {
  const v16 lo = bcast(-127.0f), hi = bcast(128.0f);
  v16 t = x * 1.4426950408889634f;
  t = t < lo ? lo : t;
  t = t > hi ? hi : t;
  const v16 n = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  const v16 f = t - n;
  v16 p = bcast(1.525273380405984e-05f);
  p = p * f + 1.5403530393381608e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.618129107628477e-03f;
  p = p * f + 5.550410866482158e-02f;
  p = p * f + 2.402265069591007e-01f;
  p = p * f + 6.931471805599453e-01f;
  p = p * f + 1.0f;
  const i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;  // 2**n; n=-127 -> 0
  v16 two_n;
  std::memcpy(&two_n, &e, sizeof(two_n));
  return p * two_n;
}

inline float hmax(v16 v) {
  float a[VL];
  std::memcpy(a, &v, sizeof(a));
  float m = a[0];
  for (int i = 1; i < VL; ++i) m = a[i] > m ? a[i] : m;
  return m;
}

constexpr float FMIN = -3.4028234663852886e38f;  // masked scores, as mx.finfo(float32).min

// Masked scores: x where the mask is set, else FMIN (then a fully masked row is uniform,
// like softmax(where(mask, x, finfo.min))).
inline v16 masked(const float* x, const uint8_t* m) {
  const u8x16 mv = *reinterpret_cast<const u8x16*>(m);
  const i32x16 mi = widen_u8(mv);
  return mi != 0 ? load(x) : bcast(FMIN);
}

// One past the last unmasked slot (0 if none).
inline int mask_end(const uint8_t* m, int S) {
  int e = S;
  for (; e >= 8; e -= 8) {  // 8 mask bytes at a time (a row's tail past its end is long)
    uint64_t w;
    std::memcpy(&w, m + e - 8, 8);
    if (w) break;
  }
  while (e > 0 && !m[e - 1]) --e;
  return e;
}

#if defined(FX_AVX2)
// vexp on 8 lanes: the same operations lane by lane (a multiply, the two clamps as selects,
// the rounding trick, the polynomial's multiplies and adds unfused, 2**n built in the
// exponent field; n is integral, so the conversion's rounding mode does not matter).
inline __m256 vexp8(__m256 x) {
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  t = _mm256_max_ps(_mm256_set1_ps(-127.0f), t);  // t < lo ? lo : t (a NaN t stays)
  t = _mm256_min_ps(_mm256_set1_ps(128.0f), t);   // t > hi ? hi : t
  const __m256 big = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(t, big), big);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.525273380405984e-05f);
  for (const float c : {1.5403530393381608e-04f, 1.3333558146428443e-03f, 9.618129107628477e-03f,
                        5.550410866482158e-02f, 2.402265069591007e-01f, 6.931471805599453e-01f, 1.0f})
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// masked() on 8 lanes: x where the mask byte is set, else FMIN.
inline __m256 masked8(const float* x, const uint8_t* m) {
  const __m256i mi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
  const __m256 off = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mi, _mm256_setzero_si256()));
  return _mm256_blendv_ps(_mm256_loadu_ps(x), _mm256_set1_ps(FMIN), off);
}

// softmax_row's vector part on AVX2, each v16 as its two 8-float halves (GCC's lowering of
// the generic 16-float code went through the stack: softmax was ~5% of a 512-token 1B
// prefill on Zen 3). The same lanes, operations and reductions (hmax over lanes 0..15,
// hsum's tree), so the same floats. x, m: the row's first E16 slots (a multiple of 16) and
// the tail padded to 16 by the caller. Returns the row max's vector part.
inline float softmax_max8(const float* x, const uint8_t* m, int E16) {
  __m256 lo = _mm256_set1_ps(FMIN), hi = lo;
  for (int j = 0; j < E16; j += VL) {
    const __m256 a = masked8(x + j, m + j), b = masked8(x + j + 8, m + j + 8);
    lo = _mm256_blendv_ps(lo, a, _mm256_cmp_ps(a, lo, _CMP_GT_OQ));  // v > vm ? v : vm
    hi = _mm256_blendv_ps(hi, b, _mm256_cmp_ps(b, hi, _CMP_GT_OQ));
  }
  return hmax(join(lo, hi));
}
inline v16 softmax_exp8(const float* x, const uint8_t* m, int E16, float mx_, float* out) {
  const __m256 vmx = _mm256_set1_ps(mx_);
  __m256 lo = _mm256_setzero_ps(), hi = lo;
  for (int j = 0; j < E16; j += VL) {
    const __m256 a = vexp8(_mm256_sub_ps(masked8(x + j, m + j), vmx));
    const __m256 b = vexp8(_mm256_sub_ps(masked8(x + j + 8, m + j + 8), vmx));
    _mm256_storeu_ps(out + j, a);
    _mm256_storeu_ps(out + j + 8, b);
    lo = _mm256_add_ps(lo, a);
    hi = _mm256_add_ps(hi, b);
  }
  return join(lo, hi);
}
#endif

// Softmax of one row of scores over its unmasked slots; masked slots get exact zeros and a
// fully masked row is uniform (as softmax(where(mask, x, finfo.min)) gives). Only slots
// before the row's last unmasked one are visited, in a fixed vector order, so the result
// does not depend on S (the attention span, set by the longest row of the batch).
void softmax_row(const float* x, const uint8_t* m, int S, float* out) {
  const int E = mask_end(m, S);
  if (E == 0) {
    for (int j = 0; j < S; ++j) out[j] = 1.0f / static_cast<float>(S);
    return;
  }
  const int E16 = E - E % VL;
#if defined(FX_AVX2)
  float mx_ = softmax_max8(x, m, E16);
#else
  v16 vm = bcast(FMIN);
  for (int j = 0; j < E16; j += VL) {
    const v16 v = masked(x + j, m + j);
    vm = v > vm ? v : vm;
  }
  float mx_ = hmax(vm);
#endif
  for (int j = E16; j < E; ++j) {
    const float v = m[j] ? x[j] : FMIN;
    mx_ = v > mx_ ? v : mx_;
  }
  if (!(mx_ > FMIN)) {
    // No visible score above finfo.min (all -inf, say): then, as the reference
    // softmax(where(mask, x, finfo.min)) over the whole row, every slot at finfo.min
    // (the masked ones) shares the mass. Rare; plain scalar code.
    float sum = 0.0f;
    for (int j = 0; j < S; ++j) {
      const float v = m[j] ? x[j] : FMIN;
      out[j] = v == FMIN ? 1.0f : 0.0f;
      sum += out[j];
    }
    for (int j = 0; j < S; ++j) out[j] = sum > 0.0f ? out[j] / sum : 1.0f / static_cast<float>(S);
    return;
  }
#if defined(FX_AVX2)
  const v16 vs = softmax_exp8(x, m, E16, mx_, out);
#else
  v16 vs = v16{};
  for (int j = 0; j < E16; j += VL) {
    const v16 e = vexp(masked(x + j, m + j) - mx_);
    store(out + j, e);
    vs += e;
  }
#endif
  v16 vt = v16{};
  if (E16 < E) {  // the tail through the same vector code; padding lanes add nothing
    float xt[VL] = {0}, et[VL];
    uint8_t mt[VL] = {0};
    for (int j = E16; j < E; ++j) {
      xt[j - E16] = x[j];
      mt[j - E16] = m[j];
    }
    const v16 e = vexp(masked(xt, mt) - mx_);
    std::memcpy(et, &e, sizeof(et));
    for (int j = E - E16; j < VL; ++j) et[j] = 0.0f;
    for (int j = E16; j < E; ++j) out[j] = et[j - E16];
    vt = load(et);
  }
  const float sum = hsum(vs) + hsum(vt);
  const v16 vsum = bcast(sum);
  for (int j = 0; j < E16; j += VL) store(out + j, load(out + j) / vsum);
  for (int j = E16; j < E; ++j) out[j] = out[j] / sum;
  for (int j = E; j < S; ++j) out[j] = 0.0f;
}

// scores [B, H, T, S], mask [B, T, S] -> probabilities [B, H, T, S]
void masked_softmax_cpu(const float* x, const uint8_t* m, float* out, int B, int H, int T,
                        int S) {
  const int64_t rows = static_cast<int64_t>(B) * H * T;
  const int per = std::max<int64_t>(1, 16384 / std::max(S, 1));
  pool().run(static_cast<int>((rows + per - 1) / per), [&](int c) {
    const int64_t r1 = std::min<int64_t>(rows, (c + 1) * static_cast<int64_t>(per));
    for (int64_t r = c * static_cast<int64_t>(per); r < r1; ++r) {
      const int64_t t = r % T, b = r / (static_cast<int64_t>(H) * T);
      softmax_row(x + r * S, m + (b * T + t) * S, S, out + r * S);
    }
  });
}

// ---------------------------------------------------------------- decode attention
// Grouped-query attention for a few query tokens per row (decode, verify): for each (row,
// KV head) the rep query heads x T tokens are scored against the cached keys, softmaxed
// (softmax_row) and summed over the values, in one pass over that head's K and V and in
// one graph node. K/V may be strided views of the cache (only the head dimension must be
// contiguous), so the span slice costs no copy. Slots past a row's last unmasked one are
// not read at all.

// Fixed-order dot product of two D-vectors (D a multiple of 16).
// The lane sums of 16 vectors at once: out[i] = hsum-like total of v[i]. One transpose-
// and-add tree (45 shuffles and adds for 16 totals, against ~8 per total for a separate
// horizontal sum each), so the scores of a block of 16 keys cost little more than their
// FMAs. Every total is summed in the same fixed order whatever its index i (lanes
// (l, l+2) within each 128-bit quarter, then (l, l+1), then quarters (0+1), (2+3), then
// the two halves), so a key's score never depends on its position in the block.
inline void hsum16(const v16* v, float* out) {
#if defined(__AVX512F__)
  __m512 w[8], u[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = reinterpret_cast<const __m512&>(v[2 * i]);
    const __m512 b = reinterpret_cast<const __m512&>(v[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                   _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                   _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88),
                                      _mm512_shuffle_f32x4(t01, t23, 0xDD)));
#else
  for (int i = 0; i < 16; ++i) out[i] = hsum(v[i]);
#endif
}

template <typename E>
struct Strided4 {  // a [B, H, S, D] view: element (b, h, s, d) at p[b*sb + h*sh + s*ss + d]
  const E* p;
  int64_t sb, sh, ss;
};

// (half_to_float, the portable path of load_kv: scales.h)
// 16 cache values as floats: float32 as they are, float16 converted (exactly).
inline v16 load_kv(const float* p) { return load(p); }
inline v16 load_kv(const uint16_t* p) {
#if defined(__AVX512F__)
  __m512 r = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<v16&>(r);
#elif defined(FX_AVX2) && defined(__F16C__)
  // F16C (every AVX2 CPU has it): exact conversions, as half_to_float
  return join(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
#else
  alignas(64) float f[VL];
  for (int i = 0; i < VL; ++i) f[i] = half_to_float(p[i]);
  return load(f);
#endif
}

// The tiles' accumulators stay in the vector registers: 32 of 16 floats on AVX-512, but 16
// of 8 on AVX2 (and SSE), where a v16 takes two, so there the tiles are half as wide. (8 x 2
// and 4 x 4 vectors of 16 on AVX2 spilled every accumulator on every step: prefill
// attention was a fifth of a 512-token prefill at the 1B shape, Zen 3.) The tile shapes
// only share loads: every score and output element is the same sequence of FMAs.
#if defined(__AVX512F__)
constexpr int PMR = 8;   // score tile: rows
constexpr int PKV = 2;   // score tile: vectors of 16 keys
constexpr int PVD = 4;   // P @ V tile: vectors of 16 of the head dimension (x 4 rows)
#else
constexpr int PMR = 4;
constexpr int PKV = 1;
constexpr int PVD = 1;
#endif

// o[g][c] = sum over j < end[g] of p[g][j] * v[j][16c..16c+16), sequentially over j; the
// rows share each V load up to the smallest end, then finish alone.
#if defined(FX_AVX2)
// 8 cache values as floats (load_kv's halves).
inline __m256 load_kv8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_kv8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// pv_tile and score_tile on AVX2 with each v16 as its two 8-float halves in __m256 values:
// GCC keeps arrays of the 64-byte vector type in memory there and moves them through
// general registers (vmovq / vpinsrq), which made prefill attention a fifth of a 512-token
// prefill at the 1B shape (Zen 3). The same FMAs lane by lane, in the same order.
template <typename E, int MR, int ND>
inline void pv_tile_avx2(const float* const* p, const E* vb, int64_t vs, const int* end,
                         float* const* o) {
  int emin = end[0];
  for (int g = 1; g < MR; ++g) emin = std::min(emin, end[g]);
  __m256 acc[MR][2 * ND];
  #pragma GCC unroll 16
  for (int g = 0; g < MR; ++g)
    #pragma GCC unroll 16
    for (int c = 0; c < 2 * ND; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int j = 0; j < emin; ++j) {
    const E* vj = vb + j * vs;
    __m256 vv[2 * ND];
    #pragma GCC unroll 16
    for (int c = 0; c < 2 * ND; ++c) vv[c] = load_kv8(vj + 8 * c);
    #pragma GCC unroll 16
    for (int g = 0; g < MR; ++g) {
      const __m256 pj = _mm256_broadcast_ss(p[g] + j);
      #pragma GCC unroll 16
      for (int c = 0; c < 2 * ND; ++c) acc[g][c] = _mm256_fmadd_ps(pj, vv[c], acc[g][c]);
    }
  }
  #pragma GCC unroll 16
  for (int g = 0; g < MR; ++g)
    #pragma GCC unroll 16
    for (int c = 0; c < 2 * ND; ++c) _mm256_storeu_ps(o[g] + 8 * c, acc[g][c]);
  for (int g = 0; g < MR; ++g)
    for (int j = emin; j < end[g]; ++j) {
      const __m256 pj = _mm256_broadcast_ss(p[g] + j);
      for (int c = 0; c < 2 * ND; ++c)
        _mm256_storeu_ps(o[g] + 8 * c, _mm256_fmadd_ps(pj, load_kv8(vb + j * vs + 8 * c), _mm256_loadu_ps(o[g] + 8 * c)));
    }
}
#endif

template <typename E, int MR, int ND>
inline void pv_tile(const float* const* p, const E* vb, int64_t vs, const int* end,
                    float* const* o) {
#if defined(FX_AVX2)
  return pv_tile_avx2<E, MR, ND>(p, vb, vs, end, o);
#endif
  int emin = end[0];
  for (int g = 1; g < MR; ++g) emin = std::min(emin, end[g]);
  v16 acc[MR][ND];
  for (int g = 0; g < MR; ++g)
    for (int c = 0; c < ND; ++c) acc[g][c] = v16{};
  for (int j = 0; j < emin; ++j) {
    const E* vj = vb + j * vs;
    v16 vv[ND];
    for (int c = 0; c < ND; ++c) vv[c] = load_kv(vj + c * VL);
    for (int g = 0; g < MR; ++g) {
      const v16 pj = splat(p[g] + j);
      for (int c = 0; c < ND; ++c) acc[g][c] = fma(pj, vv[c], acc[g][c]);
    }
  }
  // The accumulators go to the output and each row's tail (keys past the smallest end)
  // continues there: acc is then only indexed by unrolled compile-time loops and stays in
  // registers (a run-time-bounded loop over acc[g] made GCC keep all of acc in memory,
  // with a store per accumulator per key). The same float32 operations either way.
  for (int g = 0; g < MR; ++g)
    for (int c = 0; c < ND; ++c) store(o[g] + c * VL, acc[g][c]);
  for (int g = 0; g < MR; ++g)
    for (int j = emin; j < end[g]; ++j) {
      const v16 pj = splat(p[g] + j);
      for (int c = 0; c < ND; ++c)
        store(o[g] + c * VL, fma(pj, load_kv(vb + j * vs + c * VL), load(o[g] + c * VL)));
    }
}

template <typename E, int MR>
inline void pv_tile_any(int nd, const float* const* p, const E* vb, int64_t vs, const int* end,
                        float* const* o) {
  switch (nd) {
    case 4: pv_tile<E, MR, 4>(p, vb, vs, end, o); break;
    case 3: pv_tile<E, MR, 3>(p, vb, vs, end, o); break;
    case 2: pv_tile<E, MR, 2>(p, vb, vs, end, o); break;
    default: pv_tile<E, MR, 1>(p, vb, vs, end, o); break;
  }
}

// part[g][jj] = the 16 partial products over D of query row qg[g] with key jj < nj (of
// the keys at kb, stride ks; zeros past nj): q0 * k0, then fma over d = 16, 32, ... in
// order. NG rows share each key load.
template <typename E, int NG, int PG>
inline void score_keys(const float* const* qg, const E* kb, int64_t ks, int nj, int D,
                       v16 (*part)[PG]) {
  for (int jj = 0; jj < nj; ++jj) {
    const E* kj = kb + jj * ks;
    v16 acc[NG];
    const v16 k0 = load_kv(kj);
    for (int g = 0; g < NG; ++g) acc[g] = load(qg[g]) * k0;
    for (int d = VL; d < D; d += VL) {
      const v16 kd = load_kv(kj + d);
      for (int g = 0; g < NG; ++g) acc[g] = fma(load(qg[g] + d), kd, acc[g]);
    }
    for (int g = 0; g < NG; ++g) part[g][jj] = acc[g];
  }
  for (int jj = nj; jj < PG; ++jj)
    for (int g = 0; g < NG; ++g) part[g][jj] = v16{};
}

// E: the cache's element type (float, or uint16_t holding float16 bits: half the bytes to
// read, which is what a decode step's attention waits for).
template <typename E>
void attend_cpu(const float* q, Strided4<E> k, Strided4<E> v, const uint8_t* mask, float scale,
                float* out, int B, int T, int Hq, int Hk, int S, int D) {
  const int rep = Hq / Hk, R = rep * T;
  pool().run(B * Hk, [&](int item) {
    const int b = item / Hk, h = item % Hk;
    thread_local std::vector<float> qs, sc, pr;
    qs.resize(static_cast<size_t>(R) * D);
    sc.resize(static_cast<size_t>(R) * S);
    pr.resize(static_cast<size_t>(R) * S);
    std::vector<int> end(T);
    int emax = 0;
    for (int t = 0; t < T; ++t) {
      end[t] = mask_end(mask + (static_cast<int64_t>(b) * T + t) * S, S);
      emax = std::max(emax, end[t]);
    }
    // query row r = i * T + t: head h * rep + i at token t, pre-scaled (as q * scale)
    for (int i = 0; i < rep; ++i)
      for (int t = 0; t < T; ++t) {
        const float* src = q + ((static_cast<int64_t>(b) * T + t) * Hq + h * rep + i) * D;
        float* dst = qs.data() + static_cast<int64_t>(i * T + t) * D;
        for (int d = 0; d < D; ++d) dst[d] = src[d] * scale;
      }
    const E* kb = k.p + b * k.sb + h * k.sh;
    const E* vb = v.p + b * v.sb + h * v.sh;
    // The query rows of one token t (rows i * T + t, i < rep) see the same keys; they are
    // processed in groups of up to AG, so each K and V vector is loaded (and, for a float16
    // cache, converted) once per group instead of once per row. Every row's arithmetic is
    // the same whatever its group: the grouping only shares loads.
    constexpr int AG = 4;
    // Scores 16 keys at a time: per key one vector of partial products over D, then one
    // hsum16 per row for the block. Keys past a row's last visible slot score 0 (never read).
    for (int j0 = 0; j0 < emax; j0 += VL) {
      const int nj = std::min(VL, emax - j0);
      for (int t = 0; t < T; ++t)
        for (int i0 = 0; i0 < rep; i0 += AG) {
          const int ng = std::min(AG, rep - i0);
          v16 part[AG][VL];
          const float* qg[AG];
          for (int g = 0; g < ng; ++g) qg[g] = qs.data() + static_cast<int64_t>((i0 + g) * T + t) * D;
          switch (ng) {  // a compile-time row count keeps the accumulators in registers
            case 4: score_keys<E, 4>(qg, kb + j0 * k.ss, k.ss, nj, D, part); break;
            case 3: score_keys<E, 3>(qg, kb + j0 * k.ss, k.ss, nj, D, part); break;
            case 2: score_keys<E, 2>(qg, kb + j0 * k.ss, k.ss, nj, D, part); break;
            default: score_keys<E, 1>(qg, kb + j0 * k.ss, k.ss, nj, D, part); break;
          }
          for (int g = 0; g < ng; ++g) {
            alignas(64) float tot[VL];
            hsum16(part[g], tot);
            float* sr = sc.data() + static_cast<int64_t>((i0 + g) * T + t) * S + j0;
            const int e = end[t];
            for (int jj = 0; jj < nj; ++jj) sr[jj] = j0 + jj < e ? tot[jj] : 0.0f;
          }
        }
    }
    for (int r = 0; r < R; ++r) {
      const int t = r % T;
      const uint8_t* mr = mask + (static_cast<int64_t>(b) * T + t) * S;
      softmax_row(sc.data() + static_cast<int64_t>(r) * S, mr, end[t] ? end[t] : S,
                  pr.data() + static_cast<int64_t>(r) * S);
    }
    // P @ V: per group, 4 vectors of the head dimension for each of its rows.
    for (int t = 0; t < T; ++t) {
      const int e = end[t] ? end[t] : S;
      for (int i0 = 0; i0 < rep; i0 += AG) {
        const int ng = std::min(AG, rep - i0);
        const float* p[AG];
        float* o[AG];
        for (int g = 0; g < ng; ++g) {
          p[g] = pr.data() + static_cast<int64_t>((i0 + g) * T + t) * S;
          o[g] = out + ((static_cast<int64_t>(b) * T + t) * Hq + h * rep + i0 + g) * D;
        }
        // The prefill kernel's P @ V tile (every row of the group ends at e): compile-time
        // row and vector counts (with run-time ones GCC turns each key's V loads into a
        // memcpy call).
        static_assert(AG == 4, "ends lists AG values");
        const int ends[AG] = {e, e, e, e};
        for (int d0 = 0; d0 < D; d0 += PVD * VL) {
          const int nd = std::min(PVD * VL, D - d0) / VL;
          float* od[AG];
          for (int g = 0; g < ng; ++g) od[g] = o[g] + d0;
          switch (ng) {
            case 4: pv_tile_any<E, 4>(nd, p, vb + d0, v.ss, ends, od); break;
            case 3: pv_tile_any<E, 3>(nd, p, vb + d0, v.ss, ends, od); break;
            case 2: pv_tile_any<E, 2>(nd, p, vb + d0, v.ss, ends, od); break;
            default: pv_tile_any<E, 1>(nd, p, vb + d0, v.ss, ends, od); break;
          }
        }
      }
    }
  });
}

// Attention for many query tokens per row (prefill chunks): per (row, KV head, block of
// PB tokens) one work item, its rep * PB query rows against the keys up to the block's
// last visible slot, as two register-tiled products:
//   scores: vectors along 16 keys of a transposed copy of K (converted to float once per
//           item), 8 query rows x 32 keys per tile, each q value broadcast: one FMA per
//           (row, key, d), no horizontal sums;
//   P @ V:  vectors along the head dimension, 4 rows x 64 dims per tile, each V row loaded
//           once per tile.
// softmax_row in between (as attend and masked_softmax). Each score is a sequential sum
// over d, each output a sequential sum over the row's visible keys, so a query row's
// result depends only on its own q, mask and the cache, never on the chunk, the block, the
// span or the thread (its order differs from attend's, which is for a few tokens).
constexpr int PB = 16;   // query tokens per work item
constexpr int ATTEND_MAX_T = 16;  // attend_cpu up to this many query tokens per row

// acc[r][c] = sum_d q[r][d] * kt[c][d][0..16), sequentially over d; out rows of stride ld.
#if defined(FX_AVX2)
template <int MR, int NV>
inline void score_tile_avx2(const float* __restrict qs, int D, const float* __restrict kblk,
                            float* __restrict out, int64_t ld) {
  __m256 acc[MR][2 * NV];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 16
    for (int c = 0; c < 2 * NV; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m256 kv[2 * NV];
    #pragma GCC unroll 16
    for (int c = 0; c < 2 * NV; ++c) kv[c] = _mm256_loadu_ps(kblk + static_cast<int64_t>(c / 2) * D * VL + d * VL + 8 * (c % 2));
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m256 qv = _mm256_broadcast_ss(qs + static_cast<int64_t>(r) * D + d);
      #pragma GCC unroll 16
      for (int c = 0; c < 2 * NV; ++c) acc[r][c] = _mm256_fmadd_ps(qv, kv[c], acc[r][c]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 16
    for (int c = 0; c < 2 * NV; ++c) _mm256_storeu_ps(out + r * ld + 8 * c, acc[r][c]);
}
#endif

template <int MR, int NV>
inline void score_tile(const float* __restrict qs, int D, const float* __restrict kblk,
                       float* __restrict out, int64_t ld) {
#if defined(FX_AVX2)
  return score_tile_avx2<MR, NV>(qs, D, kblk, out, ld);
#endif
  v16 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = v16{};
  for (int d = 0; d < D; ++d) {
    v16 kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = load(kblk + static_cast<int64_t>(c) * D * VL + d * VL);
    for (int r = 0; r < MR; ++r) {
      const v16 qv = splat(qs + static_cast<int64_t>(r) * D + d);
      for (int c = 0; c < NV; ++c) acc[r][c] = fma(qv, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) store(out + r * ld + c * VL, acc[r][c]);
}

template <int MR>
inline void score_tile_any(int nv, const float* qs, int D, const float* kblk, float* out,
                           int64_t ld) {
  if (nv == 2)
    score_tile<MR, 2>(qs, D, kblk, out, ld);
  else
    score_tile<MR, 1>(qs, D, kblk, out, ld);
}


template <typename E>
void attend_prefill_cpu(const float* q, Strided4<E> k, Strided4<E> v, const uint8_t* mask,
                        float scale, float* out, int B, int T, int Hq, int Hk, int S, int D) {
  const int rep = Hq / Hk, blocks = (T + PB - 1) / PB;
  // Each query token's last visible slot (+1), and the keys a (row, head) needs at all.
  std::vector<int> ends(static_cast<size_t>(B) * T), kneed(B, 0);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const int e = mask_end(mask + (static_cast<int64_t>(b) * T + t) * S, S);
      ends[static_cast<size_t>(b) * T + t] = e;
      kneed[b] = std::max(kneed[b], e ? e : S);
    }
  // K^T per (row, KV head), in blocks of 16 keys: kt[(j / 16) * D * 16 + d * 16 + j % 16]
  // (float; zeros past a row's keys up to the next whole block), shared by all query
  // blocks of that head. Only the blocks some query block reads are written (and the
  // buffer is not zero-filled first): a query block reads keys below its own last visible
  // slot, rounded up to 16, which is at most kneed rounded up.
  const int kps = (S + VL - 1) / VL * VL;
  const int kmax = *std::max_element(kneed.begin(), kneed.end());
  const int kblocks = (kmax + VL - 1) / VL;
  std::unique_ptr<float[]> ktall(new float[static_cast<size_t>(B) * Hk * kps * D]);
  pool().run(B * Hk * kblocks, [&](int c) {
    const int b = c / (Hk * kblocks), h = (c / kblocks) % Hk, j0 = (c % kblocks) * VL;
    float* blk = ktall.get() + (static_cast<int64_t>(b) * Hk + h) * kps * D + static_cast<int64_t>(j0) * D;
    const E* kb = k.p + b * k.sb + h * k.sh;
    for (int jj = 0; jj < VL; ++jj) {
      const int j = j0 + jj;
      if (j >= kneed[b]) {
        for (int d = 0; d < D; ++d) blk[d * VL + jj] = 0.0f;
        continue;
      }
      const E* kj = kb + j * k.ss;
      for (int d = 0; d < D; d += VL) {
        alignas(64) float tmp[VL];
        store(tmp, load_kv(kj + d));
        for (int cc = 0; cc < VL; ++cc) blk[(d + cc) * VL + jj] = tmp[cc];
      }
    }
  });
  pool().run(B * Hk * blocks, [&](int item) {
    const int b = item / (Hk * blocks), h = (item / blocks) % Hk, t0 = (item % blocks) * PB;
    const int nt = std::min(PB, T - t0), R = nt * rep;  // row r = (t - t0) * rep + i
    thread_local std::vector<float> qs, sc, pr;
    int end[PB];
    int emax = 0;
    for (int t = 0; t < nt; ++t) {
      end[t] = ends[static_cast<size_t>(b) * T + t0 + t];
      emax = std::max(emax, end[t] ? end[t] : S);
    }
    const int kp = (emax + VL - 1) / VL * VL;  // keys rounded up to whole vectors
    qs.resize(static_cast<size_t>(R) * D);
    sc.resize(static_cast<size_t>(R) * kp);
    pr.resize(static_cast<size_t>(R) * kp);
    for (int t = 0; t < nt; ++t)
      for (int i = 0; i < rep; ++i) {
        const float* src = q + ((static_cast<int64_t>(b) * T + t0 + t) * Hq + h * rep + i) * D;
        float* dst = qs.data() + static_cast<int64_t>(t * rep + i) * D;
        for (int d = 0; d < D; ++d) dst[d] = src[d] * scale;
      }
    const float* ktp = ktall.get() + (static_cast<int64_t>(b) * Hk + h) * kps * D;
    const E* vb = v.p + b * v.sb + h * v.sh;
    // Scores [R][kp]: tiles of PMR rows x PKV * 16 keys.
    for (int r0 = 0; r0 < R; r0 += PMR) {
      const int mr = std::min(PMR, R - r0);
      for (int j0 = 0; j0 < kp; j0 += PKV * VL) {
        const int nv = std::min(PKV, (kp - j0) / VL);
        const float* qr = qs.data() + static_cast<int64_t>(r0) * D;
        const float* kblk = ktp + static_cast<int64_t>(j0) * D;
        float* o = sc.data() + static_cast<int64_t>(r0) * kp + j0;
        if (mr == PMR) {
          score_tile_any<PMR>(nv, qr, D, kblk, o, kp);
        } else {
          for (int r = 0; r < mr; ++r)  // the last rows: one at a time, the same sums
            score_tile_any<1>(nv, qr + static_cast<int64_t>(r) * D, D, kblk, o + r * kp, kp);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int t = r / rep;
      const uint8_t* mr = mask + (static_cast<int64_t>(b) * T + t0 + t) * S;
      const int n = end[t] ? end[t] : S;
      softmax_row(sc.data() + static_cast<int64_t>(r) * kp, mr, n, pr.data() + static_cast<int64_t>(r) * kp);
    }
    // P @ V: tiles of 4 rows x 4 vectors of the head dimension; each row sums its own
    // visible keys in order (rows of a tile share the V loads up to the smallest end).
    for (int r0 = 0; r0 < R; r0 += 4) {
      const int mr = std::min(4, R - r0);
      for (int d0 = 0; d0 < D; d0 += PVD * VL) {
        const int nd = std::min(PVD * VL, D - d0) / VL;
        const float* pp[4];
        float* oo[4];
        int er[4];
        for (int g = 0; g < mr; ++g) {
          const int r = r0 + g, t = r / rep, i = r % rep;
          er[g] = end[t] ? end[t] : S;
          pp[g] = pr.data() + static_cast<int64_t>(r) * kp;
          oo[g] = out + ((static_cast<int64_t>(b) * T + t0 + t) * Hq + h * rep + i) * D + d0;
        }
        if (mr == 4) {
          pv_tile_any<E, 4>(nd, pp, vb + d0, v.ss, er, oo);
        } else {
          for (int g = 0; g < mr; ++g) pv_tile_any<E, 1>(nd, pp + g, vb + d0, v.ss, er + g, oo + g);
        }
      }
    }
  });
}
