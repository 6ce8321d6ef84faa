// Part of fx-engine's native kernels: how a quantized product's weights and group scales
// and biases are stored (`Quant`), and what the kernels run: float32 scales and biases,
// decoded a row at a time where the kernels use them, and 4- or 8-bit weight rows (5- and
// 6-bit rows unpacked to bytes a block of rows at a time).
// Not a standalone header: kernels.cpp includes the kernel families in order, inside its
// anonymous namespace, as one translation unit (one compile, everything inlinable).
//
// Every format decodes to float32 scales s[n, g] and biases b[n, g] (w = s * q + b) that
// are exactly the values the float32 format would hold, so a product gives the same bits
// whatever the storage: the formats trade memory (and the bytes a decode step streams), not
// numerics. Decoding happens per row (or per block of 16 / 8 rows, next to the weight rows
// that use them): a whole-matrix float32 copy per call would add more memory traffic than
// the compact storage saves.
#pragma once

// IEEE half (as its 16 bits) -> float, exact (also the portable path of load_kv).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: man * 2^-24, renormalized
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400u));
      bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float -> float16 bits, rounded to nearest even, as MLX's CPU astype writes them (the fused
// cache writes store what an astype then a put stored): infinity past the largest half,
// subnormal halves below 2^-14 (rounded by one float addition of a magic number), and
// NaN as MLX's 0x7d00 with the sign.
inline uint16_t float_to_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u >= 0x47800000u)  // >= 65536 (every such float rounds past the largest half), inf, NaN
    return static_cast<uint16_t>(sign | (u > 0x7f800000u ? 0x7d00u : 0x7c00u));
  if (u < 0x38800000u) {  // below 2^-14: adding 0.5 leaves the rounded half's bits at the bottom
    const uint32_t magic = 126u << 23;  // 0.5: its ulp is 2^-24, the subnormal half's unit
    float a, m;
    std::memcpy(&a, &u, 4);
    std::memcpy(&m, &magic, 4);
    const float r = a + m;
    uint32_t rb;
    std::memcpy(&rb, &r, 4);
    return static_cast<uint16_t>(sign | (rb - magic));
  }
  const uint32_t odd = (u >> 13) & 1u;  // ties to even
  return static_cast<uint16_t>(sign | ((u + 0xc8000fffu + odd) >> 13));  // rebias 127 -> 15, round
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// n halves -> floats (F16C where the build has it: exact, as half_to_float).
inline void halves_to_floats(const uint16_t* p, int n, float* out) {
  int i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
  for (; i < n; ++i) out[i] = half_to_float(p[i]);
}

// The storage formats (`fmt`, chosen from the arrays' dtypes by the op, see kernels.cpp):
enum ScaleFmt : int {
  SF_F32 = 0,   // float32 scales and biases [N, G]
  SF_F16 = 1,   // float16 [N, G]: exact wherever every value is a half (GGUF's Q4_0..Q8_0,
                // MLX checkpoints' own float16 scales)
  SF_BF16 = 2,  // bfloat16 [N, G] (MLX checkpoints' bfloat16 scales)
  // Two levels, as GGUF's K-quant super-blocks store them: scales int16 [N, G], the low
  // byte a signed 8-bit scale code a, the high byte a signed 8-bit bias code c; biases
  // float16 [N, G / S, 2], per super-block of S groups the factors (d, e):
  // s = d * a, b = -(e * c), both exact in float32 (11 + 8 significant bits). Q4_K/Q5_K:
  // (d, dmin) and (sc, m) as stored; Q6_K: (d, 32 d) and (sc, sc); Q3_K: (d, 4 d) and
  // (sc - 32, sc - 32); Q2_K: (d, dmin) and (sc, m). 0.625 bits per weight in groups of
  // 32 (Q4_K's file: 0.5), where float32 scales and biases take 2.
  SF_KQ = 3,
  // float16 scales [N, G] whose biases are a fixed multiple of them, b = m * s (GGUF's
  // Q4_0 / Q5_0 / Q8_0: w = d (q - 2^(bits-1)), so m = -2^(bits-1)): the biases input is
  // that one float32 m ([1]), so a product streams 2 bytes of parameters a group, not 4
  // (a Q4_0 matrix's bytes: 20 -> 18 a group of 32, the file's). The caller has checked
  // that m * s, rounded to float32, equals every stored bias (nn.implied_bias): the same
  // floats as SF_F16 with the biases read.
  SF_F16M = 4,
  // SF_KQ where every group's bias code equals its scale code (GGUF's Q6_K: (sc, sc); Q3_K:
  // (sc - 32, sc - 32)): scales int8 [N, G], the one code a, biases SF_KQ's float16 factors
  // [N, G / S, 2]: s = d * a, b = -(e * a), the same floats. 1 byte of codes a group, not 2
  // (a Q6_K matrix: 6.625 bits a weight, not 7.125; the file's are 6.5625).
  SF_KQ1 = 5,
};
inline bool two_level_fmt(int fmt) { return fmt == SF_KQ || fmt == SF_KQ1; }

// The two-level form's decode, one helper per width: code c (int16: a signed scale code a
// in the low byte, a signed bias code in the high one) and the factors d and ne = -e ->
// s = d * a, b = ne * c = -(e * c) (the same float: negation is exact). Every copy of that
// arithmetic runs through these: decode_kq_block / decode_kq below, qmm_a8.h's
// il_scales16 / il_scales8 / il_scale_block. Each caller negates e as it always has (the
// in-kernel readers il_scales16 / il_scales8 as 0 - e: the same float but for a zero e,
// +0 for -0, which no qmm_a8 sum can tell apart: its accumulators start at +0). Python's
// copy is fx_engine.core.nn.group_params (the MLX fallbacks' view): the same floats.
inline void kq_decode(int16_t c, float d, float ne, float& s, float& b) {
  s = d * static_cast<float>(static_cast<int8_t>(c & 0xFF));
  b = ne * static_cast<float>(static_cast<int16_t>(c >> 8));
}
#if defined(__AVX2__)
// 8 codes at c (sign-extended to int32, their low and high bytes sign-extended in place,
// converted: exact), times the factors' vectors (one rounding multiply each).
inline void kq_decode8(const int16_t* c, __m256 d, __m256 ne, __m256& s, __m256& b) {
  const __m256i v = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24)));
  b = _mm256_mul_ps(ne, _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 8)));
}
#endif
#if defined(__AVX512F__)
// 16 codes at c: kq_decode8 at 16 lanes.
inline void kq_decode16(const int16_t* c, __m512 d, __m512 ne, __m512& s, __m512& b) {
  const __m512i v = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
  s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24)));
  b = _mm512_mul_ps(ne, _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 8)));
}
#endif

// SF_KQ1's decode (one int8 code a for both): s = d * a, b = ne * a, kq_decode's floats
// for c = a, one helper per width.
inline void kq1_decode(int8_t a, float d, float ne, float& s, float& b) {
  s = d * static_cast<float>(a);
  b = ne * static_cast<float>(a);
}
#if defined(__AVX2__)
inline void kq1_decode8(const int8_t* c, __m256 d, __m256 ne, __m256& s, __m256& b) {
  const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
  s = _mm256_mul_ps(d, a);
  b = _mm256_mul_ps(ne, a);
}
#endif
#if defined(__AVX512F__)
inline void kq1_decode16(const int8_t* c, __m512 d, __m512 ne, __m512& s, __m512& b) {
  const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
  s = _mm512_mul_ps(d, a);
  b = _mm512_mul_ps(ne, a);
}
#endif

// One super-block of the two-level form: sb groups' codes c and the factors (d, e).
// Written so the compiler vectorizes it (the codes' bytes sign-extended, one multiply each).
inline void decode_kq_block(const int16_t* c, const uint16_t* f, int sb, float* so, float* bo) {
  const float d = half_to_float(f[0]), e = -half_to_float(f[1]);
  for (int g = 0; g < sb; ++g) kq_decode(c[g], d, e, so[g], bo[g]);
}

// `blocks` super-blocks of sb groups each (codes c, factors f: (d, e) per super-block).
// With AVX2 (and AVX-512 builds), 8 groups per step (kq_decode8: sb is a multiple of 8 for
// every K-quant: 8 or 16); elsewhere the scalar blocks. The same floats either way.
inline void decode_kq(const int16_t* c, const uint16_t* f, int64_t blocks, int sb, float* so, float* bo) {
#if defined(__AVX2__)
  if (sb % 8 == 0) {
    thread_local std::vector<float> fac;
    if (static_cast<int64_t>(fac.size()) < 2 * blocks) fac.resize(2 * blocks);
    halves_to_floats(f, static_cast<int>(2 * blocks), fac.data());
    for (int64_t u = 0; u < blocks; ++u) {
      const __m256 d = _mm256_set1_ps(fac[2 * u]), e = _mm256_set1_ps(-fac[2 * u + 1]);
      for (int64_t g = u * sb; g < (u + 1) * sb; g += 8) {
        __m256 s, b;
        kq_decode8(c + g, d, e, s, b);
        _mm256_storeu_ps(so + g, s);
        _mm256_storeu_ps(bo + g, b);
      }
    }
    return;
  }
#endif
  for (int64_t u = 0; u < blocks; ++u) decode_kq_block(c + u * sb, f + 2 * u, sb, so + u * sb, bo + u * sb);
}

// 8 values of BITS bits (5 or 6), a little-endian bit stream (MLX's packing) -> 8 bytes.
template <int BITS>
inline uint64_t spread8(uint64_t x) {
#if defined(__BMI2__)
  return _pdep_u64(x, BITS == 6 ? 0x3F3F3F3F3F3F3F3Full : 0x1F1F1F1F1F1F1F1Full);
#else
  uint64_t out = 0;
  for (int j = 0; j < 8; ++j) out |= ((x >> (BITS * j)) & ((1u << BITS) - 1)) << (8 * j);
  return out;
#endif
}

// 8 values from their BITS bytes at p (loads inside those bytes only: the row's end).
template <int BITS>
inline uint64_t load_group(const uint8_t* p) {
  uint32_t lo;
  std::memcpy(&lo, p, 4);
  uint64_t x = lo;
  if constexpr (BITS == 6) {
    uint16_t hi;
    std::memcpy(&hi, p + 4, 2);
    x |= uint64_t{hi} << 32;
  } else {
    x |= uint64_t{p[4]} << 32;
  }
  return x;
}

// One row of K values stored in BITS (5 or 6) bits -> K bytes, element j at byte j (the
// 8-bit layout the kernels run). Every 8 values are BITS whole bytes (K is a multiple of
// 16). AVX-512 VBMI: 64 values per step (each group's bytes permuted into a qword, the
// fields picked by vpmultishiftqb); AVX2: 32 per step (bytes shuffled into dwords / qwords,
// fields moved into place by shifts and masks); then BMI2's pdep (8 per step), else a loop.
// Vector loads that could pass the row's end are left to the 8-per-step tail.
template <int BITS>
inline void unpack_row_bits(const uint8_t* src, int K, uint8_t* out) {
  constexpr uint8_t M = (1u << BITS) - 1;
  int j = 0;
#if defined(__AVX512VBMI__)
  {
    alignas(64) uint8_t idx[64], sh[64];
    for (int q = 0; q < 8; ++q)
      for (int k = 0; k < 8; ++k) {
        idx[8 * q + k] = static_cast<uint8_t>(BITS * q + k);
        sh[8 * q + k] = static_cast<uint8_t>(BITS * k);
      }
    const __m512i vi = _mm512_load_si512(idx), vs = _mm512_load_si512(sh), vm = _mm512_set1_epi8(M);
    const __mmask64 in = (__mmask64{1} << (8 * BITS)) - 1;  // the step's 8 * BITS bytes
    for (; j + 64 <= K; j += 64) {
      const __m512i v = _mm512_maskz_loadu_epi8(in, src + j / 8 * BITS);
      const __m512i q = _mm512_permutexvar_epi8(vi, v);
      _mm512_storeu_si512(out + j, _mm512_and_si512(_mm512_multishift_epi64_epi8(vs, q), vm));
    }
  }
#elif defined(__AVX2__)
  if constexpr (BITS == 6) {  // 3 bytes -> 4 values, in dwords
    const __m256i shuf = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,
                                          0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
    const __m256i m0 = _mm256_set1_epi32(0x3F), m1 = _mm256_set1_epi32(0x3F00),
                  m2 = _mm256_set1_epi32(0x3F0000), m3 = _mm256_set1_epi32(0x3F000000);
    for (; j + 32 < K; j += 32) {  // (the lane loads read 4 bytes past the step's 24)
      const uint8_t* p = src + j / 8 * 6;
      const __m256i v = _mm256_shuffle_epi8(_mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 12)), 1), shuf);
      const __m256i r = _mm256_or_si256(
          _mm256_or_si256(_mm256_and_si256(v, m0), _mm256_and_si256(_mm256_slli_epi32(v, 2), m1)),
          _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(v, 4), m2), _mm256_and_si256(_mm256_slli_epi32(v, 6), m3)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), r);
    }
  } else {  // 5 bytes -> 8 values, in qwords
    const __m256i shuf = _mm256_setr_epi8(0, 1, 2, 3, 4, -1, -1, -1, 5, 6, 7, 8, 9, -1, -1, -1,
                                          0, 1, 2, 3, 4, -1, -1, -1, 5, 6, 7, 8, 9, -1, -1, -1);
    for (; j + 32 < K; j += 32) {  // (the lane loads read 6 bytes past the step's 20)
      const uint8_t* p = src + j / 8 * 5;
      const __m256i v = _mm256_shuffle_epi8(_mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 10)), 1), shuf);
      __m256i r = _mm256_and_si256(v, _mm256_set1_epi64x(0x1F));
      r = _mm256_or_si256(r, _mm256_and_si256(_mm256_slli_epi64(v, 3), _mm256_set1_epi64x(0x1Fll << 8)));
      r = _mm256_or_si256(r, _mm256_and_si256(_mm256_slli_epi64(v, 6), _mm256_set1_epi64x(0x1Fll << 16)));
      r = _mm256_or_si256(r, _mm256_and_si256(_mm256_slli_epi64(v, 9), _mm256_set1_epi64x(0x1Fll << 24)));
      r = _mm256_or_si256(r, _mm256_and_si256(_mm256_slli_epi64(v, 12), _mm256_set1_epi64x(0x1Fll << 32)));
      r = _mm256_or_si256(r, _mm256_and_si256(_mm256_slli_epi64(v, 15), _mm256_set1_epi64x(0x1Fll << 40)));
      r = _mm256_or_si256(r, _mm256_and_si256(_mm256_slli_epi64(v, 18), _mm256_set1_epi64x(0x1Fll << 48)));
      r = _mm256_or_si256(r, _mm256_and_si256(_mm256_slli_epi64(v, 21), _mm256_set1_epi64x(0x1Fll << 56)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), r);
    }
  }
#endif
  for (; j < K; j += 8) {
    const uint64_t v = spread8<BITS>(load_group<BITS>(src + j / 8 * BITS));
    std::memcpy(out + j, &v, 8);
  }
}

inline void unpack_row(const uint8_t* src, int bits, int K, uint8_t* out) {
  if (bits == 6)
    unpack_row_bits<6>(src, K, out);
  else
    unpack_row_bits<5>(src, K, out);
}

// This thread's buffer for unpacked weight rows (`slot`: blocks in use at once).
inline uint8_t* weight_tmp(int64_t bytes, int slot = 0) {
  thread_local std::vector<uint8_t> t[4];
  if (static_cast<int64_t>(t[slot].size()) < bytes) t[slot].resize(static_cast<size_t>(bytes));
  return t[slot].data();
}

struct Quant {
  const void* s;
  const void* b;
  int fmt;
  int groups;  // G: groups per row
  int sb;      // SF_KQ: groups per super-block (S)
  int wbits;   // the width the weights are stored in: 4 or 8 (run as they are), 5 or 6

  // 5- and 6-bit rows run on the 8-bit kernels, unpacked a block of rows at a time (the
  // bytes a decode step streams stay 5/8 or 6/8 of the 8-bit form's).
  inline bool unpacks() const { return wbits == 5 || wbits == 6; }
  inline int64_t stored_row_bytes(int K) const { return int64_t{K} * wbits / 8; }
  inline const char* stored_row(const uint32_t* wq, int64_t r, int K) const {
    return reinterpret_cast<const char*>(wq) + r * stored_row_bytes(K);
  }
  // Whether scale * q is exact in float32 for every weight the kernels read (q < 2^4, or
  // a byte: 8-bit values, 5-/6-bit ones unpacked): a half scale has 11 significant bits and
  // a bfloat16 one 8, so s q has at most 19; a two-level scale d * a at most 18 (d a half,
  // |a| <= 128), so s q at most 24 with 4- to 6-bit values. Then fl(fl(s q) + b), the
  // dequantized weight, equals fma(s, q, b) (the same exact sum, rounded once): the few-row
  // kernels' FE variant dequantizes with one FMA instead of a multiply and an add, the same
  // floats. Float32 scales (24 bits) and two-level ones with 8-bit values may round s q.
  inline bool fma_exact() const {
    if (fmt == SF_F32) return false;
    return two_level_fmt(fmt) ? wbits <= 6 : true;
  }

  // Rows [r0, r0 + n) in the kernel's layout (4 or 8 bits, K * kbits / 8 bytes each,
  // contiguous): the stored rows, or unpacked into tmp [n][K].
  inline const char* weights(const uint32_t* wq, int64_t r0, int n, int K, uint8_t* tmp) const {
    if (!unpacks()) return stored_row(wq, r0, K);
    for (int j = 0; j < n; ++j)
      unpack_row(reinterpret_cast<const uint8_t*>(stored_row(wq, r0 + j, K)), wbits, K,
                 tmp + static_cast<int64_t>(j) * K);
    return reinterpret_cast<const char*>(tmp);
  }

  // Row r's scales and biases as float32: pointers into the arrays when they are float32,
  // else decoded into tmp[2 * groups].
  inline void row(int64_t r, float* tmp, const float*& so, const float*& bo) const {
    rows(r, 1, tmp, so, bo);
  }

  // Rows [r0, r0 + n) as float32 [n][groups] each (contiguous): the arrays' own rows when
  // float32, else decoded into tmp[2 * n * groups] (scales first, then biases).
  inline void rows(int64_t r0, int n, float* tmp, const float*& so, const float*& bo) const {
    const int64_t G = groups, cnt = G * n;
    if (fmt == SF_F32) {
      so = static_cast<const float*>(s) + r0 * G;
      bo = static_cast<const float*>(b) + r0 * G;
      return;
    }
    float* ts = tmp;
    float* tb = tmp + cnt;
    if (fmt == SF_F16) {
      halves_to_floats(static_cast<const uint16_t*>(s) + r0 * G, static_cast<int>(cnt), ts);
      halves_to_floats(static_cast<const uint16_t*>(b) + r0 * G, static_cast<int>(cnt), tb);
    } else if (fmt == SF_F16M) {
      halves_to_floats(static_cast<const uint16_t*>(s) + r0 * G, static_cast<int>(cnt), ts);
      const float m = *static_cast<const float*>(b);
      for (int64_t i = 0; i < cnt; ++i) tb[i] = ts[i] * m;
    } else if (fmt == SF_BF16) {
      const uint16_t* ps = static_cast<const uint16_t*>(s) + r0 * G;
      const uint16_t* pb = static_cast<const uint16_t*>(b) + r0 * G;
      for (int64_t i = 0; i < cnt; ++i) {
        ts[i] = bf16_to_float(ps[i]);
        tb[i] = bf16_to_float(pb[i]);
      }
    } else if (fmt == SF_KQ1) {  // as SF_KQ, one int8 code a group
      const int8_t* codes = static_cast<const int8_t*>(s) + r0 * G;
      const uint16_t* fac = static_cast<const uint16_t*>(b) + r0 * 2 * (G / sb);
      for (int64_t u = 0; u < cnt / sb; ++u) {
        const float d = half_to_float(fac[2 * u]), e = -half_to_float(fac[2 * u + 1]);
        for (int64_t g = u * sb; g < (u + 1) * sb; ++g) kq1_decode(codes[g], d, e, ts[g], tb[g]);
      }
    } else {  // SF_KQ: n rows of G / sb super-blocks (sb 8: groups of 32; 16: of 16)
      const int16_t* codes = static_cast<const int16_t*>(s) + r0 * G;
      const uint16_t* fac = static_cast<const uint16_t*>(b) + r0 * 2 * (G / sb);
      decode_kq(codes, fac, cnt / sb, sb, ts, tb);
    }
    so = ts;
    bo = tb;
  }

  // The same view starting at row r0 (one matrix of a stacked expert tensor [E, N, ...]:
  // r0 = e * N): rows are laid out alike in every format, so a pointer shift suffices.
  inline Quant at_row(int64_t r0) const {
    Quant q = *this;
    q.s = static_cast<const char*>(s) + r0 * s_row_bytes();
    q.b = static_cast<const char*>(b) + r0 * b_row_bytes();
    return q;
  }

  // Bytes of one row's scales and of its biases (for prefetching the next block's).
  inline int64_t s_row_bytes() const {
    return fmt == SF_F32 ? 4 * int64_t{groups} : fmt == SF_KQ1 ? int64_t{groups} : 2 * int64_t{groups};
  }
  inline int64_t b_row_bytes() const {  // (SF_F16M: 0, one multiplier for every row)
    if (fmt == SF_F16M) return 0;
    return fmt == SF_F32 ? 4 * int64_t{groups} : two_level_fmt(fmt) ? 4 * int64_t{groups / sb} : 2 * int64_t{groups};
  }
  inline void prefetch(int64_t r0, int64_t n) const {
#if defined(__x86_64__)
    const char* ps = static_cast<const char*>(s) + r0 * s_row_bytes();
    const char* pb = static_cast<const char*>(b) + r0 * b_row_bytes();
    for (int64_t o = 0; o < n * s_row_bytes(); o += 64) _mm_prefetch(ps + o, _MM_HINT_T0);
    for (int64_t o = 0; o < n * b_row_bytes(); o += 64) _mm_prefetch(pb + o, _MM_HINT_T0);
#else
    (void)r0;
    (void)n;
#endif
  }
};

// This thread's scratch for decoded scales and biases of up to `rows` rows.
inline float* scale_tmp(int rows, int groups) {
  thread_local std::vector<float> t;
  const size_t need = static_cast<size_t>(2) * rows * groups;
  if (t.size() < need) t.resize(need);
  return t.data();
}
