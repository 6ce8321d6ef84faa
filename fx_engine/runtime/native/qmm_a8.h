// Part of fx-engine's native kernels: the 8-bit-activation matmul qmm_a8 (int8 dot products: AVX-512 VNNI, AVX2 vpmaddubsw, scalar).
// Not a standalone header: kernels.cpp includes the kernel families in order, inside its
// anonymous namespace, as one translation unit (one compile, everything inlinable).
#pragma once

// ---------------------------------------------------------------- qmm_a8
// The quantized product with 8-bit activations: an opt-in numerics mode
// (fx_engine.nn.Numerics.activation_bits = 8), the kind llama.cpp runs its Q4/Q8 weights
// with. Each row of x is rounded per weight group (gs values): d = amax / 127,
// xq = rint(x * 127 / amax) in [-127, 127], and
//
//   y[m, n] = sum over groups g, in order, of
//               (s[n, g] * d[m, g]) * isum(m, n, g) + b[n, g] * (d[m, g] * sum_g xq[m, :])
//
// where isum = sum_g q[n, k] * xq[m, k] is an exact int32 (VNNI dot products: 64 u8 x s8
// products per instruction, against 16 float FMAs). So the only float arithmetic is two
// FMAs per group, in a fixed order: like the float kernels it is batch-invariant by
// construction, and since the integer sums are exact, any tiling gives the same bits.
// No float copy of the weights is made (qmm/qgemm dequantize each weight to a float
// first), which is what makes it ~3x faster for a few rows.
//
// Layout of the tiles: vectors along the rows (16 rows per tile on VNNI builds, also 8 in
// the scalar fallback; one int32 lane each); every lane multiplies a broadcast quad of 4 weight bytes with its row's 4
// activation bytes. The weight bytes are in the weight rows' order: 8-bit weights straight
// from the packed words (little-endian, k order), 4-bit ones unpacked per call into the
// split order of dequant_row (low nibbles of a 32-block first), which the activations are
// packed in too; an interleaved weight's 16-row block is read quad-major instead (a8_tile's
// QM: 8-bit blocks as stored, 4-bit ones split into nibble quads, il16_quads4). Up to 32 rows on AVX-512 VNNI builds: the few-row path (a8_few_block, 8 rows a pass),
// vectors along 16 features instead, with the same bits. AVX2 builds (and AVX-512 builds
// without VNNI) run an 8-feature version of that path at every row count (a8_few8_block:
// vpmaddubsw/vpmaddwd, or AVX-VNNI's ymm vpdpbusd; one row on an interleaved weight both
// halves of a 16-row block at once, a8_few16_il; tiles of 2-8 rows spelled out for 4-bit
// groups of 32, a8_il4_g32_tile, and 5-/6-bit planes in groups of 16 or 32, a8_p_tile), the same bits again. 5-/6-bit planes
// above 8 rows on VNNI builds: the tiles over ilp_quads' bytes. On CPUs with AMX the tiles
// of an interleaved weight take their integer sums from tile multiplies (amx.h), the same bits.
constexpr int A8_FEAT = 12;  // output features per tile

#if defined(__AVX512VNNI__)
// acc += dot4(a u8, b s8) per int32 lane, in place. (GCC's intrinsic copies every
// accumulator through another register around each dot product: twice the uops.)
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
#endif

// W lanes of int32 sums (I) and of floats (F): 16 (a zmm: the VNNI tiles' 16 rows, the
// few-row paths' 16 features), 8 (a ymm: the AVX2 few-row path's 8 features), 1 (scalar).
template <int W> struct A8Vec;
#if defined(__AVX512F__)
template <> struct A8Vec<16> {
  using I = __m512i;
  using F = __m512;
  static I izero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static I iload(const void* p) { return _mm512_loadu_si512(p); }
  static I ibcast(int32_t v) { return _mm512_set1_epi32(v); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static F fbcast(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif
#if defined(__AVX2__) && defined(__FMA__)
template <> struct A8Vec<8> {
  using I = __m256i;
  using F = __m256;
  static F fbcast(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
};
#endif
template <> struct A8Vec<1> {
  using I = int32_t;
  using F = float;
  static F fbcast(float v) { return v; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F cvt(I a) { return static_cast<float>(a); }
};

// The per-group float step of every qmm_a8 kernel (the formula above), lane by lane:
// acc + isum * (d * s), then + xs * b, two FMAs in this order (d and xs: the activation
// row's factor and scaled sum for the group; s and b: the feature's scale and bias).
template <class V>
inline typename V::F a8_step(typename V::F acc, typename V::I is, typename V::F d, typename V::F s,
                             typename V::F xs, typename V::F b) {
  return V::fma(xs, b, V::fma(V::cvt(is), V::mul(d, s), acc));
}

// The few-row paths' step for group g: MR rows (pack_a8's tile of R rows: d, xs at [g][R])
// against one block's scale and bias vectors s and b.
template <class V, int MR>
inline void a8_group(typename V::F (&acc)[MR], const typename V::I (&is)[MR], typename V::F s, typename V::F b,
                     const float* dd, const float* xs, int R, int g) {
  for (int m = 0; m < MR; ++m)
    acc[m] = a8_step<V>(acc[m], is[m], V::fbcast(dd[g * R + m]), s, V::fbcast(xs[g * R + m]), b);
}

// One group of gs values -> q in the weight order (split: the 4-bit split order of each
// 32-block, even k first), d = amax / 127; returns the sum of q. rint(x * (127 / amax))
// clamped to [-127, 127] (round half to even: the vector conversion uses the default
// rounding mode, as std::nearbyint does). k0: the group's first k (a group of 16 is half a
// 32-block: split, its values land in both halves of the block, at q + p(k0 + k) - k0).
inline int quant_group_scalar(const float* xg, int gs, bool split, int8_t* q, float* d, int k0 = 0) {
  float amax = 0.0f;
  for (int k = 0; k < gs; ++k) amax = std::max(amax, std::fabs(xg[k]));
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  int sum = 0;
  for (int k = 0; k < gs; ++k) {
    const int v = static_cast<int>(std::max(-127.0f, std::min(127.0f, std::nearbyint(xg[k] * id))));
    // position in the weight order: in a 32-block, k = 2p at p, k = 2p + 1 at 16 + p
    const int ka = k0 + k;
    const int p = split ? (ka & ~31) + ((ka & 1) ? 16 : 0) + ((ka & 31) >> 1) : ka;
    q[p - k0] = static_cast<int8_t>(v);
    sum += v;
  }
  *d = amax / 127.0f;
  return sum;
}

inline int quant_group(const float* xg, int gs, bool split, int8_t* q, float* d, int k0) {
  // groups of 16 (a GGUF's Q6_K; split for the 6-bit planes) in the scalar loop: the same
  // values (x * id rounded half to even, clamped), 16 at a time is not worth a path
  if (gs % 32 != 0) return quant_group_scalar(xg, gs, split, q, d, k0);
#if defined(__AVX512F__)
  __m512 mv = _mm512_setzero_ps();
  for (int k = 0; k < gs; k += 16) mv = _mm512_max_ps(mv, _mm512_abs_ps(_mm512_loadu_ps(xg + k)));
  const float amax = _mm512_reduce_max_ps(mv);
  const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m512i sum = _mm512_setzero_si512();
  for (int k = 0; k < gs; k += 32) {
    __m512 a = _mm512_loadu_ps(xg + k), b = _mm512_loadu_ps(xg + k + 16);
    if (split) {
      const __m512 e = _mm512_permutex2var_ps(a, even, b), o = _mm512_permutex2var_ps(a, odd, b);
      a = e;
      b = o;
    }
    __m512i va = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), vb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
    va = _mm512_min_epi32(_mm512_max_epi32(va, lo), hi);
    vb = _mm512_min_epi32(_mm512_max_epi32(vb, lo), hi);
    sum = _mm512_add_epi32(sum, _mm512_add_epi32(va, vb));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(va));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k + 16), _mm512_cvtepi32_epi8(vb));
  }
  *d = amax / 127.0f;
  return _mm512_reduce_add_epi32(sum);
#elif defined(__AVX2__)
  // The same values at 8 lanes; the split order by byte shuffles after packing to int8.
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mv = _mm256_setzero_ps();
  for (int k = 0; k < gs; k += 8) mv = _mm256_max_ps(mv, _mm256_and_ps(_mm256_loadu_ps(xg + k), absm));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm_cvtss_f32(m4);
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  // per 128-bit lane: even bytes, then odd ones
  const __m256i eo = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                      0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  __m256i sum = _mm256_setzero_si256();
  for (int k = 0; k < gs; k += 32) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + k + 8 * j), id));
      v[j] = _mm256_min_epi32(_mm256_max_epi32(v[j], lo), hi);
      sum = _mm256_add_epi32(sum, v[j]);
    }
    // packs interleave 128-bit lanes: bytes come out as dwords 0,2,4,6,1,3,5,7 of k order
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    __m256i q8 = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (split)  // evens of k 0..15 | odds of 0..15 | evens of 16..31 | odds of 16..31 -> evens, odds
      q8 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(q8, eo), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), q8);
  }
  *d = amax / 127.0f;
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
#else
  return quant_group_scalar(xg, gs, split, q, d);
#endif
}

// x rows [M, K] -> per tile of R rows: xq [K/4][R][4] int8 (K in the weight rows' order),
// d and xs [G][R] floats (zeros for padding rows). Each group is rounded on its own, so a
// row's values never depend on the other rows. One chunk per row (padding rows included).
// The few-row paths pack a single tile of exactly M rows (R = M): a tile padded to 8 rows
// spread one row's quads over 8x the bytes, which at K = 8192 no longer fit in L1.
inline void pack_a8(int R, const float* x, int M, int K, int gs, bool split, int8_t* xq, float* dd,
                    float* xs) {
  const int tiles = (M + R - 1) / R, G = K / gs;
  pool().run(tiles * R, [&](int c) {
    const int t = c / R, i = c % R, m = t * R + i;
    int32_t* q = reinterpret_cast<int32_t*>(xq + static_cast<int64_t>(t) * K * R);
    float* d = dd + static_cast<int64_t>(t) * G * R;
    float* s = xs + static_cast<int64_t>(t) * G * R;
    thread_local std::vector<int32_t> row;  // K int8 values, as quads
    if (static_cast<int>(row.size()) < K / 4) row.resize(K / 4);
    int8_t* rb = reinterpret_cast<int8_t*>(row.data());
    if (m >= M) {
      std::fill(rb, rb + K, 0);
      for (int g = 0; g < G; ++g) d[g * R + i] = s[g * R + i] = 0.0f;
    } else {
      const float* xr = x + static_cast<int64_t>(m) * K;
      for (int g = 0; g < G; ++g) {
        float dv;
        const int sum = quant_group(xr + static_cast<int64_t>(g) * gs, gs, split, rb + g * gs, &dv, g * gs);
        d[g * R + i] = dv;
        s[g * R + i] = dv * static_cast<float>(sum);
      }
    }
    for (int u = 0; u < K / 4; ++u) q[u * R + i] = row[u];  // quad u of row i
  });
}

// out[j][i] for NW features against one tile of R rows. The weight bytes: rows (wb + j * K,
// k order), or QM (quad-major, an interleaved block's layout: quad q of feature j, 4
// bytes, at wb + (q * 16 + j) * 4, so every feature's quads are reached from one pointer);
// group g's scale and bias at sc / bi + j * sj + g * sg ([features][groups] rows, or an
// interleaved block's [groups][16]).
template <int R, int NW, bool QM = false>
inline void a8_tile(const int8_t* __restrict xq, const float* __restrict dd,
                    const float* __restrict xs, const uint8_t* __restrict wb,
                    const float* __restrict sc, const float* __restrict bi, int sj, int sg, int K, int gs,
                    float* __restrict out) {
  const int G = K / gs, quads = gs / 4;
#if defined(__AVX512VNNI__)
  using V = A8Vec<R>;
  typename V::F acc[NW];
  for (int j = 0; j < NW; ++j) acc[j] = V::fzero();
  for (int g = 0; g < G; ++g) {
    typename V::I is[NW];
    for (int j = 0; j < NW; ++j) is[j] = V::izero();
    const int8_t* qg = xq + static_cast<int64_t>(g) * quads * R * 4;
    const uint8_t* wg = wb + static_cast<int64_t>(g) * (QM ? quads * 64 : gs);
    for (int u = 0; u < quads; ++u) {
      const typename V::I xv = V::iload(qg + u * R * 4);
      for (int j = 0; j < NW; ++j) {
        int32_t w4;
        std::memcpy(&w4, QM ? wg + u * 64 + j * 4 : wg + static_cast<int64_t>(j) * K + u * 4, 4);
        is[j] = dpbusd(is[j], V::ibcast(w4), xv);
      }
    }
    const typename V::F dv = V::fload(dd + g * R), sv = V::fload(xs + g * R);
    for (int j = 0; j < NW; ++j)
      acc[j] = a8_step<V>(acc[j], is[j], dv, V::fbcast(sc[static_cast<int64_t>(j) * sj + g * sg]), sv,
                          V::fbcast(bi[static_cast<int64_t>(j) * sj + g * sg]));
  }
  for (int j = 0; j < NW; ++j) V::store(out + j * R, acc[j]);
#else
  // The same integer sums and the same two roundings per group, one lane at a time.
  for (int j = 0; j < NW; ++j)
    for (int i = 0; i < R; ++i) {
      float acc = 0.0f;
      for (int g = 0; g < G; ++g) {
        int32_t is = 0;
        for (int u = 0; u < quads; ++u)
          for (int b = 0; b < 4; ++b)
            is += static_cast<int32_t>(wb[QM ? ((static_cast<int64_t>(g) * quads + u) * 16 + j) * 4 + b
                                             : static_cast<int64_t>(j) * K + g * gs + u * 4 + b]) *
                  xq[((static_cast<int64_t>(g) * quads + u) * R + i) * 4 + b];
        acc = a8_step<A8Vec<1>>(acc, is, dd[g * R + i], sc[static_cast<int64_t>(j) * sj + g * sg], xs[g * R + i],
                                bi[static_cast<int64_t>(j) * sj + g * sg]);
      }
      out[j * R + i] = acc;
    }
#endif
}

template <int R>
inline void a8_tile_any(int nw, const int8_t* xq, const float* dd, const float* xs,
                        const uint8_t* wb, const float* sc, const float* bi, int sj, int sg, int K, int gs,
                        float* out) {
  switch (nw) {
    case 12: a8_tile<R, 12>(xq, dd, xs, wb, sc, bi, sj, sg, K, gs, out); break;
    case 11: a8_tile<R, 11>(xq, dd, xs, wb, sc, bi, sj, sg, K, gs, out); break;
    case 10: a8_tile<R, 10>(xq, dd, xs, wb, sc, bi, sj, sg, K, gs, out); break;
    case 9: a8_tile<R, 9>(xq, dd, xs, wb, sc, bi, sj, sg, K, gs, out); break;
    case 8: a8_tile<R, 8>(xq, dd, xs, wb, sc, bi, sj, sg, K, gs, out); break;
    case 7: a8_tile<R, 7>(xq, dd, xs, wb, sc, bi, sj, sg, K, gs, out); break;
    case 6: a8_tile<R, 6>(xq, dd, xs, wb, sc, bi, sj, sg, K, gs, out); break;
    case 5: a8_tile<R, 5>(xq, dd, xs, wb, sc, bi, sj, sg, K, gs, out); break;
    case 4: a8_tile<R, 4>(xq, dd, xs, wb, sc, bi, sj, sg, K, gs, out); break;
    case 3: a8_tile<R, 3>(xq, dd, xs, wb, sc, bi, sj, sg, K, gs, out); break;
    case 2: a8_tile<R, 2>(xq, dd, xs, wb, sc, bi, sj, sg, K, gs, out); break;
    default: a8_tile<R, 1>(xq, dd, xs, wb, sc, bi, sj, sg, K, gs, out); break;
  }
}
static_assert(A8_FEAT == 12, "a8_tile_any dispatches 1..12 features");

// 4-bit weight row -> K bytes 0..15 in the split order (as dequant_row's floats).
inline void unpack_nibbles(const uint32_t* wq, int K, uint8_t* out) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(wq);
  for (int j = 0; j < K; j += 32) {
    const u8x16 v = *reinterpret_cast<const u8x16*>(b + j / 2);
    const u8x16 lo = v & 15, hi = v >> 4;
    std::memcpy(out + j, &lo, 16);
    std::memcpy(out + j + 16, &hi, 16);
  }
}

// The interleaved layout (`il`, Linear.interleaved: 4- and 8-bit weights in the 8-bit mode
// (5- and 6-bit ones: the planes layout below, ilp_base),
// N a multiple of 16, rearranged once at load): rows in blocks of 16 and, per block and
// per 16 bytes of each row (32 4-bit or 16 8-bit values), the 16 rows' 4 words word by
// word, [i][row]: exactly what transpose16x4 makes of the row-major words. So the few-row
// paths read each block as one contiguous stream of whole vectors (no transposes, one
// stream the hardware prefetchers follow), and the int sums are the same exact integers.
// Word w of row r: block r / 16, step w / 4, at ((r / 16) * words / 4 + w / 4) * 64 +
// (w % 4) * 16 + r % 16.
inline int64_t il16_index(int64_t r, int w, int words) {
  return ((r / 16) * (words / 4) + w / 4) * 64 + (w % 4) * 16 + r % 16;
}

// One 16-row block of an interleaved 4-bit weight as quads [K / 4][16] (a8_tile's QM
// layout), without a transpose: word i of a 16-byte step holds, in its low nibbles, quad
// i of the step's 32 values in the split order (unpack_nibbles') and in its high ones
// quad 4 + i, for all 16 rows side by side. (An 8-bit block is quad-major as stored.)
inline void il16_quads4(const uint32_t* blk, int K, uint32_t* out) {
  for (int st = 0; st < K / 32; ++st)
    for (int i = 0; i < 4; ++i)
      for (int r = 0; r < 16; ++r) {
        const uint32_t w = blk[static_cast<int64_t>(st) * 64 + i * 16 + r];
        out[(static_cast<int64_t>(st) * 8 + i) * 16 + r] = w & 0x0F0F0F0Fu;
        out[(static_cast<int64_t>(st) * 8 + 4 + i) * 16 + r] = (w >> 4) & 0x0F0F0F0Fu;
      }
}

// The scales and biases of an interleaved weight are interleaved too, [block][group][16]
// (core.kernels.interleave16_groups), and the K-quant form's factors [block][super-block]
// [2][16] (interleave16_factors): the few-row paths read a block's group g as vectors in
// place (il_scales16 / il_scales8), with no decoding pass or transposes.
//
// Group g's 16 (or, from lane `at`, 8) scales and biases of an interleaved block (sp, bp:
// the block's arrays, in their stored format) as float32: the exact conversions Quant::rows
// makes (F16C's vcvtph2ps; bfloat16 is the float's high half; the two-level codes through
// scales.h's kq_decode16 / kq_decode8: s = d * a, b = (-e) * c), done as the kernel reads the group instead of in a
// pass over the block first (which wrote 2 x 16 x groups floats a block: Quant::rows was
// 15% of a 1B decode step's perf samples).
#if defined(__AVX512F__)
inline void il_scales16(const void* sp, const void* bp, int fmt, int sb, int g, __m512& s, __m512& c) {
  if (fmt == SF_F32) {
    s = _mm512_loadu_ps(static_cast<const float*>(sp) + g * 16);
    c = _mm512_loadu_ps(static_cast<const float*>(bp) + g * 16);
    return;
  }
  auto half16 = [](const void* p, int64_t at) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + at));
  };
  if (fmt == SF_KQ) {
    const int64_t f = int64_t{g / sb} * 32;  // this super-block's (d, e) vectors
    kq_decode16(static_cast<const int16_t*>(sp) + g * 16, _mm512_cvtph_ps(half16(bp, f)),
                _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(half16(bp, f + 16))), s, c);
    return;
  }
  if (fmt == SF_KQ1) {
    const int64_t f = int64_t{g / sb} * 32;
    kq1_decode16(static_cast<const int8_t*>(sp) + g * 16, _mm512_cvtph_ps(half16(bp, f)),
                 _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(half16(bp, f + 16))), s, c);
    return;
  }
  if (fmt == SF_F16) {
    s = _mm512_cvtph_ps(half16(sp, g * 16));
    c = _mm512_cvtph_ps(half16(bp, g * 16));
    return;
  }
  if (fmt == SF_F16M) {
    s = _mm512_cvtph_ps(half16(sp, g * 16));
    c = _mm512_mul_ps(s, _mm512_set1_ps(*static_cast<const float*>(bp)));
    return;
  }
  s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half16(sp, g * 16)), 16));
  c = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half16(bp, g * 16)), 16));
}
#endif
#if defined(__AVX2__) && defined(__F16C__)
inline void il_scales8(const void* sp, const void* bp, int fmt, int sb, int g, int at, __m256& s, __m256& c) {
  if (fmt == SF_F32) {
    s = _mm256_loadu_ps(static_cast<const float*>(sp) + g * 16 + at);
    c = _mm256_loadu_ps(static_cast<const float*>(bp) + g * 16 + at);
    return;
  }
  auto half8 = [](const void* p, int64_t i) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
  };
  if (fmt == SF_KQ) {
    const int64_t f = int64_t{g / sb} * 32 + at;
    kq_decode8(static_cast<const int16_t*>(sp) + g * 16 + at, _mm256_cvtph_ps(half8(bp, f)),
               _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(half8(bp, f + 16))), s, c);
    return;
  }
  if (fmt == SF_KQ1) {
    const int64_t f = int64_t{g / sb} * 32 + at;
    kq1_decode8(static_cast<const int8_t*>(sp) + g * 16 + at, _mm256_cvtph_ps(half8(bp, f)),
                _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(half8(bp, f + 16))), s, c);
    return;
  }
  if (fmt == SF_F16) {
    s = _mm256_cvtph_ps(half8(sp, g * 16 + at));
    c = _mm256_cvtph_ps(half8(bp, g * 16 + at));
    return;
  }
  if (fmt == SF_F16M) {
    s = _mm256_cvtph_ps(half8(sp, g * 16 + at));
    c = _mm256_mul_ps(s, _mm256_set1_ps(*static_cast<const float*>(bp)));
    return;
  }
  s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half8(sp, g * 16 + at)), 16));
  c = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half8(bp, g * 16 + at)), 16));
}
#endif

// Block blk's interleaved scales and biases as float32 [groups][16] each (a8_tile's
// strides 1, 16): the stored block converted (Quant::rows over its 16 rows' worth of
// values), or the K-quant codes decoded against the block's factors.
inline void il_scale_block(const Quant& S, int64_t blk, float* tmp, const float*& so, const float*& bo) {
  const int G = S.groups;
  if (!two_level_fmt(S.fmt)) return S.rows(blk * 16, 16, tmp, so, bo);
  const char* codes = static_cast<const char*>(S.s) + blk * 16 * S.s_row_bytes();  // (int16 or int8 codes)
  const int64_t per = int64_t{G / S.sb} * 32;  // the block's factors [super-block][2][16]
  thread_local std::vector<float> fac;
  if (static_cast<int64_t>(fac.size()) < per) fac.resize(static_cast<size_t>(per));
  halves_to_floats(static_cast<const uint16_t*>(S.b) + blk * per, static_cast<int>(per), fac.data());
  float* os = tmp;
  float* ob = tmp + int64_t{16} * G;
  for (int g = 0; g < G; ++g)
    for (int lane = 0; lane < 16; ++lane) {
      const int64_t f = (g / S.sb) * 32 + lane;
      const int i = g * 16 + lane;
      if (S.fmt == SF_KQ1)
        kq1_decode(reinterpret_cast<const int8_t*>(codes)[i], fac[f], -fac[f + 16], os[i], ob[i]);
      else
        kq_decode(reinterpret_cast<const int16_t*>(codes)[i], fac[f], -fac[f + 16], os[i], ob[i]);
    }
  so = os;
  bo = ob;
}

// The planes layout (`il` with 5- or 6-bit weights: the 8-bit mode's 5-/6-bit matrices,
// core.kernels.interleave16_planes): per 16-row block and per 32-k step, 16 * BITS words:
// the low 4 bits of the 32 values as the 4-bit interleaved words ([i][row], i = 0..3:
// nibble j of word i = value 8i + j), then their high bits, BITS - 4 words per row: 6 bits,
// [p][row], byte b of word p holding at bits 2i the high 2 bits of value 8i + 2b + p; 5
// bits, [row], byte b holding at bit i the high bit of value 8i + 2b and at bit 4 + i that
// of value 8i + 2b + 1. The few-row paths build each quad of 4 weight bytes from one
// contiguous stream with a shift, a mask and an or (a8_fewp_block), where the rows were
// unpacked to bytes in memory first (a tied Q6_K head at the 1B shape: 28% of the bytes a
// decode step reads; its product 15.5 -> 9-12 ms a step, measured).
inline int64_t ilp_base(int bits, int64_t r, int step, int K) {
  return (r / 16) * int64_t{K} * bits / 2 + int64_t{step} * 16 * bits + r % 16;
}

// Rows [r0, r0 + n) of a planes weight as bytes in k order: out [n][K].
inline void ilp_rows(int bits, const uint32_t* wq, int64_t r0, int n, int K, uint8_t* out) {
  for (int j = 0; j < n; ++j) {
    uint8_t* o = out + static_cast<int64_t>(j) * K;
    for (int st = 0; st < K / 32; ++st) {
      const int64_t base = ilp_base(bits, r0 + j, st, K);
      for (int i = 0; i < 4; ++i) {
        const uint32_t lo = wq[base + 16 * i];
        for (int v = 0; v < 8; ++v) {
          const int b = v >> 1, p = v & 1;
          const uint32_t hi = bits == 6 ? (wq[base + 64 + 16 * p] >> (8 * b + 2 * i)) & 3u
                                        : (wq[base + 64] >> (8 * b + 4 * p + i)) & 1u;
          o[32 * st + 8 * i + v] = static_cast<uint8_t>(((lo >> (4 * v)) & 15u) | (hi << 4));
        }
      }
    }
  }
}

// The planes' high bits of quad q (q < 4: the even values 8q + 2b of a 32-k step; q >= 4:
// the odd ones 8(q - 4) + 2b + 1) moved to bits 4.. of each byte, from v, the high word that
// holds them (6 bits: bits 2i..2i+1 of word q / 4, i = q % 4; 5 bits: bit q of word 0); mhi:
// 0x30 or 0x10 in every byte. Every planes reader builds a quad as (lo & 0x0F) | this.
template <int BITS>
inline int plane_high_at(int q) { return BITS == 6 ? 2 * (q % 4) : q; }
#if defined(__AVX512F__)
template <int BITS>
inline __m512i plane_high16(__m512i v, int q, __m512i mhi) {
  const int at = plane_high_at<BITS>(q);
  return _mm512_and_si512(at < 4 ? _mm512_slli_epi32(v, 4 - at) : at == 4 ? v : _mm512_srli_epi32(v, at - 4), mhi);
}
#endif
#if defined(__AVX2__)
template <int BITS>
inline __m256i plane_high8(__m256i v, int q, __m256i mhi) {
  const int at = plane_high_at<BITS>(q);
  return _mm256_and_si256(at < 4 ? _mm256_slli_epi32(v, 4 - at) : at == 4 ? v : _mm256_srli_epi32(v, at - 4), mhi);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define FX_A8_PLANE_QUADS 1
// Up to this many rows the few-row paths (a8_few_block; the planes: a8_fewp_block) run, in
// passes of 8 rows over each 16-feature block while it is in cache; more, the tiles of 16
// rows (the planes: over ilp_quads' bytes). Measured at the 1B shape (Q4_K_M: 4- and
// 6-bit, cold weights, 2 threads, AVX-512 VNNI Zen 4): the passes take 0.65-0.75x the
// tiles' time at 16-24 rows and 0.86-0.92x at 32, tie at 64 and lose from 128 (1.05-1.16x
// on 4 bits): a 16-row tile unpacks and steps each weight for 16 rows only.
constexpr int A8_FEW_ROWS = 32, PLANES_FEW_ROWS = 32;
// One 16-row block of a planes weight (ilp_base) as a8_tile's quad-major quads [K / 4][16],
// each byte (lo & 0x0F) | high bits, built a vector of 16 rows' quads at a time as
// a8_fewp_block builds them (one vpternlogd each), so the many-row tiles run 5- and 6-bit
// weights as they run 8-bit ones: the bytes built once per block for every tile of rows.
// (ilp_rows, a scalar pass to k-order rows, cost more than the products it fed; the few-row
// path at every row count rebuilt the bytes per tile of 8 rows: prefill@512 of Q5_K_M /
// Q6_K files ran at 0.87x llama.cpp's.) The quads are in the split order of each 32-k step
// (even values first, as the activations are packed), and in groups of 16 (GGUF's Q6_K) a
// step's quads {0, 1, 4, 5} (its first group) come first, then {2, 3, 6, 7}: the order
// split_group16_quads gives the activations, so a8_tile's group g reads its own quads.
template <int BITS>
inline void ilp_quads(const uint32_t* blk, int K, bool g16, uint32_t* out) {
  const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
  const __m512i mhi = _mm512_set1_epi32(BITS == 6 ? 0x30303030 : 0x10101010);
  static constexpr int at_g16[8] = {0, 1, 4, 5, 2, 3, 6, 7};  // position of quad q
  for (int k0 = 0; k0 < K; k0 += 32) {
    const uint32_t* st = blk + static_cast<int64_t>(k0 / 32) * 16 * BITS;
    const __m512i h[2] = {_mm512_loadu_si512(st + 64), BITS == 6 ? _mm512_loadu_si512(st + 80) : _mm512_setzero_si512()};
    auto high = [&](int q) { return plane_high16<BITS>(h[BITS == 6 ? q / 4 : 0], q, mhi); };
    uint32_t* o = out + static_cast<int64_t>(k0 / 4) * 16;
    for (int i = 0; i < 4; ++i) {
      const __m512i w = _mm512_loadu_si512(st + 16 * i);
      _mm512_storeu_si512(o + 16 * (g16 ? at_g16[i] : i), _mm512_ternarylogic_epi32(w, nib, high(i), 0xEA));
      _mm512_storeu_si512(o + 16 * (g16 ? at_g16[4 + i] : 4 + i),
                          _mm512_ternarylogic_epi32(_mm512_srli_epi32(w, 4), nib, high(4 + i), 0xEA));
    }
  }
}

// pack_a8's tiles (split order, groups of 16) -> ilp_quads' order: in every 32-k step, quads
// 2, 3 and 4, 5 swapped, so each group's 4 quads are adjacent.
inline void split_group16_quads(int8_t* xq, int tiles, int R, int K) {
  const int64_t q = int64_t{R} * 4;  // bytes of one quad position (R rows)
  std::vector<int8_t> t(static_cast<size_t>(2 * q));
  for (int64_t s = 0; s < int64_t{tiles} * (K / 32); ++s) {
    int8_t* a = xq + s * 8 * q;
    std::memcpy(t.data(), a + 2 * q, 2 * q);
    std::memcpy(a + 2 * q, a + 4 * q, 2 * q);
    std::memcpy(a + 4 * q, t.data(), 2 * q);
  }
}
#endif

#include "amx.h"  // the many-row tiles on AMX (where built for it), used by qmm_a8_rows

template <int R>
void qmm_a8_rows(const float* x, int M, int K, const uint32_t* wq, const Quant& S, int gs, int bits, float* y, int N,
                 bool il = false) {
  const int tiles = (M + R - 1) / R, G = K / gs;
  std::vector<int8_t> xq(static_cast<size_t>(tiles) * K * R);
  std::vector<float> dd(static_cast<size_t>(tiles) * G * R), xs(dd.size());
#if defined(FX_A8_PLANE_QUADS)
  const bool pq = il && S.unpacks();  // planes: ilp_quads, quad-major
#else
  const bool pq = false;
#endif
#if defined(FX_A8_AMX)
  // AMX: an interleaved weight's blocks (quad-major: the B tile's form) against the rows
  // as A tiles, 16 at a time; everything else as before.
  const bool amx = R == 16 && il && amx_fits(gs) && amx_on();
#else
  constexpr bool amx = false;
#endif
  pack_a8(R, x, M, K, gs, bits == 4 || pq, xq.data(), dd.data(), xs.data());
#if defined(FX_A8_PLANE_QUADS)
  if (pq && gs == 16) split_group16_quads(xq.data(), tiles, R, K);
#endif
#if defined(FX_A8_AMX)
  std::vector<int8_t> xa(amx ? xq.size() : 0);
  if (amx) amx_pack(xq.data(), tiles, K, gs, xa.data());
#endif
  const int words = K * bits / 32;
  // A unit: A8_FEAT features in rows; an interleaved weight's 16-row block (two 8-feature
  // tiles over its quad-major bytes, its scales read in place with strides 1 and 16).
  const int feat = il ? 16 : A8_FEAT;
  const int units = (N + feat - 1) / feat;
  const int per = std::max(1, 4 * 576 / std::max(K, 1));
  pool().run((units + per - 1) / per, [&](int c) {
    thread_local std::vector<uint8_t> buf;
    if (static_cast<int>(buf.size()) < 16 * K) buf.resize(static_cast<size_t>(16) * K);
    alignas(64) float out[A8_FEAT * R];
#if defined(FX_A8_AMX)
    if (amx) amx_configure(gs);  // per thread: the tile configuration is thread state
#endif
    const int u1 = std::min(units, (c + 1) * per);
    float* tmp = scale_tmp(16, G);
    for (int un = c * per; un < u1; ++un) {
      const int n0 = un * feat, nw = std::min(feat, N - n0);
      const float *ds, *db;  // this unit's scales and biases as float32
      int sj = G, sg = 1;
      if (il) {
        il_scale_block(S, n0 / 16, tmp, ds, db);
        sj = 1;
        sg = 16;
      } else {
        S.rows(n0, nw, tmp, ds, db);
      }
      const uint8_t* wb = buf.data();
      const bool quad_major = il && (!S.unpacks() || pq);
      if (S.unpacks()) {  // 5-/6-bit rows: unpacked to bytes (0..31 or 0..63), in k order
#if defined(FX_A8_PLANE_QUADS)
        if (pq) {
          const uint32_t* blk = wq + static_cast<int64_t>(n0 / 16) * K * S.wbits / 2;
          uint32_t* o = reinterpret_cast<uint32_t*>(buf.data());
          if (S.wbits == 6)
            ilp_quads<6>(blk, K, gs == 16, o);
          else
            ilp_quads<5>(blk, K, gs == 16, o);
        } else
#endif
        if (il)
          ilp_rows(S.wbits, wq, n0, nw, K, buf.data());
        else
          S.weights(wq, n0, nw, K, buf.data());
      } else if (il) {  // quad-major (a8_tile's QM): 8-bit blocks as stored, 4-bit ones split in place
        const uint32_t* blk = wq + static_cast<int64_t>(n0) * words;
        if (bits == 8) {
          wb = reinterpret_cast<const uint8_t*>(blk);
        } else {
          il16_quads4(blk, K, reinterpret_cast<uint32_t*>(buf.data()));
        }
      } else if (bits == 8) {  // the packed words are the bytes, in k order: copied into L1
        std::memcpy(buf.data(), wq + static_cast<int64_t>(n0) * words, static_cast<size_t>(nw) * K);
      } else {
        for (int j = 0; j < nw; ++j)
          unpack_nibbles(wq + static_cast<int64_t>(n0 + j) * words, K, buf.data() + static_cast<int64_t>(j) * K);
      }
#if defined(FX_A8_AMX)
      if (amx) {
        for (int t = 0; t < tiles; ++t) {
          const int m0 = t * R;
          a8_amx_tile(xa.data() + static_cast<int64_t>(m0) * K, dd.data() + static_cast<int64_t>(t) * G * R,
                      xs.data() + static_cast<int64_t>(t) * G * R, wb, ds, db, K, gs, y + static_cast<int64_t>(m0) * N + n0,
                      N, std::min(R, M - m0));
        }
        continue;
      }
#endif
      const int step = il ? 8 : A8_FEAT;
      for (int f0 = 0; f0 < nw; f0 += step) {
        const int fw = std::min(step, nw - f0);
        for (int t = 0; t < tiles; ++t) {
          const int m0 = t * R, mc = std::min(R, M - m0);
          const int8_t* xt = xq.data() + static_cast<int64_t>(t) * K * R;
          const float *dt = dd.data() + static_cast<int64_t>(t) * G * R, *st = xs.data() + static_cast<int64_t>(t) * G * R;
          if (quad_major)
            a8_tile<R, 8, true>(xt, dt, st, wb + f0 * 4, ds + f0, db + f0, 1, 16, K, gs, out);
          else
            a8_tile_any<R>(fw, xt, dt, st, wb + static_cast<int64_t>(f0) * K, ds + static_cast<int64_t>(f0) * sj,
                           db + static_cast<int64_t>(f0) * sj, sj, sg, K, gs, out);
          for (int i = 0; i < mc; ++i) {
            float* yr = y + static_cast<int64_t>(m0 + i) * N + n0 + f0;
            for (int j = 0; j < fw; ++j) yr[j] = out[j * R + i];
          }
        }
      }
    }
#if defined(FX_A8_AMX)
    if (amx) _tile_release();  // no tile state left for the scheduler to save
#endif
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// qmm_a8 for up to 8 rows a pass (decode batches; up to A8_FEW_ROWS rows in passes of 8
// over each block): the other orientation, as qgemm's few-row
// path. Vectors run along 16 output features; a quad of 4 weight bytes per lane comes
// straight from the packed words (16 rows' words transposed in registers; for 4 bits the
// low or high nibbles of a word: quads i and 4 + i of its 32-block in the split order), and
// every row's dot product with it is one vpdpbusd against its broadcast activation quad.
// The tiles above broadcast the weights and spend half their work on unpacking and
// per-group float steps at 8 rows. Per group and row the same float operations as
// a8_tile (a8_step), and the integer sums are exact: the tiles' bits (tested).
template <int BITS, int MR, bool IL>
inline void a8_few_block(const int8_t* xq, const float* dd, const float* xs, int K,
                         const uint32_t* wq, const Quant& S, int gs,
                         float* y, int N, int n0, float* sbuf, int R = MR) {
  // IL: the block's words interleaved (il16_index): 64 words per 16 bytes of each row
  const uint32_t* blk = wq + static_cast<int64_t>(n0) * (K * BITS / 32);
  // R: pack_a8's tile rows (quad u of row m at xq + (u * R + m) * 4): MR but in a last,
  // partial tile of 8
  const FewBlock fb = few_block(K, wq, S, gs, BITS, N, n0, sbuf,
                                S.unpacks() ? weight_tmp(int64_t{16} * K) : nullptr, IL);
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq);
  const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  auto dots = [&](__m512i (&is)[MR], __m512i w, int u) {
    for (int m = 0; m < MR; ++m) is[m] = dpbusd(is[m], w, _mm512_set1_epi32(xq4[u * R + m]));
  };
  for (int g = 0; g < K / gs; ++g) {
    __m512i is[MR], ih[MR];
    for (int m = 0; m < MR; ++m) is[m] = ih[m] = _mm512_setzero_si512();
    // 32 k a step for 4-bit weights (16 bytes a row), 16 for 8-bit ones (groups of 16: a
    // GGUF's Q6_K, unpacked to bytes); the integer sums are exact whatever the steps
    for (int k0 = g * gs; k0 < (g + 1) * gs; k0 += (BITS == 4 ? 32 : 16)) {
      if (k0 % 32 == 0) prefetch_slice(fb, k0);
      const int64_t off = static_cast<int64_t>(k0) * BITS / 8;  // bytes into each row
      const int u0 = k0 / 4;
      __m512i wv[4];
      if constexpr (IL) {
        const uint32_t* st = blk + off / 16 * 64;
        for (int i = 0; i < 4; ++i) wv[i] = _mm512_loadu_si512(st + 16 * i);
      } else {
        transpose16x4(fb.rw, off, wv);
      }
      if constexpr (BITS == 4) {
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          dots(is, _mm512_and_si512(wv[i], nib), u0 + i);
          dots(ih, _mm512_and_si512(_mm512_srli_epi32(wv[i], 4), nib), u0 + 4 + i);
        }
      } else {
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) dots(i % 2 ? ih : is, wv[i], u0 + i);
      }
    }
    for (int m = 0; m < MR; ++m) is[m] = _mm512_add_epi32(is[m], ih[m]);
    __m512 s, c;
    if constexpr (IL) {
      il_scales16(fb.sil, fb.bil, fb.fmt, fb.sb, g, s, c);
    } else {
      s = _mm512_loadu_ps(fb.s + g * 16);
      c = _mm512_loadu_ps(fb.b + g * 16);
    }
    a8_group<A8Vec<16>>(acc, is, s, c, dd, xs, R, g);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << fb.nv) - 1);
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + static_cast<int64_t>(m) * N + n0, keep, acc[m]);
}

// qmm_a8's few-row path on the planes layout (ilp_base): per 32-k step the block's 4
// low-nibble vectors and BITS - 4 high-bit vectors, every quad (lo & 0x0F) | (hi shifted &
// mask) (one vpternlogd), then the vpdpbusd of a8_few_block. Groups of 16 (a GGUF's Q6_K) are
// quads {0, 1, 4, 5} and {2, 3, 6, 7} of a step in the split order; larger groups whole
// steps. The integer sums are the unpacked bytes' exact sums and the per-group float steps
// are a8_few_block's, in group order: the rows layout's bits. The planes layout always
// comes with interleaved scales (one `interleaved` flag for the weight and its scales:
// kernels.cpp's qmm_a8, core.nn.interleave_for_a8), read in place.
template <int BITS, int MR>
inline void a8_fewp_block(const int8_t* xq, const float* dd, const float* xs, int K,
                          const uint32_t* wq, const Quant& S, int gs,
                          float* y, int N, int n0, int R) {
  // R: pack_a8's tile rows (MR = R but in a last, partial tile of 8)
  const uint32_t* blk = wq + static_cast<int64_t>(n0 / 16) * K * BITS / 2;
  const FewBlock fb = few_block(K, wq, S, gs, 8, N, n0, nullptr, nullptr, true);
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq);
  const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
  const __m512i mhi = _mm512_set1_epi32(BITS == 6 ? 0x30303030 : 0x10101010);
  __m512 acc[MR];
  __m512i is[MR];
  for (int m = 0; m < MR; ++m) {
    acc[m] = _mm512_setzero_ps();
    is[m] = _mm512_setzero_si512();
  }
  auto dots = [&](__m512i w, int u) {
    for (int m = 0; m < MR; ++m) is[m] = dpbusd(is[m], w, _mm512_set1_epi32(xq4[u * R + m]));
  };
  auto group = [&](int g) {  // a8_few_block's float steps for group g, then a new integer sum
    __m512 s, c;
    il_scales16(fb.sil, fb.bil, fb.fmt, fb.sb, g, s, c);
    a8_group<A8Vec<16>>(acc, is, s, c, dd, xs, R, g);
    for (int m = 0; m < MR; ++m) is[m] = _mm512_setzero_si512();
  };
  for (int k0 = 0; k0 < K; k0 += 32) {
    prefetch_slice(fb, k0);
    const uint32_t* st = blk + static_cast<int64_t>(k0 / 32) * 16 * BITS;
    const __m512i h[2] = {_mm512_loadu_si512(st + 64), BITS == 6 ? _mm512_loadu_si512(st + 80) : _mm512_setzero_si512()};
    // quad q's high value bits (plane_high16)
    auto high = [&](int q) { return plane_high16<BITS>(h[BITS == 6 ? q / 4 : 0], q, mhi); };
    auto quads = [&](int i) {  // quads i and 4 + i: (lo & 0x0F) | high, as (A & B) | C
      const __m512i w = _mm512_loadu_si512(st + 16 * i);
      dots(_mm512_ternarylogic_epi32(w, nib, high(i), 0xEA), k0 / 4 + i);
      dots(_mm512_ternarylogic_epi32(_mm512_srli_epi32(w, 4), nib, high(4 + i), 0xEA), k0 / 4 + 4 + i);
    };
    if (gs == 16) {  // two groups a step: quads {0, 1, 4, 5}, then {2, 3, 6, 7}
      quads(0);
      quads(1);
      group(k0 / 16);
      quads(2);
      quads(3);
      group(k0 / 16 + 1);
    } else {
      for (int i = 0; i < 4; ++i) quads(i);
      if ((k0 + 32) % gs == 0) group(k0 / gs);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << fb.nv) - 1);
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + static_cast<int64_t>(m) * N + n0, keep, acc[m]);
}

// The driver of both: the activations in tiles of 8 rows (one tile of exactly M rows up
// to 8), then each 16-feature block read from DRAM once and run against every tile while
// it is in cache. PLANES: BITS-bit (5 or 6) weights in the planes layout, a8_fewp_block
// (the planes' bytes rebuilt per tile), up to PLANES_FEW_ROWS rows (more: the tiles of 16
// rows over ilp_quads' bytes); else 4-/8-bit weights (IL: interleaved), a8_few_block, up to
// A8_FEW_ROWS rows (more: the tiles of 16 rows).
template <int BITS, bool IL, bool PLANES = false>
void qmm_a8_few(const float* x, int M, int K, const uint32_t* wq, const Quant& S, int gs, float* y, int N) {
  const int G = K / gs, R = std::min(8, M), tiles = (M + R - 1) / R;
  std::vector<int8_t> xq(static_cast<size_t>(tiles) * K * R);
  std::vector<float> dd(static_cast<size_t>(tiles) * G * R), xs(dd.size());
  pack_a8(R, x, M, K, gs, PLANES || BITS == 4, xq.data(), dd.data(), xs.data());
  const int blocks = (N + 15) / 16;
  const int per = stream_chunk(blocks, std::max(1, 4 * 576 / std::max(K, 1)));
  pool().run((blocks + per - 1) / per, [&](int c) {
    float* sbuf = IL || PLANES ? nullptr : few_sbuf(G);  // (interleaved scales: read in place)
    const int b1 = std::min(blocks, (c + 1) * per);
    for (int bl = c * per; bl < b1; ++bl) {
      if constexpr (PLANES) {
        for (int t = 0; t < tiles; ++t)
          with_rows<8>(std::min(R, M - t * R), [&](auto mr) {
            a8_fewp_block<BITS, decltype(mr)::value>(
                xq.data() + static_cast<int64_t>(t) * K * R, dd.data() + static_cast<int64_t>(t) * G * R,
                xs.data() + static_cast<int64_t>(t) * G * R, K, wq, S, gs, y + static_cast<int64_t>(t) * R * N, N,
                bl * 16, R);
          });
      } else {
        for (int t = 0; t < tiles; ++t)
          with_rows<8>(std::min(R, M - t * R), [&](auto mr) {
            a8_few_block<BITS, decltype(mr)::value, IL>(
                xq.data() + static_cast<int64_t>(t) * K * R, dd.data() + static_cast<int64_t>(t) * G * R,
                xs.data() + static_cast<int64_t>(t) * G * R, K, wq, S, gs, y + static_cast<int64_t>(t) * R * N, N,
                bl * 16, sbuf, R);
          });
      }
    }
  });
}
#define FX_A8_PLANES 1  // qmm_a8 reads 5-/6-bit weights in the planes layout (ilp_base)
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !(defined(__AVX512VNNI__) && defined(__AVX512F__))
#define FX_A8_AVX2 1
// qmm_a8 on AVX2 (and AVX-512 builds without VNNI), at every row count: the few-row
// orientation of a8_few_block at 8 features per ymm, 8 rows per pass over the weights.
// AVX2 has no u8 x s8 dot product into int32; vpmaddubsw multiplies u8 by s8 and adds
// adjacent pairs into saturating int16, vpmaddwd then adds pairs of int16 into int32 (as
// llama.cpp's AVX2 Q4_0 x Q8_0). With 4-bit weights (0..15) and activations in [-127, 127]
// a pair is at most 2 * 15 * 127 = 3810 in magnitude, so the 8 pairs of one 32-k step add
// up in int16 exactly (30480 < 32767) before one vpmaddwd; 8-bit weights (0..255) would
// saturate, so they are split into nibbles, w = 16 * hi + lo, each summed as a 4-bit
// weight and combined in int32 (vpmaddwd by 16 and by 1). The integer sums are exact, so
// the per-group float steps (the same as a8_tile's) give the tiles' bits on every build.
// One 8-row tile against the feature block at n0, whose rows rw, real width nv and
// transposed scales/biases sbuf few8_setup prepared (once per block, for every tile; IL:
// the interleaved words and scales, read in place: rw and sbuf unused).
template <int BITS, int MR, bool IL>
inline void a8_few8_block(const int8_t* xq, const float* dd, const float* xs, int K,
                          const uint32_t* wq, const char* const* rw, int nv, int gs,
                          float* y, int N, int n0, const float* sbuf, const Quant& S, int R) {
  // IL: the 16-row block's words interleaved (il16_index); this 8-row block is its half
  const uint32_t* blk = wq + static_cast<int64_t>(n0 / 16 * 16) * (K * BITS / 32) + n0 % 16;
  auto load8 = [&](int64_t off, __m256i* wv) {  // words i of the 8 rows at byte `off` of each
    if constexpr (IL) {
      const uint32_t* st = blk + off / 16 * 64;
      for (int i = 0; i < 4; ++i) wv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + 16 * i));
    } else {
      transpose8x4(rw, off, wv);
    }
  };
  // pack_a8's tile: quad u of row m at xq + (u * R + m) * 4 (R = M when M < 8)
  const int groups = K / gs;
  const char* ps = static_cast<const char*>(S.s) + int64_t{n0 / 16 * 16} * S.s_row_bytes();
  const char* pb = static_cast<const char*>(S.b) + int64_t{n0 / 16 * 16} * S.b_row_bytes();
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq);
  const __m256i nib = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi16(1);
  // the next block's packed rows, a slice per 32-k step (interleaved row streams defeat
  // the hardware prefetchers)
  const int words = K * BITS / 32;
  const char* next;
  int64_t next_bytes;
  if constexpr (IL) {
    // the next 16-row block (one contiguous stream), half of it during each 8-row pass over
    // this one: rows + 8 would be this block's own second half (and the next block's second
    // half never prefetched)
    const int64_t nb0 = int64_t{n0 / 16 * 16 + 16}, half = int64_t{8} * words * 4;
    next = reinterpret_cast<const char*>(wq + nb0 * words) + (n0 % 16 ? half : 0);
    next_bytes = nb0 < N ? half : 0;
  } else {
    next = reinterpret_cast<const char*>(wq + int64_t{n0 + 8} * words);
    next_bytes = std::max(0, std::min(8, N - n0 - 8)) * int64_t{words} * 4;
  }
  const int64_t slice = ((next_bytes + 63) / 64 + K / 32 - 1) / (K / 32) * 64;
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  auto xb = [&](int u, int m) { return _mm256_set1_epi32(xq4[u * R + m]); };
  for (int g = 0; g < groups; ++g) {
    __m256i is[MR];
    for (int m = 0; m < MR; ++m) is[m] = _mm256_setzero_si256();
    // 32 k a step for 4-bit weights, 16 for 8-bit ones (groups of 16: a GGUF's Q6_K)
    for (int k0 = g * gs; k0 < (g + 1) * gs; k0 += (BITS == 4 ? 32 : 16)) {
      if (k0 % 32 == 0)
        for (int64_t o = (k0 / 32) * slice, e = std::min(next_bytes, o + slice); o < e; o += 64)
          _mm_prefetch(next + o, _MM_HINT_T1);
      const int64_t off = static_cast<int64_t>(k0) * BITS / 8;  // bytes into each row
      const int u0 = k0 / 4;
#if defined(__AVXVNNI__)
      // AVX-VNNI (the VEX vpdpbusd: Intel client CPUs from Alder Lake, built without
      // AVX-512): 4 u8 x s8 products per int32 lane, summed without saturation, so neither
      // the int16 pair sums nor the 8-bit nibble split are needed. The same exact sums.
      if constexpr (BITS == 4) {
        __m256i wv[4];
        load8(off, wv);
        for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) {
            is[m] = _mm256_dpbusd_avx_epi32(is[m], _mm256_and_si256(wv[i], nib), xb(u0 + i, m));
            is[m] = _mm256_dpbusd_avx_epi32(
                is[m], _mm256_and_si256(_mm256_srli_epi16(wv[i], 4), nib), xb(u0 + 4 + i, m));
          }
      } else {
        __m256i wv[4];
        load8(off, wv);
        for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) is[m] = _mm256_dpbusd_avx_epi32(is[m], wv[i], xb(u0 + i, m));
      }
#else
      if constexpr (BITS == 4) {
        __m256i wv[4];
        load8(off, wv);
        __m256i lo[4], hi[4];  // quads i and 4 + i of the split order
        for (int i = 0; i < 4; ++i) {
          lo[i] = _mm256_and_si256(wv[i], nib);
          hi[i] = _mm256_and_si256(_mm256_srli_epi16(wv[i], 4), nib);
        }
        for (int m = 0; m < MR; ++m) {
          __m256i p = _mm256_maddubs_epi16(lo[0], xb(u0, m));
#pragma GCC unroll 4
          for (int i = 1; i < 4; ++i) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo[i], xb(u0 + i, m)));
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[i], xb(u0 + 4 + i, m)));
          is[m] = _mm256_add_epi32(is[m], _mm256_madd_epi16(p, one));
        }
      } else {
        const __m256i sixteen = _mm256_set1_epi16(16);
        __m256i wv[4];
        load8(off, wv);
        for (int m = 0; m < MR; ++m) {
          __m256i pl = _mm256_setzero_si256(), ph = _mm256_setzero_si256();
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) {
            const __m256i x = xb(u0 + i, m);
            pl = _mm256_add_epi16(pl, _mm256_maddubs_epi16(_mm256_and_si256(wv[i], nib), x));
            ph = _mm256_add_epi16(ph, _mm256_maddubs_epi16(
                                          _mm256_and_si256(_mm256_srli_epi16(wv[i], 4), nib), x));
          }
          is[m] = _mm256_add_epi32(is[m], _mm256_add_epi32(_mm256_madd_epi16(pl, one),
                                                           _mm256_madd_epi16(ph, sixteen)));
        }
      }
#endif
    }
    __m256 s, c;
    if constexpr (IL) {  // interleaved scales and biases, read in place (this half of the 16-row block)
      il_scales8(ps, pb, S.fmt, S.sb, g, n0 % 16, s, c);
    } else {
      s = _mm256_load_ps(sbuf + g * 8);
      c = _mm256_load_ps(sbuf + (groups + g) * 8);
    }
    a8_group<A8Vec<8>>(acc, is, s, c, dd, xs, R, g);
  }
  alignas(32) static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  const __m256i keep = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 8 - nv));
  for (int m = 0; m < MR; ++m) _mm256_maskstore_ps(y + static_cast<int64_t>(m) * N + n0, keep, acc[m]);
}

// f(std::integral_constant<int, fmt>{}) for a scales format (scales.h's SF_*).
template <typename F>
inline void with_fmt(int fmt, F&& f) {
  switch (fmt) {
    case SF_F32: return f(std::integral_constant<int, SF_F32>{});
    case SF_F16: return f(std::integral_constant<int, SF_F16>{});
    case SF_BF16: return f(std::integral_constant<int, SF_BF16>{});
    case SF_F16M: return f(std::integral_constant<int, SF_F16M>{});
    case SF_KQ1: return f(std::integral_constant<int, SF_KQ1>{});
    default: return f(std::integral_constant<int, SF_KQ>{});
  }
}

// The most common case of a8_few16_il, spelled out: one row, 4-bit weights in groups of 32
// (GGUF's Q4_0, Q4_1, Q4_K), the scales' format a constant. Each 32-k step is one group, so
// its int16 pair sums add in a tree (exact in any order: 8 pairs of at most 3810) straight
// into the group's float step, with no int32 accumulator carried between steps; the next
// block's 256 bytes a step prefetched by four fixed instructions. The general loop kept its
// accumulators on the stack and measured ~1.35 instructions a cycle on L3-resident weights.
template <int FMT>
inline void a8_il4_g32_row(const int8_t* xq, const float* dd, const float* xs, int K, const uint32_t* wq,
                           float* y, int N, int n0, const Quant& S) {
  const int words = K / 8, steps = K / 32;
  const uint32_t* blk = wq + static_cast<int64_t>(n0) * words;
  const char* ps = static_cast<const char*>(S.s) + int64_t{n0} * S.s_row_bytes();
  const char* pb = static_cast<const char*>(S.b) + int64_t{n0} * S.b_row_bytes();
  const int sb = S.sb;
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq);
  const __m256i nib = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi16(1);
  // the next block, 256 bytes a step (no next block: this one's own lines again, harmless)
  const char* next = reinterpret_cast<const char*>(n0 + 16 < N ? blk + 16 * words : blk);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int g = 0; g < steps; ++g) {
    const char* pf = next + int64_t{g} * 256;
    _mm_prefetch(pf, _MM_HINT_T1);
    _mm_prefetch(pf + 64, _MM_HINT_T1);
    _mm_prefetch(pf + 128, _MM_HINT_T1);
    _mm_prefetch(pf + 192, _MM_HINT_T1);
    const uint32_t* st = blk + int64_t{g} * 64;
    __m256i x[8];
    for (int j = 0; j < 8; ++j) x[j] = _mm256_set1_epi32(xq4[8 * g + j]);
    auto half = [&](int h) {
      __m256i t[4];
      for (int i = 0; i < 4; ++i) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + 16 * i + 8 * h));
        t[i] = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w, nib), x[i]),
                                _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), nib), x[4 + i]));
      }
      return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(t[0], t[1]), _mm256_add_epi16(t[2], t[3])), one);
    };
    const __m256i is0 = half(0), is1 = half(1);
    const __m256 d = _mm256_set1_ps(dd[g]), xg = _mm256_set1_ps(xs[g]);
    __m256 s, c;
    il_scales8(ps, pb, FMT, sb, g, 0, s, c);
    acc0 = a8_step<A8Vec<8>>(acc0, is0, d, s, xg, c);
    il_scales8(ps, pb, FMT, sb, g, 8, s, c);
    acc1 = a8_step<A8Vec<8>>(acc1, is1, d, s, xg, c);
  }
  _mm256_storeu_ps(y + n0, acc0);
  _mm256_storeu_ps(y + n0 + 8, acc1);
}

// a8_few8_blockp<6, 1, 2> spelled out for GGUF's Q6_K (6-bit planes in groups of 16: a
// tied head, Q4_K_M's down / v matrices), one row, the scales' format a constant: quads
// {0, 1, 4, 5} and {2, 3, 6, 7} of each 32-k step are its two groups, each quad pair's sums
// (at most 2 * 16002, exact in int16) widened by one vpmaddwd, no accumulators carried
// between steps (the general loop's, on the stack, cost it ~1.5x on cached weights).
template <int FMT>
inline void a8_p6_g16_row(const int8_t* xq, const float* dd, const float* xs, int K, const uint32_t* wq,
                          float* y, int N, int n0, const Quant& S) {
  const int steps = K / 32;
  const uint32_t* blk = wq + static_cast<int64_t>(n0 / 16) * K * 3;  // 16 rows x K x 6 bits
  const char* ps = static_cast<const char*>(S.s) + int64_t{n0} * S.s_row_bytes();
  const char* pb = static_cast<const char*>(S.b) + int64_t{n0} * S.b_row_bytes();
  const int sb = S.sb;
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq);
  const __m256i nib = _mm256_set1_epi8(0x0F), mhi = _mm256_set1_epi8(0x30), one = _mm256_set1_epi16(1);
  // the next block, 384 bytes a step (no next block: this one's own lines again, harmless)
  const char* next = reinterpret_cast<const char*>(n0 + 16 < N ? blk + int64_t{K} * 3 : blk);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int k = 0; k < steps; ++k) {
    const char* pf = next + int64_t{k} * 384;
    for (int l = 0; l < 6; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
    const uint32_t* st = blk + int64_t{k} * 96;
    auto ld = [&](int at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + at)); };
    // quad q's high 2 bits, at bits 2 * (q % 4) of the bytes of high word q / 4 -> bits 4, 5
    auto high = [&](int e, int q) { return plane_high8<6>(ld(64 + 16 * (q / 4) + 8 * e), q, mhi); };
    __m256i is[2][2];  // [half][group of the step]
    for (int i = 0; i < 4; ++i) {  // quads i and 4 + i of both halves, against their activations
      const __m256i xa = _mm256_set1_epi32(xq4[8 * k + i]), xb = _mm256_set1_epi32(xq4[8 * k + 4 + i]);
      for (int e = 0; e < 2; ++e) {
        const __m256i w = ld(16 * i + 8 * e);
        const __m256i a = _mm256_or_si256(_mm256_and_si256(w, nib), high(e, i));
        const __m256i b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), nib), high(e, 4 + i));
        const __m256i m = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(a, xa), _mm256_maddubs_epi16(b, xb)), one);
        is[e][i / 2] = i % 2 ? _mm256_add_epi32(is[e][i / 2], m) : m;
      }
    }
    for (int e = 0; e < 2; ++e)
      for (int j = 0; j < 2; ++j) {
        __m256 s, c;
        il_scales8(ps, pb, FMT, sb, 2 * k + j, 8 * e, s, c);
        acc[e] = a8_step<A8Vec<8>>(acc[e], is[e][j], _mm256_set1_ps(dd[2 * k + j]), s, _mm256_set1_ps(xs[2 * k + j]), c);
      }
  }
  _mm256_storeu_ps(y + n0, acc[0]);
  _mm256_storeu_ps(y + n0 + 8, acc[1]);
}

// a8_few8_block's tile of MR rows (2..8) on an interleaved 4-bit weight in groups of 32,
// spelled out as a8_il4_g32_row is: each 32-k step is one group, its int16 pair sums tree
// added and widened straight into the group's float step, row by row, so only the step's
// 8 nibble vectors stay live across the rows (the general loop kept MR int32 sums and MR
// float accumulators live and spilled them every step). The same sums, the same bits.
template <int FMT, int MR>
inline void a8_il4_g32_tile(const int8_t* xq, const float* dd, const float* xs, int K, const uint32_t* wq,
                            float* y, int N, int n0, const Quant& S, int R) {
  const int words = K / 8, steps = K / 32;
  const uint32_t* blk = wq + static_cast<int64_t>(n0 / 16 * 16) * words + n0 % 16;
  const char* ps = static_cast<const char*>(S.s) + int64_t{n0 / 16 * 16} * S.s_row_bytes();
  const char* pb = static_cast<const char*>(S.b) + int64_t{n0 / 16 * 16} * S.b_row_bytes();
  const int sb = S.sb;
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq);
  const __m256i nib = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int g = 0; g < steps; ++g) {
    const uint32_t* st = blk + int64_t{g} * 64;
    __m256i lo[4], hi[4];
    for (int i = 0; i < 4; ++i) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + 16 * i));
      lo[i] = _mm256_and_si256(w, nib);
      hi[i] = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
    }
    __m256 s, c;
    il_scales8(ps, pb, FMT, sb, g, n0 % 16, s, c);
    const int32_t* xg = xq4 + int64_t{8} * g * R;
    for (int m = 0; m < MR; ++m) {
      __m256i t[4];
      for (int i = 0; i < 4; ++i)
        t[i] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[i], _mm256_set1_epi32(xg[i * R + m])),
                                _mm256_maddubs_epi16(hi[i], _mm256_set1_epi32(xg[(4 + i) * R + m])));
      const __m256i is = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(t[0], t[1]), _mm256_add_epi16(t[2], t[3])), one);
      acc[m] = a8_step<A8Vec<8>>(acc[m], is, _mm256_set1_ps(dd[g * R + m]), s, _mm256_set1_ps(xs[g * R + m]), c);
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(y + static_cast<int64_t>(m) * N + n0, acc[m]);
}

// a8_few8_blockp's tile of MR rows (2..8) on 5-/6-bit planes in groups of 16 or 32 (GGUF's
// Q6_K: Q4_K_M's down / v matrices; Q5_K), 8 features, spelled out as a8_il4_g32_tile is:
// each 32-k step's 8 quads built once for all rows, then per row the step's groups (groups
// of 16: quads {0, 1, 4, 5}, then {2, 3, 6, 7}) as quad-pair sums in int16 (at most
// 2 * 63 * 127 each: exact) widened by vpmaddwd and taken straight into each group's float
// step, in group order. The general loop carried MR int32 sums and MR float accumulators
// across the step, more than AVX2's 16 registers, and spilled them. The same sums, the
// same bits.
template <int BITS, int GS, int FMT, int MR>
inline void a8_p_tile(const int8_t* xq, const float* dd, const float* xs, int K, const uint32_t* wq,
                      float* y, int N, int n0, const Quant& S, int R) {
  static_assert((BITS == 5 || BITS == 6) && (GS == 16 || GS == 32), "5-/6-bit planes in groups of 16 or 32");
  const int steps = K / 32;
  const uint32_t* blk = wq + static_cast<int64_t>(n0 / 16) * K * BITS / 2 + n0 % 16;  // 16 rows x K x BITS bits
  const char* ps = static_cast<const char*>(S.s) + int64_t{n0 / 16 * 16} * S.s_row_bytes();
  const char* pb = static_cast<const char*>(S.b) + int64_t{n0 / 16 * 16} * S.b_row_bytes();
  const int sb = S.sb;
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq);
  const __m256i nib = _mm256_set1_epi8(0x0F), mhi = _mm256_set1_epi8(BITS == 6 ? 0x30 : 0x10);
  const __m256i one = _mm256_set1_epi16(1);
  constexpr int G = 32 / GS;  // groups a 32-k step
  // the next 16-row block's stream, a slice a step, from the block's first half (as
  // a8_few8_blockp: at 2-8 rows, a batch's decode step, the weights stream from DRAM)
  const char* next = reinterpret_cast<const char*>(wq + (static_cast<int64_t>(n0 / 16) + 1) * K * BITS / 2);
  const int slice = n0 % 16 == 0 && n0 / 16 * 16 + 16 < N ? 64 * BITS : 0;
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int k = 0; k < steps; ++k) {
    for (int o = 0; o < slice; o += 64) _mm_prefetch(next + int64_t{k} * slice + o, _MM_HINT_T1);
    const uint32_t* st = blk + int64_t{k} * 16 * BITS;
    auto ld = [&](int at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + at)); };
    const __m256i h0 = ld(64), h1 = BITS == 6 ? ld(80) : h0;
    __m256i a[4], b[4];  // quads i (the even values 8i + 2j) and 4 + i (the odd ones)
    for (int i = 0; i < 4; ++i) {
      const __m256i w = ld(16 * i);
      a[i] = _mm256_or_si256(_mm256_and_si256(w, nib), plane_high8<BITS>(h0, i, mhi));
      b[i] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), nib), plane_high8<BITS>(h1, 4 + i, mhi));
    }
    __m256 s[G], c[G];
    for (int j = 0; j < G; ++j) il_scales8(ps, pb, FMT, sb, G * k + j, n0 % 16, s[j], c[j]);
    const int32_t* xg = xq4 + int64_t{8} * k * R;
    const float* d = dd + int64_t{G} * k * R;
    const float* e = xs + int64_t{G} * k * R;
    for (int m = 0; m < MR; ++m) {
      auto pair = [&](int i) {
        return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(a[i], _mm256_set1_epi32(xg[i * R + m])),
                                                  _mm256_maddubs_epi16(b[i], _mm256_set1_epi32(xg[(4 + i) * R + m]))),
                                 one);
      };
      if constexpr (G == 2) {
        const __m256i is0 = _mm256_add_epi32(pair(0), pair(1)), is1 = _mm256_add_epi32(pair(2), pair(3));
        acc[m] = a8_step<A8Vec<8>>(acc[m], is0, _mm256_set1_ps(d[m]), s[0], _mm256_set1_ps(e[m]), c[0]);
        acc[m] = a8_step<A8Vec<8>>(acc[m], is1, _mm256_set1_ps(d[R + m]), s[1], _mm256_set1_ps(e[R + m]), c[1]);
      } else {
        const __m256i is = _mm256_add_epi32(_mm256_add_epi32(pair(0), pair(1)), _mm256_add_epi32(pair(2), pair(3)));
        acc[m] = a8_step<A8Vec<8>>(acc[m], is, _mm256_set1_ps(d[m]), s[0], _mm256_set1_ps(e[m]), c[0]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(y + static_cast<int64_t>(m) * N + n0, acc[m]);
}

// Up to this many rows take a8_few16_il (5-/6-bit planes: one row). Measured, gate_up
// 16384 x 2048 cold: 2 rows 0.77 ms against 1.14-1.21 in a8_il4_g32_tile, 4 rows 1.28 against
// 1.51; 6 rows alike; 8 rows 2.94 against 2.32 (2 x MR accumulators spill).
constexpr int FEW16_ROWS = 4;
// a8_few8_block for up to FEW16_ROWS rows on an interleaved weight, both 8-feature halves of a
// 16-row block in one pass: the block's 64-byte lines read whole and once, the next block
// prefetched whole, and two independent chains of int16 pair sums (one half at a time left
// a single chain waiting on vpmaddubsw's latency: the AVX2 build read ~24 GB/s at one row
// where the AVX-512 build's whole-block pass reads ~37). The same integer sums and per-group
// float steps lane by lane: the same bits.
template <int BITS, int MR>
inline void a8_few16_il(const int8_t* xq, const float* dd, const float* xs, int K, const uint32_t* wq,
                        int gs, float* y, int N, int n0, const Quant& S, int R) {
  const int words = K * BITS / 32, groups = K / gs;
  const uint32_t* blk = wq + static_cast<int64_t>(n0) * words;
  const char* ps = static_cast<const char*>(S.s) + int64_t{n0} * S.s_row_bytes();
  const char* pb = static_cast<const char*>(S.b) + int64_t{n0} * S.b_row_bytes();
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq);
  const __m256i nib = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi16(1);
  const char* next = reinterpret_cast<const char*>(blk + 16 * words);
  const int64_t next_bytes = n0 + 16 < N ? int64_t{16} * words * 4 : 0;
  const int64_t slice = next_bytes / (K / 32);
  __m256 acc[2][MR];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MR; ++m) acc[h][m] = _mm256_setzero_ps();
  auto xb = [&](int u, int m) { return _mm256_set1_epi32(xq4[u * R + m]); };
  for (int g = 0; g < groups; ++g) {
    __m256i is[2][MR];
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MR; ++m) is[h][m] = _mm256_setzero_si256();
    for (int k0 = g * gs; k0 < (g + 1) * gs; k0 += (BITS == 4 ? 32 : 16)) {
      if (k0 % 32 == 0)
        for (int64_t o = (k0 / 32) * slice, e = o + slice; o < e; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
      const uint32_t* st = blk + static_cast<int64_t>(k0) * BITS / 8 / 16 * 64;
      auto ld = [&](int i, int h) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + 16 * i + 8 * h)); };
      const int u0 = k0 / 4;
      if constexpr (BITS == 4) {
        __m256i p[2][MR];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
          for (int h = 0; h < 2; ++h) {
            const __m256i w = ld(i, h);
            const __m256i lo = _mm256_and_si256(w, nib), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
            for (int m = 0; m < MR; ++m) {
              const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xb(u0 + i, m)),
                                                 _mm256_maddubs_epi16(hi, xb(u0 + 4 + i, m)));
              p[h][m] = i == 0 ? t : _mm256_add_epi16(p[h][m], t);
            }
          }
        for (int h = 0; h < 2; ++h)
          for (int m = 0; m < MR; ++m) is[h][m] = _mm256_add_epi32(is[h][m], _mm256_madd_epi16(p[h][m], one));
      } else {
        const __m256i sixteen = _mm256_set1_epi16(16);
        for (int h = 0; h < 2; ++h)
          for (int m = 0; m < MR; ++m) {
            __m256i pl = _mm256_setzero_si256(), ph = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
              const __m256i w = ld(i, h), x = xb(u0 + i, m);
              pl = _mm256_add_epi16(pl, _mm256_maddubs_epi16(_mm256_and_si256(w, nib), x));
              ph = _mm256_add_epi16(ph, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), nib), x));
            }
            is[h][m] = _mm256_add_epi32(is[h][m], _mm256_add_epi32(_mm256_madd_epi16(pl, one),
                                                                   _mm256_madd_epi16(ph, sixteen)));
          }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 s, c;
      il_scales8(ps, pb, S.fmt, S.sb, g, 8 * h, s, c);
      a8_group<A8Vec<8>>(acc[h], is[h], s, c, dd, xs, R, g);
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MR; ++m) _mm256_storeu_ps(y + static_cast<int64_t>(m) * N + n0 + 8 * h, acc[h][m]);
}

// a8_fewp_block at 8 features per ymm (this 8-row half of each 16-row block: its lanes
// n0 % 16 .. + 8 of the planes' words), every row count in tiles of 8 rows. Without
// AVX-VNNI, vpmaddubsw adds pairs of u8 x s8 products in saturating int16: a 6-bit pair is
// at most 2 * 63 * 127 = 16002, so two quads' pairs (32004) add up exactly in int16 before
// each vpmaddwd; the int32 sums are the rows layout's exact integers.
template <int BITS, int MR, int H = 1>
inline void a8_few8_blockp(const int8_t* xq, const float* dd, const float* xs, int K,
                           const uint32_t* wq, int nv, int gs, float* y, int N, int n0, const Quant& S, int R) {
  // H = 2: both 8-feature halves of the 16-row block at n0 in one pass (a8_few16_il's reason)
  const uint32_t* blk = wq + static_cast<int64_t>(n0 / 16) * K * BITS / 2 + n0 % 16;
  const char* ps = static_cast<const char*>(S.s) + int64_t{n0 / 16 * 16} * S.s_row_bytes();
  const char* pb = static_cast<const char*>(S.b) + int64_t{n0 / 16 * 16} * S.b_row_bytes();
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq);
  const __m256i nib = _mm256_set1_epi8(0x0F), mhi = _mm256_set1_epi8(BITS == 6 ? 0x30 : 0x10);
  // the next 16-row block's stream, a slice per 32-k step (once per block: from its first half)
  const char* next = reinterpret_cast<const char*>(wq + (static_cast<int64_t>(n0 / 16) + 1) * K * BITS / 2);
  const int64_t next_bytes = n0 % 16 == 0 && n0 / 16 * 16 + 16 < N ? int64_t{K} * BITS * 2 : 0;
  const int64_t slice = next_bytes / (K / 32);
  __m256 acc[H][MR];
  __m256i is[H][MR];
  for (int e = 0; e < H; ++e)
    for (int m = 0; m < MR; ++m) {
      acc[e][m] = _mm256_setzero_ps();
      is[e][m] = _mm256_setzero_si256();
    }
  auto xb = [&](int u, int m) { return _mm256_set1_epi32(xq4[u * R + m]); };
  auto group = [&](int g) {  // a8_few8_block's float steps for group g, then a new integer sum
    for (int e = 0; e < H; ++e) {
      __m256 s, c;
      il_scales8(ps, pb, S.fmt, S.sb, g, n0 % 16 + 8 * e, s, c);  // (interleaved scales, as a8_fewp_block's)
      a8_group<A8Vec<8>>(acc[e], is[e], s, c, dd, xs, R, g);
      for (int m = 0; m < MR; ++m) is[e][m] = _mm256_setzero_si256();
    }
  };
  for (int k0 = 0; k0 < K; k0 += 32) {
    for (int64_t o = (k0 / 32) * slice, e = std::min(next_bytes, o + slice); o < e; o += 64)
      _mm_prefetch(next + o, _MM_HINT_T1);
    const uint32_t* st = blk + static_cast<int64_t>(k0 / 32) * 16 * BITS;
    __m256i hv[H][2];
    for (int e = 0; e < H; ++e) {
      hv[e][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + 64 + 8 * e));
      hv[e][1] = BITS == 6 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + 80 + 8 * e))
                           : _mm256_setzero_si256();
    }
    auto high = [&](int e, int q) { return plane_high8<BITS>(hv[e][BITS == 6 ? q / 4 : 0], q, mhi); };
    // quads i and 4 + i (even and odd values of 8i .. 8i + 7), then their dot products
    auto pair = [&](int i) {
      for (int e = 0; e < H; ++e) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + 16 * i + 8 * e));
        const __m256i a = _mm256_or_si256(_mm256_and_si256(w, nib), high(e, i));
        const __m256i b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), nib), high(e, 4 + i));
        const int u = k0 / 4 + i;
        for (int m = 0; m < MR; ++m) {
#if defined(__AVXVNNI__)
          is[e][m] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(is[e][m], a, xb(u, m)), b, xb(u + 4, m));
#else
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(a, xb(u, m)), _mm256_maddubs_epi16(b, xb(u + 4, m)));
          is[e][m] = _mm256_add_epi32(is[e][m], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
        }
      }
    };
    if (gs == 16) {  // two groups a step: quads {0, 1, 4, 5}, then {2, 3, 6, 7}
      pair(0);
      pair(1);
      group(k0 / 16);
      pair(2);
      pair(3);
      group(k0 / 16 + 1);
    } else {
      for (int i = 0; i < 4; ++i) pair(i);
      if ((k0 + 32) % gs == 0) group(k0 / gs);
    }
  }
  alignas(32) static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  for (int e = 0; e < H; ++e) {
    const int ne = std::max(0, std::min(8, nv - 8 * e));
    const __m256i keep = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 8 - ne));
    for (int m = 0; m < MR; ++m) _mm256_maskstore_ps(y + static_cast<int64_t>(m) * N + n0 + 8 * e, keep, acc[e][m]);
  }
}

// The driver of both: the activations in tiles of 8 rows (one tile of exactly M rows up
// to 8), then each 8-feature block run against every tile while its weights are in L1
// (the rows layout's block set up once for all tiles: few8_setup). PLANES: BITS-bit (5 or
// 6) weights in the planes layout, a8_few8_blockp; else 4-/8-bit ones (IL: interleaved),
// a8_few8_block.
template <int BITS, bool IL, bool PLANES = false>
void qmm_a8_few8(const float* x, int M, int K, const uint32_t* wq, const Quant& S, int gs, float* y, int N) {
  constexpr bool il = IL || PLANES;  // (the planes layout is interleaved, scales too)
  const int R = std::min(8, M);
  const int G = K / gs, tiles = (M + R - 1) / R;
  std::vector<int8_t> xq(static_cast<size_t>(tiles) * K * R);
  std::vector<float> dd(static_cast<size_t>(tiles) * G * R), xs(dd.size());
  pack_a8(R, x, M, K, gs, PLANES || BITS == 4, xq.data(), dd.data(), xs.data());
  const int blocks = (N + 7) / 8;
#if !defined(__AVXVNNI__)
  if constexpr (il) {
    if (M <= (PLANES ? 1 : FEW16_ROWS)) {  // whole 16-row blocks (N is a multiple of 16 here)
      const int per = stream_chunk(blocks / 2, std::max(1, 4 * 576 / std::max(K, 1)));
      pool().run((blocks / 2 + per - 1) / per, [&](int c) {
        const int b1 = std::min(blocks / 2, (c + 1) * per);
        for (int bl = c * per; bl < b1; ++bl) {
          S.prefetch(bl * 16 + 64, std::max(0, std::min(16, N - bl * 16 - 64)));
          with_rows<FEW16_ROWS>(M, [&](auto mr) {
            if constexpr (PLANES && BITS == 6)
              if (gs == 16 && decltype(mr)::value == 1 && N - bl * 16 >= 16)
                return with_fmt(S.fmt, [&](auto f) {
                  a8_p6_g16_row<decltype(f)::value>(xq.data(), dd.data(), xs.data(), K, wq, y, N, bl * 16, S);
                });
            if constexpr (PLANES)
              a8_few8_blockp<BITS, decltype(mr)::value, 2>(xq.data(), dd.data(), xs.data(), K, wq, std::min(16, N - bl * 16),
                                                           gs, y, N, bl * 16, S, R);
            else if (BITS == 4 && gs == 32 && decltype(mr)::value == 1)
              with_fmt(S.fmt, [&](auto f) {
                a8_il4_g32_row<decltype(f)::value>(xq.data(), dd.data(), xs.data(), K, wq, y, N, bl * 16, S);
              });
            else
              a8_few16_il<BITS, decltype(mr)::value>(xq.data(), dd.data(), xs.data(), K, wq, gs, y, N, bl * 16, S, R);
          });
        }
      });
      return;
    }
  }
#endif
  // interleaved 4-bit in groups of 32 (Q4_0, Q4_1, Q4_K): a8_il4_g32_tile
  [[maybe_unused]] const bool g32 = IL && BITS == 4 && gs == 32;
  const int per = stream_chunk(blocks, std::max(1, 8 * 576 / std::max(K, 1)));
  pool().run((blocks + per - 1) / per, [&](int c) {
    float* sbuf = nullptr;  // the rows layout's transposed scales and biases: [2][G][8]
    if constexpr (!il) {
      thread_local std::vector<float> sb;
      const size_t need = static_cast<size_t>(16 * G + 8);  // + 8: alignment
      if (sb.size() < need) sb.resize(need);
      sbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sb.data()) + 31) & ~uintptr_t{31});
    }
    const int b1 = std::min(blocks, (c + 1) * per);
    for (int bl = c * per; bl < b1; ++bl) {
      const char* rw[8];
      int nv;
      if constexpr (il) {  // the scales 4 blocks of 16 ahead (few_block's distance)
        S.prefetch(bl * 8 + 64, std::max(0, std::min(8, N - bl * 8 - 64)));
        nv = std::min(8, N - bl * 8);
      } else {
        nv = few8_setup(K, wq, S, gs, BITS, N, bl * 8, rw, sbuf, S.unpacks() ? weight_tmp(int64_t{8} * K) : nullptr);
      }
      for (int t = 0; t < tiles; ++t) {
        const int8_t* xt = xq.data() + static_cast<int64_t>(t) * K * R;
        const float* dt = dd.data() + static_cast<int64_t>(t) * G * R;
        const float* st = xs.data() + static_cast<int64_t>(t) * G * R;
        float* yt = y + static_cast<int64_t>(t) * R * N;
#if !defined(__AVXVNNI__)
        if constexpr (IL && !PLANES && BITS == 4)
          if (g32) {  // (dispatched apart: inside the general lambda it slowed the general path's code)
            with_fmt(S.fmt, [&](auto f) {
              with_rows<8>(std::min(R, M - t * R), [&](auto mr) {
                a8_il4_g32_tile<decltype(f)::value, decltype(mr)::value>(xt, dt, st, K, wq, yt, N, bl * 8, S, R);
              });
            });
            continue;
          }
        if constexpr (PLANES)
          if ((gs == 16 || gs == 32) && nv == 8) {  // GGUF's Q6_K, Q5_K: a8_p_tile
            with_fmt(S.fmt, [&](auto f) {
              with_rows<8>(std::min(R, M - t * R), [&](auto mr) {
                constexpr int F = decltype(f)::value, MR = decltype(mr)::value;
                if (gs == 16) a8_p_tile<BITS, 16, F, MR>(xt, dt, st, K, wq, yt, N, bl * 8, S, R);
                else a8_p_tile<BITS, 32, F, MR>(xt, dt, st, K, wq, yt, N, bl * 8, S, R);
              });
            });
            continue;
          }
#endif
        with_rows<8>(std::min(R, M - t * R), [&](auto mr) {
          if constexpr (PLANES)
            a8_few8_blockp<BITS, decltype(mr)::value>(xt, dt, st, K, wq, nv, gs, yt, N, bl * 8, S, R);
          else
            a8_few8_block<BITS, decltype(mr)::value, IL>(xt, dt, st, K, wq, rw, nv, gs, yt, N, bl * 8, sbuf, S, R);
        });
      }
    }
  });
}
#define FX_A8_PLANES 1  // qmm_a8 reads 5-/6-bit weights in the planes layout (ilp_base)
#endif

// Up to 32 rows: the few-row path in passes of 8 rows (AVX-512 VNNI builds); more: tiles of 16 (5-/6-bit planes
// too, over ilp_quads' bytes). AVX2 builds: the 8-lane path above at every row count. Elsewhere the scalar tiles (8 rows up to 8).
// Same bits every way (exact integer sums, the same per-lane float operations).
// il: the weight is interleaved (il16_index: 4 or 8 bits; ilp_base: 5 or 6 bits; N a multiple of 16).
void qmm_a8_cpu(const float* x, int M, int K, const uint32_t* wq, const Quant& S, int gs, int bits, float* y, int N,
                bool il) {
  if (M <= 0) return;
  [[maybe_unused]] auto with_il = [&](auto f) {
    if (il) f(std::true_type{}); else f(std::false_type{});
  };
#if defined(FX_A8_AVX2)
  if (il && S.unpacks())  // 5-/6-bit weights in the planes layout
    return S.wbits == 6 ? qmm_a8_few8<6, true, true>(x, M, K, wq, S, gs, y, N)
                        : qmm_a8_few8<5, true, true>(x, M, K, wq, S, gs, y, N);
  return with_bits(bits, [&](auto b) {
    with_il([&](auto l) { qmm_a8_few8<decltype(b)::value, decltype(l)::value>(x, M, K, wq, S, gs, y, N); });
  });
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  if (il && S.unpacks() && M <= PLANES_FEW_ROWS)  // 5-/6-bit weights in the planes layout
    return S.wbits == 6 ? qmm_a8_few<6, true, true>(x, M, K, wq, S, gs, y, N)
                        : qmm_a8_few<5, true, true>(x, M, K, wq, S, gs, y, N);
  if (M <= A8_FEW_ROWS)
    return with_bits(bits, [&](auto b) {
      with_il([&](auto l) { qmm_a8_few<decltype(b)::value, decltype(l)::value>(x, M, K, wq, S, gs, y, N); });
    });
#else
  if (M <= 8) return qmm_a8_rows<8>(x, M, K, wq, S, gs, bits, y, N, il);
#endif
  qmm_a8_rows<16>(x, M, K, wq, S, gs, bits, y, N, il);
}

void dequant_cpu(const uint32_t* wq, const Quant& S, int gs, int bits,
                 float* out, int N, int K) {
  const int groups = K / gs;
  const int per = std::max(4, 65536 / std::max(K, 1));
  pool().run((N + per - 1) / per, [&](int c) {
    const int n0 = c * per, n1 = std::min(N, (c + 1) * per);
    std::vector<float> tmp(K), st(2 * static_cast<size_t>(groups));
    std::vector<uint8_t> wt(S.unpacks() ? K : 0);
    for (int n = n0; n < n1; ++n) {
      float* o = out + static_cast<int64_t>(n) * K;
      const float *rs, *rb;
      S.row(n, st.data(), rs, rb);
      const uint32_t* row = reinterpret_cast<const uint32_t*>(S.weights(wq, n, 1, K, wt.data()));
      if (bits == 4)
        dequant_row_natural<4>(row, rs, rb, K, gs, o, tmp.data());
      else  // 8 bits, and 5/6 unpacked to bytes
        dequant_row_natural<8>(row, rs, rb, K, gs, o, tmp.data());
    }
  });
}
