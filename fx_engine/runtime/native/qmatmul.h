// Part of fx-engine's native kernels: float32 quantized matmuls: dequantization, qmm, qgemm (register tiles and the few-row paths).
// Not a standalone header: kernels.cpp includes the kernel families in order, inside its
// anonymous namespace, as one translation unit (one compile, everything inlinable).
#pragma once

// ---------------------------------------------------------------- dequantization
// One weight row (K values) from MLX's affine format: q packed little-endian into
// uint32 words (4 bits: 8 per word, element j at bits 4*(j%8); 8 bits: 4 per word),
// w = scale * q + bias per group of `gs` values.
//
// 4-bit rows are written in "split" order: within each block of 32 values the 16 even
// elements (low nibbles) come first, then the 16 odd ones (high nibbles), which is what a
// byte-wise unpack gives without shuffles. The activations are permuted the same way once
// per call (`split_rows`), so the dot products are unchanged up to summation order (fixed).
typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// u8 -> i32 (GCC scalarizes it on AVX2 builds).
inline i32x16 widen_u8(u8x16 v) {
#if defined(__AVX512F__)
  __m128i b;
  std::memcpy(&b, &v, 16);
  const __m512i w = _mm512_cvtepu8_epi32(b);
  i32x16 r;
  std::memcpy(&r, &w, 64);
  return r;
#elif defined(FX_AVX2)
  __m128i b;
  std::memcpy(&b, &v, 16);
  const __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  i32x16 r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
#else
  return __builtin_convertvector(v, i32x16);
#endif
}

// u8 -> i32 -> f32. GCC scalarizes a direct u8 -> float conversion (and sometimes the
// u8 -> i32 one), so AVX-512 and AVX2 get the instructions spelled out.
inline v16 to_float(u8x16 v) {
#if defined(__AVX512F__)
  __m128i b;
  std::memcpy(&b, &v, 16);
  __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  v16 r;
  std::memcpy(&r, &f, 64);
  return r;
#elif defined(FX_AVX2)
  __m128i b;
  std::memcpy(&b, &v, 16);
  return join(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
#else
  return __builtin_convertvector(__builtin_convertvector(v, i32x16), v16);
#endif
}

template <int BITS>
inline void dequant_row(const uint32_t* wq, const float* sc, const float* bi, int K, int gs,
                        float* out) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(wq);
  for (int g = 0; g < K / gs; ++g) {
    const v16 s = splat(sc + g), c = splat(bi + g);
    float* o = out + g * gs;
    if constexpr (BITS == 8) {
      const uint8_t* q = b + g * gs;
      for (int j = 0; j < gs; j += VL) {
        const u8x16 v = *reinterpret_cast<const u8x16*>(q + j);
        store(o + j, s * to_float(v) + c);
      }
    } else {
      const uint8_t* q = b + g * gs / 2;
      for (int j = 0; j < gs; j += 32) {
        const u8x16 v = *reinterpret_cast<const u8x16*>(q + j / 2);
        store(o + j, s * to_float(v & 15) + c);
        store(o + j + VL, s * to_float(v >> 4) + c);
      }
    }
  }
}

// Natural element order (for the dequantize op): split order, then un-split per 32 block.
template <int BITS>
inline void dequant_row_natural(const uint32_t* wq, const float* sc, const float* bi, int K,
                                int gs, float* out, float* tmp) {
  if constexpr (BITS == 8) {
    dequant_row<8>(wq, sc, bi, K, gs, out);
  } else {
    dequant_row<4>(wq, sc, bi, K, gs, tmp);
    for (int j = 0; j < K; j += 32)
      for (int i = 0; i < 16; ++i) {
        out[j + 2 * i] = tmp[j + i];
        out[j + 2 * i + 1] = tmp[j + 16 + i];
      }
  }
}

// x rows [M, K] -> the 4-bit kernels' split order (see dequant_row).
inline void split_rows(const float* x, int M, int K, float* out) {
  for (int m = 0; m < M; ++m) {
    const float* xr = x + static_cast<int64_t>(m) * K;
    float* o = out + static_cast<int64_t>(m) * K;
    for (int j = 0; j < K; j += 32)
      for (int i = 0; i < 16; ++i) {
        o[j + i] = xr[j + 2 * i];
        o[j + 16 + i] = xr[j + 2 * i + 1];
      }
  }
}

// ---------------------------------------------------------------- qmm micro-kernel
// acc[i][j] accumulates x row i against dequantized weight row j over all of K.
template <int MB, int NB>
inline void qmm_tile(const float* x, int64_t ldx, const float* w, int K, float* y, int64_t ldy) {
  v16 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = v16{};
  for (int k = 0; k < K; k += VL) {
    v16 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load(w + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const v16 xv = load(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + j] = hsum(acc[i][j]);
}

template <int NB>
inline void qmm_rows(const float* x, int M, int K, const float* w, float* y, int N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) qmm_tile<4, NB>(x + m * K, K, w, K, y + m * N, N);
  switch (M - m) {
    case 3: qmm_tile<3, NB>(x + m * K, K, w, K, y + m * N, N); break;
    case 2: qmm_tile<2, NB>(x + m * K, K, w, K, y + m * N, N); break;
    case 1: qmm_tile<1, NB>(x + m * K, K, w, K, y + m * N, N); break;
    default: break;
  }
}

template <int BITS>
void qmm_range(const float* x, int M, int K, const uint32_t* wq, const Quant& S, int gs, float* y, int N, int n0, int n1) {
  constexpr int NB = 4;
  const int words = K * BITS / 32, groups = K / gs;
  thread_local std::vector<float> buf;
  if (static_cast<int>(buf.size()) < NB * K) buf.resize(NB * K);
  float* w = buf.data();
  float* tmp = scale_tmp(1, groups);
  uint8_t* wt = S.unpacks() ? weight_tmp(K) : nullptr;
  auto row = [&](int64_t r) { return reinterpret_cast<const uint32_t*>(S.weights(wq, r, 1, K, wt)); };
  const float *rs, *rb;
  int n = n0;
  for (; n + NB <= n1; n += NB) {
    for (int j = 0; j < NB; ++j) {
      const int64_t r = n + j;
      S.row(r, tmp, rs, rb);
      dequant_row<BITS>(row(r), rs, rb, K, gs, w + j * K);
    }
    qmm_rows<NB>(x, M, K, w, y + n, N);
  }
  for (; n < n1; ++n) {
    const int64_t r = n;
    S.row(r, tmp, rs, rb);
    dequant_row<BITS>(row(r), rs, rb, K, gs, w);
    qmm_rows<1>(x, M, K, w, y + n, N);
  }
}

// ---------------------------------------------------------------- qmm: a few rows, fused
// Up to QM_FEW rows (decode and verify steps) the dequantized copy above costs more than
// the products it serves: a 4-bit weight took shift, mask, convert, scale, bias, store and
// a reload per use. Here each weight row is read once, in place (one contiguous stream per
// output feature, which the hardware prefetchers follow), dequantized in registers and
// used at once by every row of the pass. The arithmetic per output is qmm_tile's exactly:
// w = scale * q + bias rounded as in dequant_row, acc = fma(x, w, acc) over k in steps of
// 16 (the 4-bit split order), from +0, then hsum: the same bits at every row count (tested).
//
// AVX-512: a group's 16 possible 4-bit values are computed once (scale * [0..15] + bias,
// the same mul and add) and each weight vector is one lookup (vpermps indexes by the low
// 4 bits of each lane): per 32 weights a widening load, a shift, two lookups and the FMAs.
constexpr int QM_FEW = 16;  // up to this many rows take this path
#if defined(FX_AVX2)
constexpr int QM_PASS = 4;  // rows per pass over a few weight rows (AVX2: 8 rows' halves would spill)
#else
constexpr int QM_PASS = 8;  // rows per pass over a few weight rows (their accumulators)
#endif
constexpr int QM_AHEAD = 2;  // tiles ahead whose rows are prefetched (1, 3, 4, 8: slower)

// Output features run at once for MR rows: independent accumulator chains (one row alone
// would wait on the FMA latency) within the vector registers (32 on AVX-512; AVX2's 16
// hold half a v16 each).
template <int MR>
constexpr int qm_feats() {
#if defined(__AVX512F__)
  return MR == 1 ? 6 : MR == 2 ? 4 : MR <= 4 ? 3 : 2;
#elif defined(FX_AVX2)  // (16 registers: 2 per accumulator)
  return MR == 1 ? 3 : MR == 2 ? 2 : 1;
#else
  return MR == 1 ? 2 : 1;
#endif
}

// w = s * q + c as dequant_row rounds it (a multiply, then an add), or with FE
// (Quant::fma_exact: s * q exact in float32) one FMA: the same float, one instruction a
// vector fewer. Per width: v16 (which is AVX-512's __m512 to GCC) and AVX2's __m256.
template <bool FE>
inline v16 deq_affine(v16 s, v16 q, v16 c) {
  if constexpr (FE)
    return fma(s, q, c);
  else
    return s * q + c;
}
#if defined(__AVX2__) && defined(__FMA__)
template <bool FE>
inline __m256 deq_affine(__m256 s, __m256 q, __m256 c) {
  if constexpr (FE)
    return _mm256_fmadd_ps(s, q, c);
  else
    return _mm256_add_ps(_mm256_mul_ps(s, q), c);
}
#endif

// One group's dequantization state: its lookup table (AVX-512, 4 bits) or its scale and
// bias in every lane.
struct GroupDeq {
  v16 s, c;
};
inline GroupDeq group_deq(int bits, float s, float c) {
#if defined(__AVX512F__)
  if (bits == 4) {
    const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return {bcast(s) * iota + bcast(c), v16{}};  // the values scale * q + bias, q = 0..15
  }
#else
  (void)bits;
#endif
  return {bcast(s), bcast(c)};
}

// 32 4-bit weights (16 bytes, split order) -> their dequantized values: lo (low nibbles,
// the first 16 in split order), hi.
template <bool FE>
inline void deq4x32(const uint8_t* p, const GroupDeq& d, v16& lo, v16& hi) {
#if defined(__AVX512F__)
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 t = reinterpret_cast<const __m512&>(d.s);
  const __m512 a = _mm512_permutexvar_ps(idx, t), b = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), t);
  std::memcpy(&lo, &a, 64);
  std::memcpy(&hi, &b, 64);
#else
  const u8x16 v = *reinterpret_cast<const u8x16*>(p);
  lo = deq_affine<FE>(d.s, to_float(v & 15), d.c);
  hi = deq_affine<FE>(d.s, to_float(v >> 4), d.c);
#endif
}

// 16 8-bit weights -> their dequantized values.
template <bool FE>
inline v16 deq8x16(const uint8_t* p, const GroupDeq& d) {
  return deq_affine<FE>(d.s, to_float(*reinterpret_cast<const u8x16*>(p)), d.c);
}

#if defined(FX_AVX2)
// The AVX2 build's tile: qmm_fused_tile below with each v16 as its two 8-float halves spelled
// out (lanes 0-7, 8-15: the same lanes, the same FMAs, the same hsum), which GCC's generic
// 64-byte vectors turned into ~4x slower code here. Each half's 8 bytes are widened to
// int32 lanes straight from memory (vpmovzxbd m64); a 4-bit half's low nibbles are then
// `& 15` and its high ones `>> 4`, so a 32-k step is two widening loads, two ands, two
// shifts, four conversions and the FMAs: no byte shuffles of a loaded register (the
// 16-byte load split with vpsrldq and widened from registers, and its nibbles masked
// before widening, measured 8.1 -> 13.2 G weights/s a core on a cached 4-bit matrix,
// Zen 3; every product bit for bit the same).
template <int BITS, int MR, int NF, bool FE>
inline void qmm_fused_tile_avx2(const float* x, int K, const uint8_t* const* rw, const float* const* rs,
                                const float* const* rb, int gs, float* y, int N, const char* pf,
                                int64_t pf_bytes) {
  __m256 acc[MR][NF][2];
  #pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    #pragma GCC unroll 16
    for (int f = 0; f < NF; ++f) acc[m][f][0] = acc[m][f][1] = _mm256_setzero_ps();
  const int64_t pf_step = ((pf_bytes + 63) / 64 + K / gs - 1) / (K / gs) * 64;
  const __m256i low = _mm256_set1_epi32(15);
  auto widen8 = [](const uint8_t* p) {  // 8 bytes -> 8 int32 lanes
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  };
  for (int g = 0; g < K / gs; ++g) {
    for (int64_t o = g * pf_step, e = std::min(pf_bytes, o + pf_step); o < e; o += 64)
      _mm_prefetch(pf + o, _MM_HINT_T1);
    for (int j = g * gs; j < (g + 1) * gs; j += BITS == 4 ? 32 : 16) {
      #pragma GCC unroll 16
      for (int f = 0; f < NF; ++f) {
        const __m256 sv = _mm256_broadcast_ss(rs[f] + g), cv = _mm256_broadcast_ss(rb[f] + g);
        auto deq = [&](__m256i q) { return deq_affine<FE>(sv, _mm256_cvtepi32_ps(q), cv); };
        // vectors of 8 values (4 bits: the low nibbles of bytes 0-7, of 8-15, then the
        // high ones; 8 bits: bytes 0-7, 8-15), each scale * q + bias
        const uint8_t* p = rw[f] + (BITS == 4 ? j / 2 : j);
        const __m256i va = widen8(p), vb = widen8(p + 8);
        __m256 w[4];
        if constexpr (BITS == 4) {
          w[0] = deq(_mm256_and_si256(va, low));
          w[1] = deq(_mm256_and_si256(vb, low));
          w[2] = deq(_mm256_srli_epi32(va, 4));
          w[3] = deq(_mm256_srli_epi32(vb, 4));
        } else {
          w[0] = deq(va);
          w[1] = deq(vb);
        }
        #pragma GCC unroll 16
        for (int m = 0; m < MR; ++m)
          for (int i = 0; i < (BITS == 4 ? 4 : 2); ++i)
            acc[m][f][i % 2] = _mm256_fmadd_ps(_mm256_loadu_ps(x + int64_t{m} * K + j + 8 * i), w[i], acc[m][f][i % 2]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    #pragma GCC unroll 16
    for (int f = 0; f < NF; ++f) y[int64_t{m} * N + f] = hsum(join(acc[m][f][0], acc[m][f][1]));
}
#endif

// MR rows of x (row stride K, split order for 4 bits) against NF weight rows (rw[f], their
// float32 scales and biases rs[f], rb[f]): y[m * N + f] for f < NF.
// pf: bytes [pf, pf + pf_bytes) prefetched into L2 a slice per group (the rows a few tiles
// ahead: one row's stream alone is read at about half the DRAM's rate, measured).
template <int BITS, int MR, int NF, bool FE>
inline void qmm_fused_tile(const float* x, int K, const uint8_t* const* rw, const float* const* rs,
                           const float* const* rb, int gs, float* y, int N, const char* pf,
                           int64_t pf_bytes) {
#if defined(FX_AVX2)
  return qmm_fused_tile_avx2<BITS, MR, NF, FE>(x, K, rw, rs, rb, gs, y, N, pf, pf_bytes);
#endif
  // (the unroll pragmas: GCC keeps acc in registers only once its loops are unrolled; at
  // 4-16 rows it stored all of them every step: 8 rows of 8192 x 576, 1390 -> 599 us)
  v16 acc[MR][NF];
  #pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    #pragma GCC unroll 16
    for (int f = 0; f < NF; ++f) acc[m][f] = v16{};
  const int64_t pf_step = ((pf_bytes + 63) / 64 + K / gs - 1) / (K / gs) * 64;
  for (int g = 0; g < K / gs; ++g) {
#if defined(__x86_64__)
    for (int64_t o = g * pf_step, e = std::min(pf_bytes, o + pf_step); o < e; o += 64)
      _mm_prefetch(pf + o, _MM_HINT_T1);
#endif
    GroupDeq d[NF];
    #pragma GCC unroll 16
    for (int f = 0; f < NF; ++f) d[f] = group_deq(BITS, rs[f][g], rb[f][g]);
    for (int j = g * gs; j < (g + 1) * gs; j += BITS == 4 ? 32 : 16) {
      if constexpr (BITS == 4) {
        v16 lo[NF], hi[NF];
        #pragma GCC unroll 16
        for (int f = 0; f < NF; ++f) deq4x32<FE>(rw[f] + j / 2, d[f], lo[f], hi[f]);
        #pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          v16 xl = load(x + int64_t{m} * K + j), xh = load(x + int64_t{m} * K + j + VL);
#if defined(__AVX512F__)
          if constexpr (NF > 1) asm("" : "+v"(xl), "+v"(xh));  // loaded once (qmm_many_tile)
#endif
          #pragma GCC unroll 16
          for (int f = 0; f < NF; ++f) acc[m][f] = fma(xh, hi[f], fma(xl, lo[f], acc[m][f]));
        }
      } else {
        v16 w[NF];
        #pragma GCC unroll 16
        for (int f = 0; f < NF; ++f) w[f] = deq8x16<FE>(rw[f] + j, d[f]);
        #pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          v16 xv = load(x + int64_t{m} * K + j);
#if defined(__AVX512F__)
          if constexpr (NF > 1) asm("" : "+v"(xv));
#endif
          #pragma GCC unroll 16
          for (int f = 0; f < NF; ++f) acc[m][f] = fma(xv, w[f], acc[m][f]);
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    #pragma GCC unroll 16
    for (int f = 0; f < NF; ++f) y[int64_t{m} * N + f] = hsum(acc[m][f]);
}

// Output features [n0, n1) for all M (<= QM_FEW) rows, in passes of QM_PASS rows.
template <int BITS>
void qmm_fused_range(const float* x, int M, int K, const uint32_t* wq, const Quant& S, int gs,
                     float* y, int N, int n0, int n1) {
  constexpr int NFMAX = qm_feats<1>();
  const int groups = K / gs;
  float* tmp = scale_tmp(NFMAX, groups);
  uint8_t* wt = S.unpacks() ? weight_tmp(int64_t{NFMAX} * K) : nullptr;
  const int64_t row_bytes = int64_t{K} * BITS / 8;
#if defined(__AVX512F__)
  constexpr bool fe_used = BITS == 8;  // (4 bits: lookups in a table made once a group)
#else
  constexpr bool fe_used = true;
#endif
  for (int m0 = 0; m0 < M; m0 += QM_PASS)
    with_rows<QM_PASS>(std::min(QM_PASS, M - m0), [&](auto mr) {
      with_flag<fe_used>(S.fma_exact(), [&](auto fe) {
        constexpr int MR = decltype(mr)::value, NF = qm_feats<MR>();
        constexpr bool FE = decltype(fe)::value;
        const float* xm = x + int64_t{m0} * K;
        float* ym = y + int64_t{m0} * N;
        for (int n = n0; n < n1; n += NF) {
          const int nf = std::min(NF, n1 - n);
          const float *ds, *db;
          S.rows(n, nf, tmp, ds, db);
          const char* w = S.weights(wq, n, nf, K, wt);  // (5-/6-bit rows unpacked into wt)
          const uint8_t* rw[NF];
          const float* rs[NF];
          const float* rb[NF];
          for (int f = 0; f < NF; ++f) {
            const int r = std::min(f, nf - 1);
            rw[f] = reinterpret_cast<const uint8_t*>(w) + r * row_bytes;
            rs[f] = ds + int64_t{r} * groups;
            rb[f] = db + int64_t{r} * groups;
          }
          // the stored rows QM_AHEAD tiles on (across the range's end: the next range is
          // usually this thread's too), and their scales
          const int64_t ahead = n + int64_t{QM_AHEAD} * NF, pf_rows = std::max<int64_t>(0, std::min<int64_t>(NF, N - ahead));
          const char* pf = S.stored_row(wq, ahead, K);
          const int64_t pf_bytes = pf_rows * S.stored_row_bytes(K);
          S.prefetch(ahead, pf_rows);
          if (nf == NF) {
            qmm_fused_tile<BITS, MR, NF, FE>(xm, K, rw, rs, rb, gs, ym + n, N, pf, pf_bytes);
          } else {  // the range's last few features: one at a time
            for (int f = 0; f < nf; ++f)
              qmm_fused_tile<BITS, MR, 1, FE>(xm, K, rw + f, rs + f, rb + f, gs, ym + n + f, N, pf, f ? 0 : pf_bytes);
          }
        }
      });
    });
}

#if defined(__AVX512F__) || defined(FX_AVX2)
// ---------------------------------------------------------------- qmm: many rows (AVX-512, AVX2)
// Above QM_FEW rows (prefill chunks) the dequantized copy pays: a thread dequantizes a
// chunk of output features (~256 KB of float32, L2) once, then runs every 4-row tile of
// the activations against it, 6 features at a time: 24 accumulators, 4 activation vectors
// and one weight vector per step (10 loads per 24 FMAs; qmm_tile's 4 x 4 made 8 per 16).
// AVX2 (16 registers of 8 floats: a v16 accumulator is two): tiles of 3 rows x 2 features,
// 12 accumulators, the two halves of each 16-k step in turn (10 loads per 12 FMAs; qmm_tile
// there kept 32 halves and spilled them: 64 rows of 16384 x 2048 took 7x qgemm's time).
// The same arithmetic per output as every qmm path (acc = fma(x, w, acc) over k in steps
// of 16 from +0, then hsum), so the same bits.
#if defined(__AVX512F__)
constexpr int QM_TILE_ROWS = 4, QM_TILE_FEAT = 6;
#else
constexpr int QM_TILE_ROWS = 3, QM_TILE_FEAT = 2;
#endif

#if defined(__AVX512F__)
// *out[i] = hsum(*a[i]) for 16 vectors at once: the same adds in the same tree as hsum()
// (_mm512_reduce_add_ps: lanes i + (i + 8), then i + (i + 4), then (0 + 2) + (1 + 3)), done
// across registers (~3 instructions a vector instead of ~8: at K = 576 the one-by-one sums
// were a fifth of a tile's work).
inline void hsum16(const v16* const* a, float* const* out) {
  auto ld = [&](int i) { return _mm512_load_ps(reinterpret_cast<const float*>(a[i])); };
  __m512 t[8], u[4];
  for (int p = 0; p < 8; ++p) {  // lanes 0-7: a[2p]'s i + (i + 8); lanes 8-15: a[2p + 1]'s
    const __m512 x = ld(2 * p), y = ld(2 * p + 1);
    t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int r = 0; r < 4; ++r)  // 128-bit lane q: a[4r + q]'s i + (i + 4), i = 0..3
    u[r] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * r], t[2 * r + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * r], t[2 * r + 1], 0xDD));
  // per 128-bit lane L: [u0's (0 + 2), u0's (1 + 3), u1's (0 + 2), u1's (1 + 3)]
  const __m512 r0 = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x44), _mm512_shuffle_ps(u[0], u[1], 0xEE));
  const __m512 r1 = _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], 0x44), _mm512_shuffle_ps(u[2], u[3], 0xEE));
  // lane L, element e: a[4e + L]'s (0 + 2) + (1 + 3)
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(r0, r1, 0x88), _mm512_shuffle_ps(r0, r1, 0xDD));
  alignas(64) float v[16];
  _mm512_store_ps(v, f);
  for (int L = 0; L < 4; ++L)
    for (int e = 0; e < 4; ++e) *out[4 * e + L] = v[4 * L + e];
}
#else
inline void hsum16(const v16* const* a, float* const* out) {  // (AVX2: one by one, the same tree)
  for (int i = 0; i < 16; ++i) *out[i] = hsum(*a[i]);
}
#endif

// k per pass (K = 8192: 4096 measured ~10% faster than one pass; 512-2048 slower)
constexpr int QM_KC = 4096;

// acc[MR][NB] (kept in st between passes over k) += x[m, k0:k1] * w[f, k0:k1].
template <int MR, int NB>
inline void qmm_many_tile(const float* __restrict x, int64_t ld, const float* __restrict w, int k0, int k1,
                          v16* st, bool first) {
#if defined(FX_AVX2)
  __m256 acc[MR][NB][2];  // lanes 0-7 and 8-15 of each v16 accumulator
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int f = 0; f < NB; ++f) {
      if (first)
        acc[m][f][0] = acc[m][f][1] = _mm256_setzero_ps();
      else
        halves(st[m * NB + f], acc[m][f][0], acc[m][f][1]);
    }
  for (int k = k0; k < k1; k += VL)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 wv[NB];
#pragma GCC unroll 16
      for (int f = 0; f < NB; ++f) {
        wv[f] = _mm256_loadu_ps(w + f * ld + k + 8 * h);
        asm("" : "+x"(wv[f]));
      }
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        __m256 xv = _mm256_loadu_ps(x + m * ld + k + 8 * h);
        asm("" : "+x"(xv));
#pragma GCC unroll 16
        for (int f = 0; f < NB; ++f) acc[m][f][h] = _mm256_fmadd_ps(xv, wv[f], acc[m][f][h]);
      }
    }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int f = 0; f < NB; ++f) st[m * NB + f] = join(acc[m][f][0], acc[m][f][1]);
#else
  v16 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int f = 0; f < NB; ++f) acc[m][f] = first ? v16{} : st[m * NB + f];
  for (int k = k0; k < k1; k += VL) {
    v16 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load(x + m * ld + k);
    for (int f = 0; f < NB; ++f) {
      v16 wv = load(w + f * ld + k);
      asm("" : "+v"(wv));  // one load into a register: GCC otherwise folds it into every FMA
      for (int m = 0; m < MR; ++m) acc[m][f] = fma(xv[m], wv, acc[m][f]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int f = 0; f < NB; ++f) st[m * NB + f] = acc[m][f];
#endif
}

// MR rows of x against the chunk's nc dequantized features (w, stride K) -> y[m * N + f]:
// in passes of QM_KC over k, every block of 6 features per pass (their accumulators kept
// in st between passes).
template <int MR>
inline void qmm_many_rows(const float* x, int64_t ld, int K, const float* w, int nc, float* y, int N, v16* st) {
  for (int k0 = 0; k0 < K; k0 += QM_KC) {
    const int k1 = std::min(K, k0 + QM_KC);
    for (int f = 0; f < nc; f += QM_TILE_FEAT)
      with_rows<QM_TILE_FEAT>(std::min(QM_TILE_FEAT, nc - f), [&](auto nb) {
        qmm_many_tile<MR, decltype(nb)::value>(x, ld, w + f * ld, k0, k1,
                                                 st + int64_t{f} * MR, k0 == 0);
      });
  }
  // the horizontal sums, 16 at a time (hsum16), the rest one by one
  const v16* src[16];
  float* dst[16];
  int n = 0;
  for (int f = 0; f < nc; f += QM_TILE_FEAT) {
    const int nb = std::min(QM_TILE_FEAT, nc - f);
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < nb; ++j) {
        src[n] = st + int64_t{f} * MR + m * nb + j;
        dst[n] = y + int64_t{m} * N + f + j;
        if (++n == 16) {
          hsum16(src, dst);
          n = 0;
        }
      }
  }
  for (int i = 0; i < n; ++i) *dst[i] = hsum(*src[i]);
}

void qmm_many(const float* x0, int M, int K, const uint32_t* wq, const Quant& S, int gs, int bits,
              float* y, int N) {
  const int groups = K / gs;
  // Rows of the activations and of the dequantized weights 16 floats apart from a multiple
  // of 4 KB, so a tile's 10 streams (at a stride of K floats, often a power of two) do not
  // all fall in the same L1 sets (a precaution: no difference was measured at K = 2048).
  const int64_t ld = K + VL;
  std::vector<float> xp(static_cast<size_t>(M) * ld);
  for (int m = 0; m < M; ++m) std::memcpy(xp.data() + m * ld, x0 + int64_t{m} * K, sizeof(float) * K);
  const float* x = xp.data();
  // features per chunk: whole blocks of 6, ~256 KB of dequantized rows
  const int per = QM_TILE_FEAT * std::max(2, 65536 / (QM_TILE_FEAT * std::max(K, 1)));
  pool().run((N + per - 1) / per, [&](int c) {
    const int n0 = c * per, n1 = std::min(N, n0 + per), nc = n1 - n0;
    thread_local std::vector<float> buf;
    if (buf.size() < static_cast<size_t>(per) * ld) buf.resize(static_cast<size_t>(per) * ld);
    float* tmp = scale_tmp(per, groups);
    uint8_t* wt = S.unpacks() ? weight_tmp(int64_t{per} * K) : nullptr;
    const float *ds, *db;
    S.rows(n0, nc, tmp, ds, db);
    const char* w = S.weights(wq, n0, nc, K, wt);
    const int64_t row_bytes = int64_t{K} * (bits == 4 ? 4 : 8) / 8;
    for (int j = 0; j < nc; ++j) {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(w + j * row_bytes);
      if (bits == 4)
        dequant_row<4>(row, ds + int64_t{j} * groups, db + int64_t{j} * groups, K, gs, buf.data() + j * ld);
      else  // 8 bits, and 5/6 unpacked to bytes
        dequant_row<8>(row, ds + int64_t{j} * groups, db + int64_t{j} * groups, K, gs, buf.data() + j * ld);
    }
    thread_local std::vector<v16> st;
    if (st.size() < static_cast<size_t>(QM_TILE_ROWS) * per) st.resize(static_cast<size_t>(QM_TILE_ROWS) * per);
    int m = 0;
    for (; m + QM_TILE_ROWS <= M; m += QM_TILE_ROWS)
      qmm_many_rows<QM_TILE_ROWS>(x + m * ld, ld, K, buf.data(), nc, y + int64_t{m} * N + n0, N, st.data());
    with_rows<QM_TILE_ROWS - 1>(M - m, [&](auto mr) {
      qmm_many_rows<decltype(mr)::value>(x + m * ld, ld, K, buf.data(), nc, y + int64_t{m} * N + n0, N, st.data());
    });
  });
}
#endif

void qmm_cpu(const float* x, int M, int K, const uint32_t* wq, const Quant& S,
             int gs, int bits, float* y, int N) {
  constexpr int NB = 4;
  const int blocks = (N + NB - 1) / NB;
  std::vector<float> xs;
  if (bits == 4) {  // activations in the split order of the dequantized 4-bit rows
    xs.resize(static_cast<size_t>(M) * K);
    split_rows(x, M, K, xs.data());
    x = xs.data();
  }
  if (M <= QM_FEW) {
    // Chunks of whole tiles (12 features: a multiple of every qm_feats), ~24 KB of 4-bit
    // weights or more each, about 4 runs of consecutive tiles per thread (stream_chunk:
    // each tile prefetches the rows a few tiles on, which a chunk's first tiles miss).
    const int per = 12 * stream_chunk((N + 11) / 12, std::max(1, 4096 / std::max(K, 1)));
    pool().run((N + per - 1) / per, [&](int c) {
      const int n0 = c * per, n1 = std::min(N, n0 + per);
      if (bits == 4)
        qmm_fused_range<4>(x, M, K, wq, S, gs, y, N, n0, n1);
      else  // 8 bits, and 5/6 unpacked to bytes
        qmm_fused_range<8>(x, M, K, wq, S, gs, y, N, n0, n1);
    });
    return;
  }
#if defined(__AVX512F__) || defined(FX_AVX2)
  return qmm_many(x, M, K, wq, S, gs, bits, y, N);
#endif
  // Parallel over output features: each y[m, n] is computed by exactly one thread.
  // Chunks of output features, ~32 KB of 4-bit weights or more each.
  const int per = std::max(4, 16384 / std::max(K, 1));
  const int chunks = (blocks + per - 1) / per;
  pool().run(chunks, [&](int c) {
    const int n0 = std::min(N, c * per * NB), n1 = std::min(N, (c + 1) * per * NB);
    if (bits == 4)
      qmm_range<4>(x, M, K, wq, S, gs, y, N, n0, n1);
    else  // 8 bits, and 5/6 unpacked to bytes
      qmm_range<8>(x, M, K, wq, S, gs, y, N, n0, n1);
  });
}

// ---------------------------------------------------------------- qgemm
// The same product as qmm for many rows (prefill chunks, wide decode batches), organised
// the other way round: vectors run along the activation rows and every dequantized
// weight value is broadcast. A register tile holds 12 output features x 32 rows (24
// accumulators), so each weight value is read once per 32 rows and each activation
// vector once per 12 features: the loop is bound by the FMA units, not by loads. Measured
// on a 2-core Zen 4 (FMA peak 229 GFLOP/s): 197 GFLOP/s at 512 rows, 147 at 32, vs ~80
// for qmm's old 4x4 tile (its AVX-512 many-row path now: ~160-200 at K = 2048-8192, ~175
// at K = 576) and ~110-130 for MKL's SGEMM on the dequantized weight. Below ~16 rows most
// vector lanes would be padding: qmm is the kernel there. The tile needs 24 + 3 vector
// registers: AVX-512 only (`tiled_gemm` tells Python; elsewhere a v16 is 2-4 registers
// and the tile would spill, so fx_engine.nn keeps the BLAS path there).
//
// Each output y[m, n] is one lane of one accumulator: a sequential float32 sum over k
// (in the 4-bit split order), one FMA rounding per term, whatever the row count, the
// row's position in its tile or the thread. So qgemm is batch-invariant by construction
// too; its summation order (and so its last bits) differs from qmm's.
constexpr int QG_ROWS = 32;  // activation rows per tile (two vectors)
constexpr int QG_FEAT = 12;  // output features per tile

// x rows [M, K] -> tiles [ceil(M/32)][K][32], zero-padded rows, K in the weight rows'
// order (the 4-bit split order when split).
void pack_cols(const float* x, int M, int K, bool split, float* xt) {
  const int tiles = (M + QG_ROWS - 1) / QG_ROWS;
  pool().run(tiles, [&](int t) {
    float* o = xt + static_cast<int64_t>(t) * K * QG_ROWS;
    const int m0 = t * QG_ROWS, mc = std::min(QG_ROWS, M - m0);
    if (mc < QG_ROWS) std::memset(o, 0, sizeof(float) * K * QG_ROWS);
    for (int i = 0; i < mc; ++i) {
      const float* xr = x + static_cast<int64_t>(m0 + i) * K;
      if (split) {
        for (int j = 0; j < K; j += 32)
          for (int q = 0; q < 16; ++q) {
            o[static_cast<int64_t>(j + q) * QG_ROWS + i] = xr[j + 2 * q];
            o[static_cast<int64_t>(j + 16 + q) * QG_ROWS + i] = xr[j + 2 * q + 1];
          }
      } else {
        for (int k = 0; k < K; ++k) o[static_cast<int64_t>(k) * QG_ROWS + i] = xr[k];
      }
    }
  });
}

// acc[j][v] += xt[k][16v..16v+16] * w[j][k] over all k; out [NW][32].
template <int NW, int MV>
inline void qgemm_tile(const float* __restrict xt, const float* __restrict w, int K,
                       float* __restrict out) {
  v16 acc[NW][MV];
  for (int j = 0; j < NW; ++j)
    for (int v = 0; v < MV; ++v) acc[j][v] = v16{};
  for (int k = 0; k < K; ++k) {
    v16 a[MV];
    for (int v = 0; v < MV; ++v) a[v] = load(xt + static_cast<int64_t>(k) * QG_ROWS + v * VL);
    for (int j = 0; j < NW; ++j) {
      const v16 b = splat(w + static_cast<int64_t>(j) * K + k);
      for (int v = 0; v < MV; ++v) acc[j][v] = fma(a[v], b, acc[j][v]);
    }
  }
  for (int j = 0; j < NW; ++j)
    for (int v = 0; v < MV; ++v) store(out + j * QG_ROWS + v * VL, acc[j][v]);
}

template <int NW>
inline void qgemm_tile_rows(int mv, const float* xt, const float* w, int K, float* out) {
  if (mv == 2)
    qgemm_tile<NW, 2>(xt, w, K, out);
  else
    qgemm_tile<NW, 1>(xt, w, K, out);
}

inline void qgemm_tile_any(int nw, int mv, const float* xt, const float* w, int K, float* out) {
  switch (nw) {
    case 12: qgemm_tile_rows<12>(mv, xt, w, K, out); break;
    case 11: qgemm_tile_rows<11>(mv, xt, w, K, out); break;
    case 10: qgemm_tile_rows<10>(mv, xt, w, K, out); break;
    case 9: qgemm_tile_rows<9>(mv, xt, w, K, out); break;
    case 8: qgemm_tile_rows<8>(mv, xt, w, K, out); break;
    case 7: qgemm_tile_rows<7>(mv, xt, w, K, out); break;
    case 6: qgemm_tile_rows<6>(mv, xt, w, K, out); break;
    case 5: qgemm_tile_rows<5>(mv, xt, w, K, out); break;
    case 4: qgemm_tile_rows<4>(mv, xt, w, K, out); break;
    case 3: qgemm_tile_rows<3>(mv, xt, w, K, out); break;
    case 2: qgemm_tile_rows<2>(mv, xt, w, K, out); break;
    default: qgemm_tile_rows<1>(mv, xt, w, K, out); break;
  }
}
static_assert(QG_FEAT == 12, "qgemm_tile_any dispatches 1..12 features");

#if defined(__AVX512F__)
// qgemm for a few rows (decode batches): the other orientation. Vectors run along 16
// output features; each weight vector is dequantized in registers from the packed words
// (16 weight rows' words transposed in registers, one word = 8 or 4 consecutive k) and
// used at once by every row, against a broadcast activation: no float copy of the
// weights, and one broadcast per row and k. (The tiles above broadcast every weight once
// per 16 or 32 rows: at 8 rows half their lanes are padding. Measured on the default
// model's shapes at 8 rows: ~2x qmm, whose inner products reuse a dequantized copy.)
//
// Each output is one lane of one accumulator: acc = fma(x[m, k], w[n, k], acc) over k in
// the 4-bit split order, from +0, with w = scale * q + bias rounded as in dequant_row: the
// tiles' exact arithmetic, so the bits are qgemm's whatever the path (tested).
constexpr int QG_FEW = 16;  // up to this many rows take this path

// Four consecutive 32-bit values of 16 rows (row j at rp[j] + off bytes) -> out[i]:
// value i of rows 0..15, one per lane. Four 16-byte loads per register, then a 4x4
// transpose inside each 128-bit lane (lane L of z[j] holds row 4L + j).
inline void transpose16x4(const char* const* rp, int64_t off, __m512i out[4]) {
  __m512i z[4];
  for (int j = 0; j < 4; ++j) {
    auto ld = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[r] + off)); };
    __m512i v = _mm512_castsi128_si512(ld(j));
    v = _mm512_inserti32x4(v, ld(j + 4), 1);
    v = _mm512_inserti32x4(v, ld(j + 8), 2);
    z[j] = _mm512_inserti32x4(v, ld(j + 12), 3);
  }
  // lane L of z[j] = row 4L + j: a 4x4 transpose per lane gives lane L of out[i] = value i
  // of rows 4L .. 4L + 3, i.e. out[i] lane r = row r.
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// The 16 weight rows of the feature block at n0 (rows past N repeat the last one: computed,
// never stored) as byte pointers rw[16], their scales and biases transposed once into
// sbuf[g][16] and sbuf[groups + g][16] (64-byte aligned), and the next block's packed rows
// to prefetch a slice of per 32-k step: the 16 interleaved row streams defeat the hardware
// prefetchers on large weights. Shared by the few-row paths of qgemm and qmm_a8.
constexpr int FEW_PF_AHEAD = 1;  // prefetch the packed rows of the block this many ahead
struct FewBlock {
  const char* rw[16];  // the rows' bytes (the rows layout's: unset for an interleaved block)
  const char* next;
  int64_t next_bytes, pf_step;
  int nv;
  const float* s = nullptr;  // the block's scales and biases as [groups][16] float32 vectors:
  const float* b = nullptr;  // sbuf's transposes (the rows layout's)
  // il: the interleaved arrays' own block ([groups][16] in their stored format, fmt), which
  // the kernel converts per group as it reads them (qmm_a8.h's il_scales16)
  const void* sil = nullptr;
  const void* bil = nullptr;
  int fmt = SF_F32;
  int sb = 1;  // (SF_KQ: groups per super-block)
};

// il: the interleaved layout (qmm_a8.h: il16_index's words or ilp_base's planes, the
// scales and biases [block][group][16]): the kernel reads the block's words and its
// [groups][16] scale vectors in place, so no rows (rw) or transposes are made here and
// sbuf is not used.
inline FewBlock few_block(int K, const uint32_t* wq, const Quant& S, int gs,
                          int bits, int N, int n0, float* sbuf, uint8_t* wtmp = nullptr,
                          bool il = false) {
  FewBlock fb;
  const int words = K * bits / 32, groups = K / gs;  // (bits: the kernel's, 4 or 8)
  fb.nv = std::min(16, N - n0);
  if (il) {
    // read in place, converted per group by the kernel (a decoding pass here wrote 2 x 16
    // x groups floats per block; Quant::rows was 15% of a 1B decode step's samples in a
    // perf profile, with the in-kernel conversion decode went 25 -> 33 tok/s)
    fb.sil = static_cast<const char*>(S.s) + int64_t{n0} * S.s_row_bytes();
    fb.bil = static_cast<const char*>(S.b) + int64_t{n0} * S.b_row_bytes();
    fb.fmt = S.fmt;
    fb.sb = S.sb;
  } else {
    fb.s = sbuf;
    fb.b = sbuf + static_cast<int64_t>(groups) * 16;
    const char* rs[16];
    const char* rb[16];
    const float *ds, *db;  // the block's rows' scales and biases as float32
    S.rows(n0, fb.nv, scale_tmp(16, groups), ds, db);
    const char* wrows = S.weights(wq, n0, fb.nv, K, wtmp);  // (5-/6-bit rows unpacked into wtmp)
    for (int j = 0; j < 16; ++j) {
      const int64_t r = n0 + std::min(j, fb.nv - 1);
      fb.rw[j] = wrows + (r - n0) * words * 4;
      rs[j] = reinterpret_cast<const char*>(ds + (r - n0) * groups);
      rb[j] = reinterpret_cast<const char*>(db + (r - n0) * groups);
    }
    float* bbuf = sbuf + static_cast<int64_t>(groups) * 16;
    int g = 0;
    for (; g + 4 <= groups; g += 4) {
      __m512i t[4];
      transpose16x4(rs, 4 * g, t);
      for (int i = 0; i < 4; ++i) _mm512_store_si512(sbuf + (g + i) * 16, t[i]);
      transpose16x4(rb, 4 * g, t);
      for (int i = 0; i < 4; ++i) _mm512_store_si512(bbuf + (g + i) * 16, t[i]);
    }
    for (; g < groups; ++g)
      for (int j = 0; j < 16; ++j) {
        sbuf[g * 16 + j] = reinterpret_cast<const float*>(rs[j])[g];
        bbuf[g * 16 + j] = reinterpret_cast<const float*>(rb[j])[g];
      }
  }
  // The next block's scales and biases (with float32 parameters a third of the bytes of
  // 4-bit weights in groups of 32), now: read at the start of that block, before its words.
  // (interleaved scales: two blocks ahead, their loads at a block's start stalled on DRAM)
  const int ahead = il ? 64 : 16;
  S.prefetch(n0 + ahead, std::max(0, std::min(16, N - n0 - ahead)));
  const int64_t row_bytes = S.stored_row_bytes(K), blk_bytes = 16 * row_bytes;
  fb.next = S.stored_row(wq, n0 + 16 * FEW_PF_AHEAD, K);
  fb.next_bytes = std::min(blk_bytes, std::max<int64_t>(0, int64_t{N - n0 - 16 * FEW_PF_AHEAD} * row_bytes));
  fb.pf_step = ((fb.next_bytes + 63) / 64 + K / 32 - 1) / (K / 32) * 64;
  return fb;
}

// This thread's buffer for a block's transposed scales and biases: [2][groups][16] floats.
inline float* few_sbuf(int groups) {
  thread_local std::vector<float> sb;
  const size_t need = static_cast<size_t>(2 * groups * 16 + 16);  // + 16: alignment
  if (sb.size() < need) sb.resize(need);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sb.data()) + 63) & ~uintptr_t{63});
}

// Into L2 (_MM_HINT_T1), not L1: a block's 16 rows of K = 2048 are 16 KB at 4 bits, so
// the next block's rows prefetched into a 32 KB L1 evicted the current block's before
// they were read. Measured (1B shape, batch-1 decode with 8-bit activations, 2-core Zen 4):
// Q4_0 17.7 -> 23.0 tok/s, Q4_K_M 15.4 -> 18.9 (AVX-512 build), Q4_0 13.4 -> 16.3 (AVX2
// build); the float32 few-row path, bound by its FMAs, is unchanged (~10 tok/s).
inline void prefetch_slice(const FewBlock& fb, int k0) {
  for (int64_t o = (k0 / 32) * fb.pf_step, e = std::min(fb.next_bytes, o + fb.pf_step); o < e; o += 64)
    _mm_prefetch(fb.next + o, _MM_HINT_T1);
}

// NB adjacent 16-feature blocks from n0 at once (blocks past N are skipped by the caller):
// each output's sum is one chain of dependent FMAs (the fixed order), so one or two rows
// alone wait on the FMA latency (measured: 1 row took ~as long as 4); NB blocks give NB x MR
// independent chains with the same per-output arithmetic.
template <int BITS, int MR, int NB, bool FE>
inline void qgemm_few_block(const float* x, int K, const uint32_t* wq, const Quant& S, int gs, float* y, int N, int n0, float* sbuf) {
  const int groups = K / gs;
  FewBlock fb[NB];
  for (int t = 0; t < NB; ++t)
    fb[t] = few_block(K, wq, S, gs, BITS, N, n0 + 16 * t, sbuf + t * (2 * groups * 16 + 16),
                      S.unpacks() ? weight_tmp(int64_t{16} * K, t) : nullptr);
  // the next NB blocks' packed rows (contiguous), a slice per 32-k step (each few_block
  // prefetches only the block after its own, which is inside this group for t < NB - 1)
  const char* next = S.stored_row(wq, n0 + 16 * NB, K);
  const int64_t next_bytes = std::max(0, std::min(16 * NB, N - n0 - 16 * NB)) * S.stored_row_bytes(K);
  const int64_t slice = ((next_bytes + 63) / 64 + K / 32 - 1) / (K / 32) * 64;
  const __m512i low = _mm512_set1_epi32(BITS == 4 ? 15 : 255);
  __m512 acc[NB][MR];
  for (int t = 0; t < NB; ++t)
    for (int m = 0; m < MR; ++m) acc[t][m] = _mm512_setzero_ps();
  for (int k0 = 0; k0 < K; k0 += 32) {
    for (int64_t o = (k0 / 32) * slice, e = std::min(next_bytes, o + slice); o < e; o += 64)
      _mm_prefetch(next + o, _MM_HINT_T1);
    const int64_t off = static_cast<int64_t>(k0) * BITS / 8;  // bytes into each row
    for (int h = 0; h < (BITS == 4 ? 1 : 2); ++h) {
      // this half's group (8-bit weights may come in groups of 16: a GGUF's Q6_K widened)
      const int gi = (k0 + 16 * h) / gs;
      __m512 s[NB], c[NB];
      for (int t = 0; t < NB; ++t) {
        const float* st = sbuf + t * (2 * groups * 16 + 16);
        s[t] = _mm512_load_ps(st + gi * 16);
        c[t] = _mm512_load_ps(st + (groups + gi) * 16);
      }
      __m512i wv[NB][4];
      for (int t = 0; t < NB; ++t) transpose16x4(fb[t].rw, off + 16 * h, wv[t]);
      // 4-bit split order: the low nibble of each byte (even k) for the block's 16 bytes,
      // then the high nibbles (odd k); byte b of word i holds k0 + 8i + 2b and + 1.
#pragma GCC unroll 2
      for (int half = 0; half < (BITS == 4 ? 2 : 1); ++half)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
          for (int b = 0; b < 4; ++b) {
            const int k = BITS == 4 ? k0 + 8 * i + 2 * b + half : k0 + 16 * h + 4 * i + b;
            const int sh = BITS == 4 ? 8 * b + 4 * half : 8 * b;
            for (int t = 0; t < NB; ++t) {
              const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(wv[t][i], sh), low));
              const __m512 w = deq_affine<FE>(s[t], q, c[t]);
              for (int m = 0; m < MR; ++m)
                acc[t][m] = _mm512_fmadd_ps(_mm512_set1_ps(x[static_cast<int64_t>(m) * K + k]), w, acc[t][m]);
            }
          }
    }
  }
  for (int t = 0; t < NB; ++t) {
    const __mmask16 keep = static_cast<__mmask16>((1u << fb[t].nv) - 1);
    for (int m = 0; m < MR; ++m)
      _mm512_mask_storeu_ps(y + static_cast<int64_t>(m) * N + n0 + 16 * t, keep, acc[t][m]);
  }
}

template <int BITS, int MR, bool FE>
inline void qgemm_few_rows(const float* x, int K, const uint32_t* wq, const Quant& S, int gs, float* y, int N, int b0, int b1, float* sbuf) {
  // independent FMA chains for few rows (8-bit weights: the head, bound by memory; more
  // blocks there only add register pressure)
  constexpr int NB = BITS == 8 ? (MR == 1 ? 2 : 1) : MR == 1 ? 4 : MR == 2 ? 2 : 1;
  int bl = b0;
  for (; bl + NB <= b1; bl += NB) qgemm_few_block<BITS, MR, NB, FE>(x, K, wq, S, gs, y, N, 16 * bl, sbuf);
  for (; bl < b1; ++bl) qgemm_few_block<BITS, MR, 1, FE>(x, K, wq, S, gs, y, N, 16 * bl, sbuf);
}

template <int BITS>
void qgemm_few(const float* x, int M, int K, const uint32_t* wq, const Quant& S, int gs, float* y, int N) {
  const int blocks = (N + 15) / 16;
  // ~2304 weights of K per chunk (several chunks per thread, for balance), rounded up to
  // whole groups of the blocks qgemm_few_rows runs at once (4 at 1 row, 2 at 2 rows)
  const int nb = M == 1 ? (BITS == 8 ? 2 : 4) : M == 2 ? 2 : 1;
  const int per = stream_chunk(blocks, std::max(1, 4 * 576 / std::max(K, 1)), nb);
  pool().run((blocks + per - 1) / per, [&](int c) {
    // this thread's buffers for up to 4 blocks' transposed scales and biases
    thread_local std::vector<float> sb;
    const size_t need = static_cast<size_t>(4 * (2 * (K / gs) * 16 + 16) + 16);
    if (sb.size() < need) sb.resize(need);
    float* sbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sb.data()) + 63) & ~uintptr_t{63});
    const int b0 = c * per, b1 = std::min(blocks, (c + 1) * per);
    with_rows<QG_FEW>(M, [&](auto mr) {
      with_flag(S.fma_exact(), [&](auto fe) {
        qgemm_few_rows<BITS, decltype(mr)::value, decltype(fe)::value>(x, K, wq, S, gs, y, N, b0, b1, sbuf);
      });
    });
  });
}
#endif

#if defined(__AVX2__)
// 8-lane helpers shared by the AVX2 few-row paths of qgemm and qmm_a8 (the latter also runs
// on AVX-512 builds without VNNI).
// Four consecutive 32-bit values of 8 rows (row j at rp[j] + off bytes) -> out[i]: value i
// of rows 0..7, one per lane (lane L of z[j] holds rows j and j + 4; a 4x4 transpose per
// 128-bit lane).
inline void transpose8x4(const char* const* rp, int64_t off, __m256i out[4]) {
  __m256i z[4];
  for (int j = 0; j < 4; ++j) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[j] + off));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[j + 4] + off));
    z[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
  }
  const __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2);
  out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3);
  out[3] = _mm256_unpackhi_epi64(t1, t3);
}

// The weight rows of the 8-feature block at n0 (rows past N repeat the last one: computed,
// never stored) as byte pointers, their scales and biases transposed into sbuf[g][8] and
// sbuf[groups + g][8]. Returns the block's number of real features. (The rows layout's:
// qmm_a8's interleaved blocks are read in place, with no setup.)
inline int few8_setup(int K, const uint32_t* wq, const Quant& S, int gs,
                      int bits, int N, int n0, const char** rw, float* sbuf, uint8_t* wtmp = nullptr) {
  const int words = K * bits / 32, groups = K / gs, nv = std::min(8, N - n0);
  const char* rs[8];
  const char* rb[8];
  const float *ds, *db;  // the block's rows' scales and biases as float32 (decoded if stored otherwise)
  S.rows(n0, nv, scale_tmp(8, groups), ds, db);
  const char* wrows = S.weights(wq, n0, nv, K, wtmp);  // (5-/6-bit rows unpacked into wtmp)
  for (int j = 0; j < 8; ++j) {
    const int64_t r = n0 + std::min(j, nv - 1);
    rw[j] = wrows + (r - n0) * words * 4;
    rs[j] = reinterpret_cast<const char*>(ds + (r - n0) * groups);
    rb[j] = reinterpret_cast<const char*>(db + (r - n0) * groups);
  }
  float* bbuf = sbuf + static_cast<int64_t>(groups) * 8;
  int g = 0;
  for (; g + 4 <= groups; g += 4) {
    __m256i t[4];
    transpose8x4(rs, 4 * g, t);
    for (int i = 0; i < 4; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(sbuf + (g + i) * 8), t[i]);
    transpose8x4(rb, 4 * g, t);
    for (int i = 0; i < 4; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(bbuf + (g + i) * 8), t[i]);
  }
  for (; g < groups; ++g)
    for (int j = 0; j < 8; ++j) {
      sbuf[g * 8 + j] = reinterpret_cast<const float*>(rs[j])[g];
      bbuf[g * 8 + j] = reinterpret_cast<const float*>(rb[j])[g];
    }
  return nv;
}

#endif

#if defined(FX_AVX2)
// The few-row path on AVX2 (+ FMA): the AVX-512 path above at half width. Vectors run along
// 8 output features (one ymm); 8 weight rows' packed words are transposed in registers and
// dequantized there, against a broadcast activation, 8 rows per pass (8 accumulators +
// the weight, its scale and bias and the broadcast fit the 16 ymm registers; more rows
// take further passes over each chunk of weights while it is in cache: on AVX2 builds
// this path runs every row count). The arithmetic per output is qgemm's tiles' exactly
// (with fma() an FMA): w = scale * q + bias rounded as in dequant_row, acc = fma(x, w,
// acc) over k in the 4-bit split order from +0, so it gives the AVX-512 build's bits at
// every row count (tested on an x86-64-v3 build).
constexpr int QG_PASS = 8;  // rows per pass over the weights

// The few-row path's view of one chunk of 8-feature blocks, set up once for all its passes
// over the rows (`few8_setup`: each block's scales and biases transposed, its 5-/6-bit rows
// unpacked): the rows' pointers rw[t][8], the transposed sbuf of block t at
// sbuf + t * 16 * groups, and each block's number of real features.
struct Few8Chunk {
  const char* (*rw)[8];
  float* sbuf;
  const int* nv;
  int b0;  // the chunk's first block
};

// NB adjacent 8-feature blocks from block bl (all inside N's blocks) for MR rows of x (row
// stride K). Several blocks at once for few rows: each output's sum is one chain of
// dependent FMAs (the fixed order), so one row alone would wait on the FMA latency; NB
// blocks give NB x MR independent chains with the same per-output arithmetic.
template <int BITS, int MR, int NB, bool FE>
inline void qgemm_few8_blocks(const float* x, int K, const uint32_t* wq, const Quant& S, int gs, float* y, int N,
                              int bl, const Few8Chunk& ch) {
  const int groups = K / gs, n0 = 8 * bl, first = bl - ch.b0;
  const char* const* rw[NB];
  const float* sb[NB];
  for (int t = 0; t < NB; ++t) {
    rw[t] = ch.rw[first + t];
    sb[t] = ch.sbuf + static_cast<int64_t>(first + t) * 16 * groups;
  }
  // The next NB blocks' packed rows (contiguous) are prefetched a slice per 32-k step, and
  // their scales and biases now: interleaved row streams defeat the hardware prefetchers.
  const int64_t next_rows = std::max(0, std::min(8 * NB, N - n0 - 8 * NB));
  const char* next = S.stored_row(wq, n0 + 8 * NB, K);
  const int64_t next_bytes = next_rows * S.stored_row_bytes(K), slice = ((next_bytes + 63) / 64 + K / 32 - 1) / (K / 32) * 64;
  const __m256i low = _mm256_set1_epi32(BITS == 4 ? 15 : 255);
  __m256 acc[NB][MR];
  for (int t = 0; t < NB; ++t)
    for (int m = 0; m < MR; ++m) acc[t][m] = _mm256_setzero_ps();
  for (int k0 = 0; k0 < K; k0 += 32) {
    for (int64_t o = (k0 / 32) * slice, e = std::min(next_bytes, o + slice); o < e; o += 64)
      _mm_prefetch(next + o, _MM_HINT_T1);
    const int64_t off = static_cast<int64_t>(k0) * BITS / 8;  // bytes into each row
    // the 32 k of this step per block: 4-bit: one transpose, then the even k (low
    // nibbles), then the odd ones (the split order, as the AVX-512 path); 8-bit: two
    __m256i wv[NB][4];
    for (int h = 0; h < (BITS == 4 ? 1 : 2); ++h) {
      const int gi = (k0 + 16 * h) / gs;  // 8-bit weights may come in groups of 16
      for (int t = 0; t < NB; ++t) transpose8x4(rw[t], off + 16 * h, wv[t]);
#pragma GCC unroll 2
      for (int half = 0; half < (BITS == 4 ? 2 : 1); ++half)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
          for (int b = 0; b < 4; ++b) {
            const int k = BITS == 4 ? k0 + 8 * i + 2 * b + half : k0 + 16 * h + 4 * i + b;
            const int sh = BITS == 4 ? 8 * b + 4 * half : 8 * b;
            for (int t = 0; t < NB; ++t) {
              const float* st = sb[t] + gi * 8;
              const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(wv[t][i], sh), low));
              const __m256 w = deq_affine<FE>(_mm256_load_ps(st), q, _mm256_load_ps(st + 8 * groups));
              for (int m = 0; m < MR; ++m)
                acc[t][m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + static_cast<int64_t>(m) * K + k),
                                            w, acc[t][m]);
            }
          }
    }
  }
  alignas(32) static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  for (int t = 0; t < NB; ++t) {
    const __m256i keep = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 8 - ch.nv[first + t]));
    for (int m = 0; m < MR; ++m)
      _mm256_maskstore_ps(y + static_cast<int64_t>(m) * N + n0 + 8 * t, keep, acc[t][m]);
  }
}

// setup(bl, n): blocks [bl, bl + n) made ready in the chunk just before they run (one pass
// over the rows), or nothing (every block set up before the first of several passes).
template <int BITS, int MR, bool FE, class Setup>
inline void qgemm_few8_rows(const float* x, int K, const uint32_t* wq, const Quant& S, int gs, float* y, int N,
                            int b0, int b1, const Few8Chunk& ch, Setup&& setup) {
  constexpr int NB = MR <= 2 ? 2 : 1;  // independent FMA chains for one or two rows
  int bl = b0;
  for (; bl + NB <= b1; bl += NB) {
    setup(bl, NB);
    qgemm_few8_blocks<BITS, MR, NB, FE>(x, K, wq, S, gs, y, N, bl, ch);
  }
  for (; bl < b1; ++bl) {
    setup(bl, 1);
    qgemm_few8_blocks<BITS, MR, 1, FE>(x, K, wq, S, gs, y, N, bl, ch);
  }
}

template <int BITS>
void qgemm_few(const float* x, int M, int K, const uint32_t* wq, const Quant& S, int gs, float* y, int N) {
  const int blocks = (N + 7) / 8, groups = K / gs;
  const int per = 2 * std::max(1, 4 * 576 / std::max(K, 1));  // an even number of blocks
  pool().run((blocks + per - 1) / per, [&](int c) {
    const int b0 = c * per, b1 = std::min(blocks, (c + 1) * per), nb = b1 - b0;
    // Several passes of 8 rows: the chunk's blocks are set up once (their scales
    // transposed, 5-/6-bit rows unpacked: per pass, that cost up to 35% at 64 rows), then
    // every pass runs on them. One pass: each block just before it runs (while its
    // scales are in cache; setting the whole chunk up first measured a few % slower).
    thread_local std::vector<float> sb;
    thread_local std::vector<const char*> ptrs;
    thread_local std::vector<int> counts;
    const size_t need = static_cast<size_t>(nb) * 16 * groups + 8;  // + 8: alignment
    if (sb.size() < need) sb.resize(need);
    if (ptrs.size() < static_cast<size_t>(8 * nb)) ptrs.resize(static_cast<size_t>(8 * nb));
    if (counts.size() < static_cast<size_t>(nb)) counts.resize(static_cast<size_t>(nb));
    float* sbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sb.data()) + 31) & ~uintptr_t{31});
    auto* rw = reinterpret_cast<const char* (*)[8]>(ptrs.data());
    uint8_t* unpacked = S.unpacks() ? weight_tmp(int64_t{8} * K * nb) : nullptr;
    auto setup = [&](int bl, int n) {
      for (int t = bl - b0; t < bl - b0 + n; ++t)
        counts[t] = few8_setup(K, wq, S, gs, BITS, N, 8 * (b0 + t), rw[t], sbuf + static_cast<int64_t>(t) * 16 * groups,
                               unpacked ? unpacked + int64_t{8} * K * t : nullptr);
      S.prefetch(8 * (bl + n), std::min(8 * n, N - 8 * (bl + n)));  // the next blocks' scales
    };
    const bool once = M > QG_PASS;
    if (once) setup(b0, nb);
    const Few8Chunk ch{rw, sbuf, counts.data(), b0};
    for (int m0 = 0; m0 < M; m0 += QG_PASS) {
      const float* xm = x + static_cast<int64_t>(m0) * K;
      float* ym = y + static_cast<int64_t>(m0) * N;
      with_rows<QG_PASS>(std::min(QG_PASS, M - m0), [&](auto mr) {
        with_flag(S.fma_exact(), [&](auto fe) {
          qgemm_few8_rows<BITS, decltype(mr)::value, decltype(fe)::value>(xm, K, wq, S, gs, ym, N, b0, b1, ch,
                                                                          [&](int bl, int n) {
            if (!once) setup(bl, n);
          });
        });
      });
    }
  });
}
#endif

void qgemm_cpu(const float* x, int M, int K, const uint32_t* wq, const Quant& S, int gs, int bits, float* y, int N) {
#if defined(__AVX512F__) || defined(FX_AVX2)
#if defined(FX_AVX2)
  // Every row count, in passes of 8 rows: the AVX2 build's register tiles spill (v16 is two
  // ymm), and the passes give their bits at ~3-4x their speed (measured: 3072 x 576 at 64
  // rows 7.1 -> ~2 ms), so the tiles below serve the generic build only.
  constexpr int few_max = 1 << 30;
#else
  constexpr int few_max = QG_FEW;
#endif
  if (M > 0 && M <= few_max)
    return with_bits(bits, [&](auto b) { qgemm_few<decltype(b)::value>(x, M, K, wq, S, gs, y, N); });
#endif
  const int tiles = (M + QG_ROWS - 1) / QG_ROWS;
  // Uninitialized (pack_cols writes every element): a zeroing vector would memset it.
  // 64-byte aligned: each tile row of 32 floats is two whole cache lines.
  struct Free { void operator()(float* p) const { ::operator delete[](p, std::align_val_t{64}); } };
  std::unique_ptr<float[], Free> xt(static_cast<float*>(::operator new[](
      sizeof(float) * static_cast<size_t>(tiles) * K * QG_ROWS, std::align_val_t{64})));
  pack_cols(x, M, K, bits == 4, xt.get());
  const int groups = K / gs;
  const int blocks = (N + QG_FEAT - 1) / QG_FEAT;
  // Parallel over output features (each y[m, n] computed by one thread): a chunk is a
  // few feature blocks, each dequantized once into a thread-local buffer and then run
  // against every row tile.
  const int per = std::max(1, 4 * 576 / std::max(K, 1));
  pool().run((blocks + per - 1) / per, [&](int c) {
    thread_local std::vector<float> buf;
    if (static_cast<int>(buf.size()) < QG_FEAT * K) buf.resize(static_cast<size_t>(QG_FEAT) * K);
    alignas(64) float out[QG_FEAT * QG_ROWS];
    const int b1 = std::min(blocks, (c + 1) * per);
    float* tmp = scale_tmp(QG_FEAT, groups);
    uint8_t* wt = S.unpacks() ? weight_tmp(K) : nullptr;
    for (int bl = c * per; bl < b1; ++bl) {
      const int n0 = bl * QG_FEAT, nw = std::min(QG_FEAT, N - n0);
      const float *ds, *db;
      S.rows(n0, nw, tmp, ds, db);
      for (int j = 0; j < nw; ++j) {
        const int64_t r = n0 + j;
        float* o = buf.data() + static_cast<int64_t>(j) * K;
        const uint32_t* row = reinterpret_cast<const uint32_t*>(S.weights(wq, r, 1, K, wt));
        if (bits == 4)
          dequant_row<4>(row, ds + j * groups, db + j * groups, K, gs, o);
        else  // 8 bits, and 5/6 unpacked to bytes
          dequant_row<8>(row, ds + j * groups, db + j * groups, K, gs, o);
      }
      for (int t = 0; t < tiles; ++t) {
        const int m0 = t * QG_ROWS, mc = std::min(QG_ROWS, M - m0);
        qgemm_tile_any(nw, (mc + VL - 1) / VL, xt.get() + static_cast<int64_t>(t) * K * QG_ROWS,
                       buf.data(), K, out);
        for (int i = 0; i < mc; ++i) {
          float* yr = y + static_cast<int64_t>(m0 + i) * N + n0;
          for (int j = 0; j < nw; ++j) yr[j] = out[j * QG_ROWS + i];
        }
      }
    }
  });
}
