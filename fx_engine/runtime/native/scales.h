// Part of fx-engine's native kernels: how a quantized product's group scales and biases are
// stored, and their float32 values, decoded a row at a time where the kernels use them.
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
};

// One super-block of the two-level form: sb groups' codes c and the factors (d, e) -> s =
// d * a, b = -(e * c) = (-e) * c (the same float: negation is exact). Written so the
// compiler vectorizes it (the codes' bytes sign-extended, one multiply each).
inline void decode_kq_block(const int16_t* c, const uint16_t* f, int sb, float* so, float* bo) {
  const float d = half_to_float(f[0]), e = -half_to_float(f[1]);
  for (int g = 0; g < sb; ++g) {
    so[g] = d * static_cast<float>(static_cast<int8_t>(c[g] & 0xFF));
    bo[g] = e * static_cast<float>(static_cast<int16_t>(c[g] >> 8));
  }
}

// `blocks` super-blocks of sb groups each (codes c, factors f: (d, e) per super-block).
// With AVX2 (and AVX-512 builds), 8 groups per step: the codes sign-extended to int32,
// their low and high bytes sign-extended in place, converted, times the broadcast factor
// (sb is a multiple of 8 for every K-quant: 8 or 16); elsewhere the scalar blocks. The
// same floats either way (one exact conversion, one rounding multiply).
inline void decode_kq(const int16_t* c, const uint16_t* f, int64_t blocks, int sb, float* so, float* bo) {
#if defined(__AVX2__)
  if (sb % 8 == 0) {
    thread_local std::vector<float> fac;
    if (static_cast<int64_t>(fac.size()) < 2 * blocks) fac.resize(2 * blocks);
    halves_to_floats(f, static_cast<int>(2 * blocks), fac.data());
    for (int64_t u = 0; u < blocks; ++u) {
      const __m256 d = _mm256_set1_ps(fac[2 * u]), e = _mm256_set1_ps(-fac[2 * u + 1]);
      for (int64_t g = u * sb; g < (u + 1) * sb; g += 8) {
        const __m256i v = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + g)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 8));
        _mm256_storeu_ps(so + g, _mm256_mul_ps(d, lo));
        _mm256_storeu_ps(bo + g, _mm256_mul_ps(e, hi));
      }
    }
    return;
  }
#endif
  for (int64_t u = 0; u < blocks; ++u) decode_kq_block(c + u * sb, f + 2 * u, sb, so + u * sb, bo + u * sb);
}

struct Scales {
  const void* s;
  const void* b;
  int fmt;
  int groups;  // G: groups per row
  int sb;      // SF_KQ: groups per super-block (S)

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
    } else if (fmt == SF_BF16) {
      const uint16_t* ps = static_cast<const uint16_t*>(s) + r0 * G;
      const uint16_t* pb = static_cast<const uint16_t*>(b) + r0 * G;
      for (int64_t i = 0; i < cnt; ++i) {
        ts[i] = bf16_to_float(ps[i]);
        tb[i] = bf16_to_float(pb[i]);
      }
    } else {  // SF_KQ: n rows of G / sb super-blocks (sb 8: groups of 32; 16: of 16)
      const int16_t* codes = static_cast<const int16_t*>(s) + r0 * G;
      const uint16_t* fac = static_cast<const uint16_t*>(b) + r0 * 2 * (G / sb);
      decode_kq(codes, fac, cnt / sb, sb, ts, tb);
    }
    so = ts;
    bo = tb;
  }

  // Bytes of one row's scales and of its biases (for prefetching the next block's).
  inline int64_t s_row_bytes() const { return fmt == SF_F32 ? 4 * int64_t{groups} : 2 * int64_t{groups}; }
  inline int64_t b_row_bytes() const {
    return fmt == SF_F32 ? 4 * int64_t{groups} : fmt == SF_KQ ? 4 * int64_t{groups / sb} : 2 * int64_t{groups};
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
