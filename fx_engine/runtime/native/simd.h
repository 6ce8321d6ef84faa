// Part of fx-engine's native kernels: SIMD helpers: the v16 vector type and the few primitives (FMA, broadcast, loads, horizontal sums) spelled out per ISA (AVX-512, AVX2, generic vector extensions).
// Not a standalone header: kernels.cpp includes the kernel families in order, inside its
// anonymous namespace, as one translation unit (one compile, everything inlinable).
#pragma once

constexpr int VL = 16;  // floats per vector
typedef float v16 __attribute__((vector_size(64), aligned(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned loads

// acc + a * b with one rounding where the CPU has FMA. The build uses -ffp-contract=off so
// that nothing else is fused: dequantization (scale * q + bias) then rounds exactly like
// mx.dequantize.
//
// Without AVX-512 a v16 is two AVX2 registers (x86-64-v3) or four NEON ones. GCC lowers
// the plain vector-extension arithmetic well, but not conversions or broadcasts (it
// scalarizes them through the stack: measured 8x slower decode on an AVX2 build), so the
// few primitives below are spelled out for AVX2 too, on each 8-float half.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define FX_AVX2 1
inline void halves(v16 v, __m256& lo, __m256& hi) {
  std::memcpy(&lo, &v, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + 32, 32);
}
inline v16 join(__m256 lo, __m256 hi) {
  v16 r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
}
#endif

inline v16 fma(v16 a, v16 b, v16 acc) {
#if defined(__AVX512F__)
  __m512 r = _mm512_fmadd_ps(reinterpret_cast<__m512&>(a), reinterpret_cast<__m512&>(b),
                             reinterpret_cast<__m512&>(acc));
  return reinterpret_cast<v16&>(r);
#elif defined(FX_AVX2)
  __m256 a0, a1, b0, b1, c0, c1;
  halves(a, a0, a1);
  halves(b, b0, b1);
  halves(acc, c0, c1);
  return join(_mm256_fmadd_ps(a0, b0, c0), _mm256_fmadd_ps(a1, b1, c1));
#else
  return acc + a * b;
#endif
}

// Unaligned 16-float loads and stores; on AVX2 written out as one vmovups a half, like the
// other primitives here (the 64-byte vector type is wider than any AVX2 register, and GCC
// moves values of it through general registers and the stack where it must lower them
// itself: vmovq / vpinsrq in the prefill attention tiles, which now use __m256 halves).
inline v16 load(const float* p) {
#if defined(FX_AVX2)
  return join(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
#else
  return *reinterpret_cast<const v16u*>(p);
#endif
}

// One float in every lane, loaded straight from memory. (`v16{} + *p` would compute
// 0.0f + x, an add then a register broadcast: two extra uops per use, and the broadcast's
// shuffle competes with the FMAs for the same pipes.)
inline v16 splat(const float* p) {
#if defined(__AVX512F__)
  __m512 r = _mm512_set1_ps(*p);
  return reinterpret_cast<v16&>(r);
#elif defined(FX_AVX2)
  const __m256 r = _mm256_broadcast_ss(p);
  return join(r, r);
#else
  const float x = *p;
  return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#endif
}
inline void store(float* p, v16 v) {
#if defined(FX_AVX2)
  __m256 lo, hi;
  halves(v, lo, hi);
  _mm256_storeu_ps(p, lo);
  _mm256_storeu_ps(p + 8, hi);
#else
  *reinterpret_cast<v16u*>(p) = v;
#endif
}

// x in every lane (for a value computed in a register; splat() loads from memory).
inline v16 bcast(float x) {
#if defined(__AVX512F__)
  __m512 r = _mm512_set1_ps(x);
  return reinterpret_cast<v16&>(r);
#elif defined(FX_AVX2)
  const __m256 r = _mm256_set1_ps(x);
  return join(r, r);
#else
  return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#endif
}

// Fixed-order horizontal sum (pairwise halves): the same for every caller.
inline float hsum(v16 v) {
#if defined(__AVX512F__)
  __m512 r;
  std::memcpy(&r, &v, sizeof(r));
  return _mm512_reduce_add_ps(r);  // a fixed sequence of halving shuffles and adds
#elif defined(FX_AVX2)
  __m256 lo, hi;  // the portable order below: halves, quarters, then (0+2) + (1+3)
  halves(v, lo, hi);
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#else
  float a[VL];
  std::memcpy(a, &v, sizeof(a));
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}

// f(std::integral_constant<int, m>{}) for a runtime m in 1..MAX (values outside run
// nothing: callers clamp): the few-row kernels take their row count as a template
// argument, so the accumulators stay in registers.
template <int MAX, typename F>
inline void with_rows(int m, F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (void)((m == I + 1 ? (f(std::integral_constant<int, I + 1>{}), true) : false) || ...);
  }(std::make_integer_sequence<int, MAX>{});
}

// f(std::bool_constant<b>{}) for a runtime b (a kernel's variant chosen once per call);
// USED = false: f(false) alone (a variant that makes no difference is not compiled).
template <bool USED = true, typename F>
inline void with_flag(bool b, F&& f) {
  if constexpr (USED) {
    if (b) return f(std::true_type{});
  }
  f(std::false_type{});
}

// f(std::integral_constant<int, bits>{}) for the weight layouts the kernels run: 4 bits,
// or bytes (8 bits, and 5/6 bits unpacked to bytes: Quant::weights).
template <typename F>
inline void with_bits(int bits, F&& f) {
  if (bits == 4)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}
