// fx-engine's native CPU kernels, as MLX primitives (graph nodes that mx.compile keeps).
//
// Why this file exists: on the Linux CPU backend MLX's quantized matmul is a naive
// one-core kernel (~0.5 GB/s of packed weights), its attention, softmax and RMSNorm are
// chains of unfused ops, and every graph node costs microseconds. The kernels here are
// the hot loops of LLM inference on a CPU, each one node:
//
//   qmm:        y[M, N] = x[M, K] @ dequantize(w)[N, K].T for MLX's affine-quantized
//               weights (4 or 8 bits, group a multiple of 32: what GGUF Q4_0/Q4_1/Q8_0 and
//               mlx-community models load as). Four weight rows are dequantized into an
//               L1 buffer once and reused by every activation row, so a decode step
//               streams the packed bytes and a batch of rows shares one pass over them.
//   qgemm:      the same product for many rows (prefill chunks, wide decode batches):
//               register tiles of 12 features x 32 rows, vectors along the rows, each
//               dequantized weight broadcast; FMA-bound, ~2x qmm from ~16 rows up. Up to
//               16 rows (decode), vectors along 16 features dequantized in registers:
//               the same bits at every row count, ~2x qmm at 8 rows (AVX-512 builds).
//   qmm_a8:     the product with each activation row rounded to 8 bits per weight group
//               (opt-in numerics, as llama.cpp's): exact int8 dot products (AVX-512
//               VNNI), no float copy of the weights; 2-3x qmm/qgemm from 8 rows up.
//   dequantize: the same values as mx.dequantize, from the same code qmm and qgemm
//               unpack their weights with (without AVX-512, many-row products run a
//               BLAS GEMM on it: qgemm's tile would spill).
//   attend:     grouped-query attention for a few query tokens per row (decode, verify).
//   masked_softmax, rms_norm, rope, swiglu, kv_put (the cache write, in place).
//
// Numerics: every output element is accumulated in a fixed order and computed by one
// thread (qmm and qgemm have different orders, so their results differ in the last bits;
// each alone is fixed). It never depends on M, on the other rows, on the blocking, on the
// attention span or on the thread count: these kernels are batch-invariant by
// construction (fx_engine.nn.Numerics).
//
// Portable C++ with GCC/Clang vector extensions (compiled with -march=native by
// fx_engine/native/build.py). A few AVX-512 intrinsics (u8 -> float conversion, FMA,
// horizontal sums, broadcast loads) sit behind #if __AVX512F__ with portable fallbacks,
// so the same source builds for AVX-512, AVX2 and NEON.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

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

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }

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
inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

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

// ---------------------------------------------------------------- thread pool
// A small persistent pool with dynamic chunk claiming. The calling thread (MLX's CPU
// stream thread) claims chunks too and never waits for a worker that has not started:
// it only waits for chunks already claimed. This matters on a small machine where BLAS
// threads or other processes may hold the other cores (a statically split job then waits
// a whole scheduler time slice for a descheduled worker). Workers spin briefly after each
// job (the next kernel usually follows within microseconds), then sleep on a futex.
//
// Which thread computes a chunk never changes its result: every output element is
// computed entirely inside one chunk.
class Pool {
 public:
  explicit Pool(int n) { resize(n); }
  ~Pool() { stop(); }

  int size() const { return n_; }

  void resize(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    stop();
    n_ = std::max(1, n);
    quit_.store(false);
    const uint64_t g0 = gen_.load();  // read before the threads start: no job can be missed
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this, g0] { loop(g0); });
  }

  // Run f(c) for every chunk c in [0, chunks).
  void run(int chunks, const std::function<void(int)>& f) {
    if (chunks <= 0) return;
    if (chunks == 1 || n_ == 1) {
      for (int c = 0; c < chunks; ++c) f(c);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);  // one job at a time (several CPU streams)
    const uint32_t id = ++jobs_;  // 32 bits: the id lives in the high half of state_
    job_.store(&f, std::memory_order_relaxed);
    nchunks_.store(static_cast<uint32_t>(chunks), std::memory_order_relaxed);
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    state_.store(static_cast<uint64_t>(id) << 32, std::memory_order_release);
    gen_.fetch_add(1, std::memory_order_release);
    gen_.notify_all();
    work(id);
    for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
      if (spins < 100000) pause(); else std::this_thread::yield();  // a claimed chunk's
    }                                                                // thread may be descheduled
    // Close the job before its function and counters can be reused: a late worker's
    // claim on this id now fails.
    state_.store((static_cast<uint64_t>(id) << 32) | CLOSED, std::memory_order_release);
    if (error_) std::rethrow_exception(error_);  // e.g. bad_alloc in a chunk
  }

 private:
  static constexpr uint64_t CLOSED = 0xFFFFFFFFull;

  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  // Claim and run chunks of job `id` until none are left. A chunk that throws still
  // counts as done (the caller must not return while others run its function); the
  // first exception is rethrown by run().
  void work(uint32_t id) {
    while (true) {
      uint64_t cur = state_.load(std::memory_order_acquire);
      if (static_cast<uint32_t>(cur >> 32) != id) return;
      const uint64_t c = cur & 0xFFFFFFFFull;
      const std::function<void(int)>* f = job_.load(std::memory_order_relaxed);
      const uint32_t n = nchunks_.load(std::memory_order_relaxed);
      if (c >= n) return;
      if (state_.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel)) {
        try {
          (*f)(static_cast<int>(c));
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mu_);
          if (!error_) error_ = std::current_exception();
        }
        done_.fetch_add(1, std::memory_order_acq_rel);
      }
    }
  }

  void loop(uint64_t seen) {
    while (true) {
      uint64_t g;
      int spins = 0;
      while ((g = gen_.load(std::memory_order_acquire)) == seen && spins < 4000) {
        pause();
        ++spins;
      }
      if (g == seen) {
        gen_.wait(seen);
        continue;
      }
      seen = g;
      if (quit_.load()) return;
      work(static_cast<uint32_t>(state_.load(std::memory_order_acquire) >> 32));
    }
  }

  void stop() {
    if (workers_.empty()) return;
    quit_.store(true);
    gen_.fetch_add(1);
    gen_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::atomic<int> n_{1};  // read by run() without the lock
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<uint64_t> state_{CLOSED};
  std::atomic<int> done_{0};
  std::atomic<bool> quit_{false};
  // Written before state_ publishes a job (release) and read after it is seen (acquire);
  // atomics only so that a late worker's read of a newer job's values is not a data race
  // (its claim then fails on the job id).
  std::atomic<const std::function<void(int)>*> job_{nullptr};
  std::atomic<uint32_t> nchunks_{0};
  uint32_t jobs_ = 0;
  std::mutex mu_, error_mu_;
  std::exception_ptr error_;
};

Pool& pool() {
  // Never destroyed: a static destructor at exit could race with MLX's stream thread.
  static Pool* p = new Pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  return *p;
}

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
void qmm_range(const float* x, int M, int K, const uint32_t* wq, const float* sc,
               const float* bi, int gs, float* y, int N, int n0, int n1) {
  constexpr int NB = 4;
  const int words = K * BITS / 32, groups = K / gs;
  thread_local std::vector<float> buf;
  if (static_cast<int>(buf.size()) < NB * K) buf.resize(NB * K);
  float* w = buf.data();
  int n = n0;
  for (; n + NB <= n1; n += NB) {
    for (int j = 0; j < NB; ++j) {
      const int64_t r = n + j;
      dequant_row<BITS>(wq + r * words, sc + r * groups, bi + r * groups, K, gs, w + j * K);
    }
    qmm_rows<NB>(x, M, K, w, y + n, N);
  }
  for (; n < n1; ++n) {
    const int64_t r = n;
    dequant_row<BITS>(wq + r * words, sc + r * groups, bi + r * groups, K, gs, w);
    qmm_rows<1>(x, M, K, w, y + n, N);
  }
}

void qmm_cpu(const float* x, int M, int K, const uint32_t* wq, const float* sc, const float* bi,
             int gs, int bits, float* y, int N) {
  constexpr int NB = 4;
  const int blocks = (N + NB - 1) / NB;
  std::vector<float> xs;
  if (bits == 4) {  // activations in the split order of the dequantized 4-bit rows
    xs.resize(static_cast<size_t>(M) * K);
    split_rows(x, M, K, xs.data());
    x = xs.data();
  }
  // Parallel over output features: each y[m, n] is computed by exactly one thread.
  // Chunks of output features, ~32 KB of 4-bit weights or more each.
  const int per = std::max(4, 16384 / std::max(K, 1));
  const int chunks = (blocks + per - 1) / per;
  pool().run(chunks, [&](int c) {
    const int n0 = std::min(N, c * per * NB), n1 = std::min(N, (c + 1) * per * NB);
    if (bits == 8)
      qmm_range<8>(x, M, K, wq, sc, bi, gs, y, N, n0, n1);
    else
      qmm_range<4>(x, M, K, wq, sc, bi, gs, y, N, n0, n1);
  });
}

// ---------------------------------------------------------------- qgemm
// The same product as qmm for many rows (prefill chunks, wide decode batches), organised
// the other way round: vectors run along the activation rows and every dequantized
// weight value is broadcast. A register tile holds 12 output features x 32 rows (24
// accumulators), so each weight value is read once per 32 rows and each activation
// vector once per 12 features: the loop is bound by the FMA units, not by loads (qmm's
// 4x4 inner-product tile streams the activations from L2 once per 4 features). Measured
// on a 2-core Zen 4 (FMA peak 229 GFLOP/s): 197 GFLOP/s at 512 rows, 147 at 32, vs ~80
// for qmm and ~110-130 for MKL's SGEMM on the dequantized weight. Below ~16 rows most
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
struct FewBlock {
  const char* rw[16];
  const char* next;
  int64_t next_bytes, pf_step;
  int nv;
};

inline FewBlock few_block(int K, const uint32_t* wq, const float* sc, const float* bi, int gs,
                          int bits, int N, int n0, float* sbuf) {
  FewBlock fb;
  const int words = K * bits / 32, groups = K / gs;
  fb.nv = std::min(16, N - n0);
  const char* rs[16];
  const char* rb[16];
  for (int j = 0; j < 16; ++j) {
    const int64_t r = n0 + std::min(j, fb.nv - 1);
    fb.rw[j] = reinterpret_cast<const char*>(wq + r * words);
    rs[j] = reinterpret_cast<const char*>(sc + r * groups);
    rb[j] = reinterpret_cast<const char*>(bi + r * groups);
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
  // The next block's scales and biases (with float32 parameters a third of the bytes of
  // 4-bit weights in groups of 32), now: read at the start of that block, before its words.
  const int64_t next_rows = std::max(0, std::min(16, N - n0 - 16));
  for (const float* t : {sc, bi}) {
    const char* p = reinterpret_cast<const char*>(t + int64_t{n0 + 16} * groups);
    for (int64_t o = 0; o < next_rows * groups * 4; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
  }
  const int64_t blk_bytes = int64_t{16} * words * 4;
  fb.next = reinterpret_cast<const char*>(wq + int64_t{n0 + 16} * words);
  fb.next_bytes = std::min(blk_bytes, std::max<int64_t>(0, int64_t{N - n0 - 16} * words * 4));
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

inline void prefetch_slice(const FewBlock& fb, int k0) {
  for (int64_t o = (k0 / 32) * fb.pf_step, e = std::min(fb.next_bytes, o + fb.pf_step); o < e; o += 64)
    _mm_prefetch(fb.next + o, _MM_HINT_T0);
}

// NB adjacent 16-feature blocks from n0 at once (blocks past N are skipped by the caller):
// each output's sum is one chain of dependent FMAs (the fixed order), so one or two rows
// alone wait on the FMA latency (measured: 1 row took ~as long as 4); NB blocks give NB x MR
// independent chains with the same per-output arithmetic.
template <int BITS, int MR, int NB>
inline void qgemm_few_block(const float* x, int K, const uint32_t* wq, const float* sc,
                            const float* bi, int gs, float* y, int N, int n0, float* sbuf) {
  const int groups = K / gs;
  FewBlock fb[NB];
  for (int t = 0; t < NB; ++t)
    fb[t] = few_block(K, wq, sc, bi, gs, BITS, N, n0 + 16 * t, sbuf + t * (2 * groups * 16 + 16));
  // the next NB blocks' packed rows (contiguous), a slice per 32-k step (each few_block
  // prefetches only the block after its own, which is inside this group for t < NB - 1)
  const int64_t words = K * BITS / 32;
  const char* next = reinterpret_cast<const char*>(wq + (n0 + 16 * NB) * words);
  const int64_t next_bytes = std::max(0, std::min(16 * NB, N - n0 - 16 * NB)) * words * 4;
  const int64_t slice = ((next_bytes + 63) / 64 + K / 32 - 1) / (K / 32) * 64;
  const __m512i low = _mm512_set1_epi32(BITS == 4 ? 15 : 255);
  __m512 acc[NB][MR];
  for (int t = 0; t < NB; ++t)
    for (int m = 0; m < MR; ++m) acc[t][m] = _mm512_setzero_ps();
  for (int k0 = 0; k0 < K; k0 += 32) {
    for (int64_t o = (k0 / 32) * slice, e = std::min(next_bytes, o + slice); o < e; o += 64)
      _mm_prefetch(next + o, _MM_HINT_T0);
    const int gi = k0 / gs;
    __m512 s[NB], c[NB];
    for (int t = 0; t < NB; ++t) {
      const float* st = sbuf + t * (2 * groups * 16 + 16);
      s[t] = _mm512_load_ps(st + gi * 16);
      c[t] = _mm512_load_ps(st + (groups + gi) * 16);
    }
    const int64_t off = static_cast<int64_t>(k0) * BITS / 8;  // bytes into each row
    for (int h = 0; h < (BITS == 4 ? 1 : 2); ++h) {
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
              const __m512 w = _mm512_add_ps(_mm512_mul_ps(s[t], q), c[t]);
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

template <int BITS, int MR>
inline void qgemm_few_rows(const float* x, int K, const uint32_t* wq, const float* sc,
                           const float* bi, int gs, float* y, int N, int b0, int b1, float* sbuf) {
  // independent FMA chains for few rows (8-bit weights: the head, bound by memory; more
  // blocks there only add register pressure)
  constexpr int NB = BITS == 8 ? (MR == 1 ? 2 : 1) : MR == 1 ? 4 : MR == 2 ? 2 : 1;
  int bl = b0;
  for (; bl + NB <= b1; bl += NB) qgemm_few_block<BITS, MR, NB>(x, K, wq, sc, bi, gs, y, N, 16 * bl, sbuf);
  for (; bl < b1; ++bl) qgemm_few_block<BITS, MR, 1>(x, K, wq, sc, bi, gs, y, N, 16 * bl, sbuf);
}

template <int BITS>
void qgemm_few(const float* x, int M, int K, const uint32_t* wq, const float* sc,
               const float* bi, int gs, float* y, int N) {
  const int blocks = (N + 15) / 16;
  const int per = 4;  // one group of 4 blocks (the 1-row step) per chunk
  pool().run((blocks + per - 1) / per, [&](int c) {
    // this thread's buffers for up to 4 blocks' transposed scales and biases
    thread_local std::vector<float> sb;
    const size_t need = static_cast<size_t>(4 * (2 * (K / gs) * 16 + 16) + 16);
    if (sb.size() < need) sb.resize(need);
    float* sbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sb.data()) + 63) & ~uintptr_t{63});
    const int b0 = c * per, b1 = std::min(blocks, (c + 1) * per);
    switch (M) {
      case 16: qgemm_few_rows<BITS, 16>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 15: qgemm_few_rows<BITS, 15>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 14: qgemm_few_rows<BITS, 14>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 13: qgemm_few_rows<BITS, 13>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 12: qgemm_few_rows<BITS, 12>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 11: qgemm_few_rows<BITS, 11>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 10: qgemm_few_rows<BITS, 10>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 9: qgemm_few_rows<BITS, 9>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 8: qgemm_few_rows<BITS, 8>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 7: qgemm_few_rows<BITS, 7>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 6: qgemm_few_rows<BITS, 6>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 5: qgemm_few_rows<BITS, 5>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 4: qgemm_few_rows<BITS, 4>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 3: qgemm_few_rows<BITS, 3>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      case 2: qgemm_few_rows<BITS, 2>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
      default: qgemm_few_rows<BITS, 1>(x, K, wq, sc, bi, gs, y, N, b0, b1, sbuf); break;
    }
  });
}
static_assert(QG_FEW == 16, "qgemm_few dispatches 1..16 rows");
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
// sbuf[groups + g][8]. Returns the block's number of real features.
inline int few8_setup(int K, const uint32_t* wq, const float* sc, const float* bi, int gs,
                      int bits, int N, int n0, const char** rw, float* sbuf) {
  const int words = K * bits / 32, groups = K / gs, nv = std::min(8, N - n0);
  const char* rs[8];
  const char* rb[8];
  for (int j = 0; j < 8; ++j) {
    const int64_t r = n0 + std::min(j, nv - 1);
    rw[j] = reinterpret_cast<const char*>(wq + r * words);
    rs[j] = reinterpret_cast<const char*>(sc + r * groups);
    rb[j] = reinterpret_cast<const char*>(bi + r * groups);
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

// NB adjacent 8-feature blocks from n0 (all inside N's blocks) for MR rows of x (row
// stride K). Several blocks at once for few rows: each output's sum is one chain of
// dependent FMAs (the fixed order), so one row alone would wait on the FMA latency; NB
// blocks give NB x MR independent chains with the same per-output arithmetic.
template <int BITS, int MR, int NB>
inline void qgemm_few8_blocks(const float* x, int K, const uint32_t* wq, const float* sc,
                              const float* bi, int gs, float* y, int N, int n0, float* sbuf) {
  const int groups = K / gs;
  const char* rw[NB][8];
  int nv[NB];
  for (int t = 0; t < NB; ++t)
    nv[t] = few8_setup(K, wq, sc, bi, gs, BITS, N, n0 + 8 * t, rw[t], sbuf + t * 16 * groups);
  // The next NB blocks' packed rows (contiguous) are prefetched a slice per 32-k step, and
  // their scales and biases now: interleaved row streams defeat the hardware prefetchers.
  const int words = K * BITS / 32;
  const int64_t next_rows = std::max(0, std::min(8 * NB, N - n0 - 8 * NB));
  const char* next = reinterpret_cast<const char*>(wq + int64_t{n0 + 8 * NB} * words);
  const int64_t next_bytes = next_rows * words * 4, slice = ((next_bytes + 63) / 64 + K / 32 - 1) / (K / 32) * 64;
  for (const float* p : {sc, bi}) {
    const char* q = reinterpret_cast<const char*>(p + int64_t{n0 + 8 * NB} * groups);
    for (int64_t o = 0; o < next_rows * groups * 4; o += 64) _mm_prefetch(q + o, _MM_HINT_T0);
  }
  const __m256i low = _mm256_set1_epi32(BITS == 4 ? 15 : 255);
  __m256 acc[NB][MR];
  for (int t = 0; t < NB; ++t)
    for (int m = 0; m < MR; ++m) acc[t][m] = _mm256_setzero_ps();
  for (int k0 = 0; k0 < K; k0 += 32) {
    for (int64_t o = (k0 / 32) * slice, e = std::min(next_bytes, o + slice); o < e; o += 64)
      _mm_prefetch(next + o, _MM_HINT_T0);
    const int gi = k0 / gs;
    const int64_t off = static_cast<int64_t>(k0) * BITS / 8;  // bytes into each row
    // the 32 k of this step per block: 4-bit: one transpose, then the even k (low
    // nibbles), then the odd ones (the split order, as the AVX-512 path); 8-bit: two
    __m256i wv[NB][4];
    for (int h = 0; h < (BITS == 4 ? 1 : 2); ++h) {
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
              const float* st = sbuf + t * 16 * groups + gi * 8;
              const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(wv[t][i], sh), low));
              const __m256 w = _mm256_add_ps(_mm256_mul_ps(_mm256_load_ps(st), q),
                                             _mm256_load_ps(st + 8 * groups));
              for (int m = 0; m < MR; ++m)
                acc[t][m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + static_cast<int64_t>(m) * K + k),
                                            w, acc[t][m]);
            }
          }
    }
  }
  alignas(32) static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  for (int t = 0; t < NB; ++t) {
    const __m256i keep = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 8 - nv[t]));
    for (int m = 0; m < MR; ++m)
      _mm256_maskstore_ps(y + static_cast<int64_t>(m) * N + n0 + 8 * t, keep, acc[t][m]);
  }
}

template <int BITS, int MR>
inline void qgemm_few8_rows(const float* x, int K, const uint32_t* wq, const float* sc,
                            const float* bi, int gs, float* y, int N, int b0, int b1, float* sbuf) {
  constexpr int NB = MR <= 2 ? 2 : 1;  // independent FMA chains for one or two rows
  int bl = b0;
  for (; bl + NB <= b1; bl += NB) qgemm_few8_blocks<BITS, MR, NB>(x, K, wq, sc, bi, gs, y, N, 8 * bl, sbuf);
  for (; bl < b1; ++bl) qgemm_few8_blocks<BITS, MR, 1>(x, K, wq, sc, bi, gs, y, N, 8 * bl, sbuf);
}

template <int BITS>
void qgemm_few(const float* x, int M, int K, const uint32_t* wq, const float* sc,
               const float* bi, int gs, float* y, int N) {
  const int blocks = (N + 7) / 8;
  const int per = 2 * std::max(1, 4 * 576 / std::max(K, 1));  // an even number of blocks
  pool().run((blocks + per - 1) / per, [&](int c) {
    thread_local std::vector<float> sb;
    const size_t need = static_cast<size_t>(2 * 16 * (K / gs) + 8);  // 2 blocks; + 8: alignment
    if (sb.size() < need) sb.resize(need);
    float* sbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sb.data()) + 31) & ~uintptr_t{31});
    const int b0 = c * per, b1 = std::min(blocks, (c + 1) * per);
    for (int m0 = 0; m0 < M; m0 += QG_PASS) {
      const float* xm = x + static_cast<int64_t>(m0) * K;
      float* ym = y + static_cast<int64_t>(m0) * N;
      switch (std::min(QG_PASS, M - m0)) {
        case 8: qgemm_few8_rows<BITS, 8>(xm, K, wq, sc, bi, gs, ym, N, b0, b1, sbuf); break;
        case 7: qgemm_few8_rows<BITS, 7>(xm, K, wq, sc, bi, gs, ym, N, b0, b1, sbuf); break;
        case 6: qgemm_few8_rows<BITS, 6>(xm, K, wq, sc, bi, gs, ym, N, b0, b1, sbuf); break;
        case 5: qgemm_few8_rows<BITS, 5>(xm, K, wq, sc, bi, gs, ym, N, b0, b1, sbuf); break;
        case 4: qgemm_few8_rows<BITS, 4>(xm, K, wq, sc, bi, gs, ym, N, b0, b1, sbuf); break;
        case 3: qgemm_few8_rows<BITS, 3>(xm, K, wq, sc, bi, gs, ym, N, b0, b1, sbuf); break;
        case 2: qgemm_few8_rows<BITS, 2>(xm, K, wq, sc, bi, gs, ym, N, b0, b1, sbuf); break;
        default: qgemm_few8_rows<BITS, 1>(xm, K, wq, sc, bi, gs, ym, N, b0, b1, sbuf); break;
      }
    }
  });
}
static_assert(QG_PASS == 8, "qgemm_few dispatches 1..8 rows per pass");
#endif

void qgemm_cpu(const float* x, int M, int K, const uint32_t* wq, const float* sc,
               const float* bi, int gs, int bits, float* y, int N) {
#if defined(__AVX512F__) || defined(FX_AVX2)
#if defined(FX_AVX2)
  // Every row count, in passes of 8 rows: the AVX2 build's register tiles spill (v16 is two
  // ymm), and the passes give their bits at ~3-4x their speed (measured: 3072 x 576 at 64
  // rows 7.1 -> ~2 ms), so the tiles below serve the generic build only.
  constexpr int few_max = 1 << 30;
#else
  constexpr int few_max = QG_FEW;
#endif
  if (M > 0 && M <= few_max) {
    if (bits == 8)
      qgemm_few<8>(x, M, K, wq, sc, bi, gs, y, N);
    else
      qgemm_few<4>(x, M, K, wq, sc, bi, gs, y, N);
    return;
  }
#endif
  const int tiles = (M + QG_ROWS - 1) / QG_ROWS;
  // Uninitialized (pack_cols writes every element): a zeroing vector would memset it.
  // 64-byte aligned: each tile row of 32 floats is two whole cache lines.
  struct Free { void operator()(float* p) const { ::operator delete[](p, std::align_val_t{64}); } };
  std::unique_ptr<float[], Free> xt(static_cast<float*>(::operator new[](
      sizeof(float) * static_cast<size_t>(tiles) * K * QG_ROWS, std::align_val_t{64})));
  pack_cols(x, M, K, bits == 4, xt.get());
  const int words = K * bits / 32, groups = K / gs;
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
    for (int bl = c * per; bl < b1; ++bl) {
      const int n0 = bl * QG_FEAT, nw = std::min(QG_FEAT, N - n0);
      for (int j = 0; j < nw; ++j) {
        const int64_t r = n0 + j;
        float* o = buf.data() + static_cast<int64_t>(j) * K;
        if (bits == 8)
          dequant_row<8>(wq + r * words, sc + r * groups, bi + r * groups, K, gs, o);
        else
          dequant_row<4>(wq + r * words, sc + r * groups, bi + r * groups, K, gs, o);
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
// packed in too. Up to 8 rows on AVX-512 VNNI builds: the few-row path (a8_few_block),
// vectors along 16 features instead, with the same bits.
constexpr int A8_FEAT = 12;  // output features per tile

#if defined(__AVX512VNNI__)
// acc += dot4(a u8, b s8) per int32 lane, in place. (GCC's intrinsic copies every
// accumulator through another register around each dot product: twice the uops.)
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// R rows per tile: 16, one zmm of int32 lanes (up to 8 rows take the few-row path).
template <int R> struct A8Vec;
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

// One group of gs values (a multiple of 32) -> q in the weight order (split: the 4-bit
// split order of each 32-block, even k first), d = amax / 127; returns the sum of q.
// rint(x * (127 / amax)) clamped to [-127, 127] (round half to even: the vector
// conversion uses the default rounding mode, as std::nearbyint does).
inline int quant_group(const float* xg, int gs, bool split, int8_t* q, float* d) {
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
  float amax = 0.0f;
  for (int k = 0; k < gs; ++k) amax = std::max(amax, std::fabs(xg[k]));
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  int sum = 0;
  for (int k = 0; k < gs; ++k) {
    const int v = static_cast<int>(std::max(-127.0f, std::min(127.0f, std::nearbyint(xg[k] * id))));
    // position in the weight order: in a 32-block, k = 2p at p, k = 2p + 1 at 16 + p
    const int p = split ? (k & ~31) + ((k & 1) ? 16 : 0) + ((k & 31) >> 1) : k;
    q[p] = static_cast<int8_t>(v);
    sum += v;
  }
  *d = amax / 127.0f;
  return sum;
#endif
}

// x rows [M, K] -> per tile of R rows: xq [K/4][R][4] int8 (K in the weight rows' order),
// d and xs [G][R] floats (zeros for padding rows). Each group is rounded on its own, so a
// row's values never depend on the other rows. One chunk per row (padding rows included).
template <int R>
void pack_a8(const float* x, int M, int K, int gs, bool split, int8_t* xq, float* dd,
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
        const int sum = quant_group(xr + static_cast<int64_t>(g) * gs, gs, split, rb + g * gs, &dv);
        d[g * R + i] = dv;
        s[g * R + i] = dv * static_cast<float>(sum);
      }
    }
    for (int u = 0; u < K / 4; ++u) q[u * R + i] = row[u];  // quad u of row i
  });
}

// out[j][i] for NW features (weight bytes wb + j * K, scales/biases sc/bi + j * G) against
// one tile of R rows.
template <int R, int NW>
inline void a8_tile(const int8_t* __restrict xq, const float* __restrict dd,
                    const float* __restrict xs, const uint8_t* __restrict wb,
                    const float* __restrict sc, const float* __restrict bi, int K, int gs,
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
    const uint8_t* wg = wb + static_cast<int64_t>(g) * gs;
    for (int u = 0; u < quads; ++u) {
      const typename V::I xv = V::iload(qg + u * R * 4);
      for (int j = 0; j < NW; ++j) {
        int32_t w4;
        std::memcpy(&w4, wg + static_cast<int64_t>(j) * K + u * 4, 4);
        is[j] = dpbusd(is[j], V::ibcast(w4), xv);
      }
    }
    const typename V::F dv = V::fload(dd + g * R), sv = V::fload(xs + g * R);
    for (int j = 0; j < NW; ++j) {
      const typename V::F f = V::mul(dv, V::fbcast(sc[static_cast<int64_t>(j) * G + g]));
      acc[j] = V::fma(V::cvt(is[j]), f, acc[j]);
      acc[j] = V::fma(sv, V::fbcast(bi[static_cast<int64_t>(j) * G + g]), acc[j]);
    }
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
            is += static_cast<int32_t>(wb[static_cast<int64_t>(j) * K + g * gs + u * 4 + b]) *
                  xq[((static_cast<int64_t>(g) * quads + u) * R + i) * 4 + b];
        const float f = dd[g * R + i] * sc[static_cast<int64_t>(j) * G + g];
        acc = std::fma(static_cast<float>(is), f, acc);
        acc = std::fma(xs[g * R + i], bi[static_cast<int64_t>(j) * G + g], acc);
      }
      out[j * R + i] = acc;
    }
#endif
}

template <int R>
inline void a8_tile_any(int nw, const int8_t* xq, const float* dd, const float* xs,
                        const uint8_t* wb, const float* sc, const float* bi, int K, int gs,
                        float* out) {
  switch (nw) {
    case 12: a8_tile<R, 12>(xq, dd, xs, wb, sc, bi, K, gs, out); break;
    case 11: a8_tile<R, 11>(xq, dd, xs, wb, sc, bi, K, gs, out); break;
    case 10: a8_tile<R, 10>(xq, dd, xs, wb, sc, bi, K, gs, out); break;
    case 9: a8_tile<R, 9>(xq, dd, xs, wb, sc, bi, K, gs, out); break;
    case 8: a8_tile<R, 8>(xq, dd, xs, wb, sc, bi, K, gs, out); break;
    case 7: a8_tile<R, 7>(xq, dd, xs, wb, sc, bi, K, gs, out); break;
    case 6: a8_tile<R, 6>(xq, dd, xs, wb, sc, bi, K, gs, out); break;
    case 5: a8_tile<R, 5>(xq, dd, xs, wb, sc, bi, K, gs, out); break;
    case 4: a8_tile<R, 4>(xq, dd, xs, wb, sc, bi, K, gs, out); break;
    case 3: a8_tile<R, 3>(xq, dd, xs, wb, sc, bi, K, gs, out); break;
    case 2: a8_tile<R, 2>(xq, dd, xs, wb, sc, bi, K, gs, out); break;
    default: a8_tile<R, 1>(xq, dd, xs, wb, sc, bi, K, gs, out); break;
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

template <int R>
void qmm_a8_rows(const float* x, int M, int K, const uint32_t* wq, const float* sc,
                 const float* bi, int gs, int bits, float* y, int N) {
  const int tiles = (M + R - 1) / R, G = K / gs;
  std::vector<int8_t> xq(static_cast<size_t>(tiles) * K * R);
  std::vector<float> dd(static_cast<size_t>(tiles) * G * R), xs(dd.size());
  pack_a8<R>(x, M, K, gs, bits == 4, xq.data(), dd.data(), xs.data());
  const int words = K * bits / 32;
  const int blocks = (N + A8_FEAT - 1) / A8_FEAT;
  const int per = std::max(1, 4 * 576 / std::max(K, 1));
  pool().run((blocks + per - 1) / per, [&](int c) {
    thread_local std::vector<uint8_t> buf;
    if (static_cast<int>(buf.size()) < A8_FEAT * K)
      buf.resize(static_cast<size_t>(A8_FEAT) * K);
    alignas(64) float out[A8_FEAT * R];
    const int b1 = std::min(blocks, (c + 1) * per);
    for (int bl = c * per; bl < b1; ++bl) {
      const int n0 = bl * A8_FEAT, nw = std::min(A8_FEAT, N - n0);
      const uint8_t* wb;
      if (bits == 8) {  // the packed words are the bytes, in k order: copied into L1
        std::memcpy(buf.data(), wq + static_cast<int64_t>(n0) * words, static_cast<size_t>(nw) * K);
        wb = buf.data();
      } else {
        for (int j = 0; j < nw; ++j)
          unpack_nibbles(wq + static_cast<int64_t>(n0 + j) * words, K,
                         buf.data() + static_cast<int64_t>(j) * K);
        wb = buf.data();
      }
      for (int t = 0; t < tiles; ++t) {
        const int m0 = t * R, mc = std::min(R, M - m0);
        a8_tile_any<R>(nw, xq.data() + static_cast<int64_t>(t) * K * R,
                       dd.data() + static_cast<int64_t>(t) * G * R,
                       xs.data() + static_cast<int64_t>(t) * G * R, wb,
                       sc + static_cast<int64_t>(n0) * G, bi + static_cast<int64_t>(n0) * G, K,
                       gs, out);
        for (int i = 0; i < mc; ++i) {
          float* yr = y + static_cast<int64_t>(m0 + i) * N + n0;
          for (int j = 0; j < nw; ++j) yr[j] = out[j * R + i];
        }
      }
    }
  });
}

// run(std::integral_constant<int, m>) for m in 1..8 (values above 8 run 8, below 1 run 1):
// the few-row kernels take the row count as a template argument.
template <typename F>
inline void rows_1_to_8(int m, F&& run) {
  switch (m) {
    case 8: run(std::integral_constant<int, 8>{}); break;
    case 7: run(std::integral_constant<int, 7>{}); break;
    case 6: run(std::integral_constant<int, 6>{}); break;
    case 5: run(std::integral_constant<int, 5>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    default: run(std::integral_constant<int, 1>{}); break;
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// qmm_a8 for up to 8 rows (decode batches): the other orientation, as qgemm's few-row
// path. Vectors run along 16 output features; a quad of 4 weight bytes per lane comes
// straight from the packed words (16 rows' words transposed in registers; for 4 bits the
// low or high nibbles of a word: quads i and 4 + i of its 32-block in the split order), and
// every row's dot product with it is one vpdpbusd against its broadcast activation quad.
// The tiles above broadcast the weights and spend half their work on unpacking and
// per-group float steps at 8 rows. Per group and row the same float operations as
// a8_tile: f = d[m, g] * s[n, g], acc = fma(isum, f, acc), acc = fma(xs[m, g], b[n, g],
// acc), and the integer sums are exact: the tiles' bits (tested).
template <int BITS, int MR>
inline void a8_few_block(const int8_t* xq, const float* dd, const float* xs, int K,
                         const uint32_t* wq, const float* sc, const float* bi, int gs,
                         float* y, int N, int n0, float* sbuf) {
  constexpr int R = 8;  // pack_a8<8>'s tile: quad u of row m at xq + (u * R + m) * 4
  const FewBlock fb = few_block(K, wq, sc, bi, gs, BITS, N, n0, sbuf);
  const float* bbuf = sbuf + static_cast<int64_t>(K / gs) * 16;
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq);
  const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  auto dots = [&](__m512i (&is)[MR], __m512i w, int u) {
    for (int m = 0; m < MR; ++m) is[m] = dpbusd(is[m], w, _mm512_set1_epi32(xq4[u * R + m]));
  };
  for (int g = 0; g < K / gs; ++g) {
    __m512i is[MR];
    for (int m = 0; m < MR; ++m) is[m] = _mm512_setzero_si512();
    for (int k0 = g * gs; k0 < (g + 1) * gs; k0 += 32) {
      prefetch_slice(fb, k0);
      const int64_t off = static_cast<int64_t>(k0) * BITS / 8;  // bytes into each row
      const int u0 = k0 / 4;
      if constexpr (BITS == 4) {
        __m512i wv[4];
        transpose16x4(fb.rw, off, wv);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          dots(is, _mm512_and_si512(wv[i], nib), u0 + i);
          dots(is, _mm512_and_si512(_mm512_srli_epi32(wv[i], 4), nib), u0 + 4 + i);
        }
      } else {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m512i wv[4];
          transpose16x4(fb.rw, off + 16 * h, wv);
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) dots(is, wv[i], u0 + 4 * h + i);
        }
      }
    }
    const __m512 s = _mm512_load_ps(sbuf + g * 16), c = _mm512_load_ps(bbuf + g * 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 f = _mm512_mul_ps(_mm512_set1_ps(dd[g * R + m]), s);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[m]), f, acc[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[g * R + m]), c, acc[m]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << fb.nv) - 1);
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + static_cast<int64_t>(m) * N + n0, keep, acc[m]);
}

template <int BITS>
void qmm_a8_few(const float* x, int M, int K, const uint32_t* wq, const float* sc,
                const float* bi, int gs, float* y, int N) {
  const int G = K / gs;
  std::vector<int8_t> xq(static_cast<size_t>(K) * 8);
  std::vector<float> dd(static_cast<size_t>(G) * 8), xs(dd.size());
  pack_a8<8>(x, M, K, gs, BITS == 4, xq.data(), dd.data(), xs.data());
  const int blocks = (N + 15) / 16;
  const int per = std::max(1, 4 * 576 / std::max(K, 1));
  pool().run((blocks + per - 1) / per, [&](int c) {
    float* sbuf = few_sbuf(G);
    const int b1 = std::min(blocks, (c + 1) * per);
    for (int bl = c * per; bl < b1; ++bl) {
      const int n0 = bl * 16;
      auto run = [&](auto mr) {
        a8_few_block<BITS, decltype(mr)::value>(xq.data(), dd.data(), xs.data(), K, wq, sc, bi,
                                                gs, y, N, n0, sbuf);
      };
      rows_1_to_8(M, run);
    }
  });
}
#endif

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512F__))
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
template <int BITS, int MR>
inline void a8_few8_block(const int8_t* xq, const float* dd, const float* xs, int K,
                          const uint32_t* wq, const float* sc, const float* bi, int gs,
                          float* y, int N, int n0, float* sbuf) {
  constexpr int R = 8;  // pack_a8<8>'s tile: quad u of row m at xq + (u * R + m) * 4
  const char* rw[8];
  const int nv = few8_setup(K, wq, sc, bi, gs, BITS, N, n0, rw, sbuf);
  const int groups = K / gs;
  const float* bbuf = sbuf + static_cast<int64_t>(groups) * 8;
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq);
  const __m256i nib = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi16(1);
  // the next block's packed rows, a slice per 32-k step (interleaved row streams defeat
  // the hardware prefetchers)
  const int words = K * BITS / 32;
  const char* next = reinterpret_cast<const char*>(wq + int64_t{n0 + 8} * words);
  const int64_t next_bytes = std::max(0, std::min(8, N - n0 - 8)) * int64_t{words} * 4;
  const int64_t slice = ((next_bytes + 63) / 64 + K / 32 - 1) / (K / 32) * 64;
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  auto xb = [&](int u, int m) { return _mm256_set1_epi32(xq4[u * R + m]); };
  for (int g = 0; g < groups; ++g) {
    __m256i is[MR];
    for (int m = 0; m < MR; ++m) is[m] = _mm256_setzero_si256();
    for (int k0 = g * gs; k0 < (g + 1) * gs; k0 += 32) {
      for (int64_t o = (k0 / 32) * slice, e = std::min(next_bytes, o + slice); o < e; o += 64)
        _mm_prefetch(next + o, _MM_HINT_T0);
      const int64_t off = static_cast<int64_t>(k0) * BITS / 8;  // bytes into each row
      const int u0 = k0 / 4;
      if constexpr (BITS == 4) {
        __m256i wv[4];
        transpose8x4(rw, off, wv);
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
        __m256i wv[8];
        transpose8x4(rw, off, wv);
        transpose8x4(rw, off + 16, wv + 4);
        for (int m = 0; m < MR; ++m) {
          __m256i pl = _mm256_setzero_si256(), ph = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) {
            const __m256i x = xb(u0 + i, m);
            pl = _mm256_add_epi16(pl, _mm256_maddubs_epi16(_mm256_and_si256(wv[i], nib), x));
            ph = _mm256_add_epi16(ph, _mm256_maddubs_epi16(
                                          _mm256_and_si256(_mm256_srli_epi16(wv[i], 4), nib), x));
          }
          is[m] = _mm256_add_epi32(is[m], _mm256_add_epi32(_mm256_madd_epi16(pl, one),
                                                           _mm256_madd_epi16(ph, sixteen)));
        }
      }
    }
    const __m256 s = _mm256_load_ps(sbuf + g * 8), c = _mm256_load_ps(bbuf + g * 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 f = _mm256_mul_ps(_mm256_set1_ps(dd[g * R + m]), s);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m]), f, acc[m]);
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(xs[g * R + m]), c, acc[m]);
    }
  }
  alignas(32) static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  const __m256i keep = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 8 - nv));
  for (int m = 0; m < MR; ++m) _mm256_maskstore_ps(y + static_cast<int64_t>(m) * N + n0, keep, acc[m]);
}

template <int BITS>
void qmm_a8_few8(const float* x, int M, int K, const uint32_t* wq, const float* sc,
                 const float* bi, int gs, float* y, int N) {
  constexpr int R = 8;
  const int G = K / gs, tiles = (M + R - 1) / R;
  std::vector<int8_t> xq(static_cast<size_t>(tiles) * K * R);
  std::vector<float> dd(static_cast<size_t>(tiles) * G * R), xs(dd.size());
  pack_a8<R>(x, M, K, gs, BITS == 4, xq.data(), dd.data(), xs.data());
  const int blocks = (N + 7) / 8;
  const int per = std::max(1, 8 * 576 / std::max(K, 1));
  pool().run((blocks + per - 1) / per, [&](int c) {
    thread_local std::vector<float> sb;
    const size_t need = static_cast<size_t>(16 * G + 8);  // + 8: alignment
    if (sb.size() < need) sb.resize(need);
    float* sbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sb.data()) + 31) & ~uintptr_t{31});
    const int b1 = std::min(blocks, (c + 1) * per);
    for (int bl = c * per; bl < b1; ++bl) {
      // every pass of 8 rows over this block while its weights are in L1
      for (int t = 0; t < tiles; ++t) {
        const int8_t* xt = xq.data() + static_cast<int64_t>(t) * K * R;
        const float* dt = dd.data() + static_cast<int64_t>(t) * G * R;
        const float* st = xs.data() + static_cast<int64_t>(t) * G * R;
        float* yt = y + static_cast<int64_t>(t) * R * N;
        auto run = [&](auto mr) {
          a8_few8_block<BITS, decltype(mr)::value>(xt, dt, st, K, wq, sc, bi, gs, yt, N, bl * 8, sbuf);
        };
        rows_1_to_8(std::min(R, M - t * R), run);
      }
    }
  });
}
#endif

// Up to 8 rows: the few-row path (AVX-512 VNNI builds); more: tiles of 16. AVX2 builds:
// the 8-lane path above at every row count. Elsewhere the scalar tiles (8 rows up to 8).
// Same bits every way (exact integer sums, the same per-lane float operations).
void qmm_a8_cpu(const float* x, int M, int K, const uint32_t* wq, const float* sc,
                const float* bi, int gs, int bits, float* y, int N) {
  if (M <= 0) return;
#if defined(FX_A8_AVX2)
  if (bits == 8)
    qmm_a8_few8<8>(x, M, K, wq, sc, bi, gs, y, N);
  else
    qmm_a8_few8<4>(x, M, K, wq, sc, bi, gs, y, N);
  return;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  if (M <= 8) {
    if (bits == 8)
      qmm_a8_few<8>(x, M, K, wq, sc, bi, gs, y, N);
    else
      qmm_a8_few<4>(x, M, K, wq, sc, bi, gs, y, N);
    return;
  }
#else
  if (M <= 8) return qmm_a8_rows<8>(x, M, K, wq, sc, bi, gs, bits, y, N);
#endif
  qmm_a8_rows<16>(x, M, K, wq, sc, bi, gs, bits, y, N);
}

void dequant_cpu(const uint32_t* wq, const float* sc, const float* bi, int gs, int bits,
                 float* out, int N, int K) {
  const int words = K * bits / 32, groups = K / gs;
  const int per = std::max(4, 65536 / std::max(K, 1));
  pool().run((N + per - 1) / per, [&](int c) {
    const int n0 = c * per, n1 = std::min(N, (c + 1) * per);
    std::vector<float> tmp(K);
    for (int n = n0; n < n1; ++n) {
      float* o = out + static_cast<int64_t>(n) * K;
      if (bits == 8)
        dequant_row_natural<8>(wq + static_cast<int64_t>(n) * words, sc + n * groups,
                               bi + n * groups, K, gs, o, tmp.data());
      else
        dequant_row_natural<4>(wq + static_cast<int64_t>(n) * words, sc + n * groups,
                               bi + n * groups, K, gs, o, tmp.data());
    }
  });
}

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
  v16 vm = bcast(FMIN);
  for (int j = 0; j < E16; j += VL) {
    const v16 v = masked(x + j, m + j);
    vm = v > vm ? v : vm;
  }
  float mx_ = hmax(vm);
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
  v16 vs = v16{};
  for (int j = 0; j < E16; j += VL) {
    const v16 e = vexp(masked(x + j, m + j) - mx_);
    store(out + j, e);
    vs += e;
  }
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

// IEEE half (as its 16 bits) -> float, exact (the portable path of load_kv).
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

// o[g][c] = sum over j < end[g] of p[g][j] * v[j][16c..16c+16), sequentially over j; the
// rows share each V load up to the smallest end, then finish alone.
template <typename E, int MR, int ND>
inline void pv_tile(const float* const* p, const E* vb, int64_t vs, const int* end,
                    float* const* o) {
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
        for (int d0 = 0; d0 < D; d0 += 4 * VL) {
          const int nd = std::min(4 * VL, D - d0) / VL;
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
constexpr int PMR = 8;   // score tile: rows
constexpr int PKV = 2;   // score tile: vectors of 16 keys

// acc[r][c] = sum_d q[r][d] * kt[c][d][0..16), sequentially over d; out rows of stride ld.
template <int MR, int NV>
inline void score_tile(const float* __restrict qs, int D, const float* __restrict kblk,
                       float* __restrict out, int64_t ld) {
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
      for (int d0 = 0; d0 < D; d0 += 4 * VL) {
        const int nd = std::min(4 * VL, D - d0) / VL;
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

// ---------------------------------------------------------------- inputs
// A row-contiguous view of an input: its own buffer when it already is one (the usual
// case: weights, and activations straight from a matmul), else a strided copy into
// `tmp`. Done here rather than with mx::contiguous in the graph because every such node
// costs several microseconds on the CPU, even when it copies nothing.
template <typename T>
const T* dense(const mx::array& a, std::vector<T>& tmp) {
  if (a.flags().row_contiguous) return a.data<T>();
  tmp.resize(a.size());
  const T* src = a.data<T>();
  const int nd = static_cast<int>(a.ndim());
  const int64_t inner = nd ? a.shape(nd - 1) : 1;
  const int64_t inner_stride = nd ? a.strides()[nd - 1] : 1;
  std::vector<int64_t> idx(std::max(nd - 1, 0), 0);
  for (size_t i = 0; i < a.size(); i += inner) {
    int64_t off = 0;
    for (int d = 0; d < nd - 1; ++d) off += idx[d] * a.strides()[d];
    if (inner_stride == 1) {
      std::memcpy(tmp.data() + i, src + off, inner * sizeof(T));
    } else {
      for (int64_t j = 0; j < inner; ++j) tmp[i + j] = src[off + j * inner_stride];
    }
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) break;
      idx[d] = 0;
    }
  }
  return tmp.data();
}

// ---------------------------------------------------------------- primitives
// What every primitive here shares: allocate the output, then queue the work on the CPU
// stream. The task captures the arrays and parameters by value (never `this`: MLX may
// detach the graph, and drop the primitive, before the queued task runs).
class CpuKernel : public mx::UnaryPrimitive {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    if (out.size() == 0) return;  // nothing to compute (and no division by a zero size)
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch(task(in, out));
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("fx_engine native kernels run on the CPU only");
  }

 protected:
  virtual std::function<void()> task(const std::vector<mx::array>& in, mx::array out) const = 0;
};

// kind: 0 qmm, 1 qgemm, 2 qmm_a8 (three kernels for one product; see each).
class QMatmul : public CpuKernel {
 public:
  QMatmul(mx::Stream s, int group_size, int bits, int kind)
      : CpuKernel(s), gs_(group_size), bits_(bits), kind_(kind) {}

  std::function<void()> task(const std::vector<mx::array>& in, mx::array out) const override {
    return [x = in[0], w = in[1], s = in[2], b = in[3], out, gs = gs_, bits = bits_,
            kind = kind_]() mutable {
      const int K = static_cast<int>(x.shape(-1));
      const int M = static_cast<int>(x.size() / K);
      const int N = static_cast<int>(out.shape(-1));
      std::vector<uint32_t> tw;
      std::vector<float> tx, ts, tb;
      auto* f = kind == 2 ? qmm_a8_cpu : kind == 1 ? qgemm_cpu : qmm_cpu;
      f(dense(x, tx), M, K, dense(w, tw), dense(s, ts), dense(b, tb), gs, bits,
        out.data<float>(), N);
    };
  }
  const char* name() const override {
    return kind_ == 2 ? "FxQMatmulA8" : kind_ == 1 ? "FxQGemm" : "FxQMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QMatmul&>(other);
    return gs_ == o.gs_ && bits_ == o.bits_ && kind_ == o.kind_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto shape = in[0].shape();
    shape.back() = in[1].shape(0);
    return {shape};
  }

 private:
  int gs_, bits_, kind_;
};

class Dequantize : public CpuKernel {
 public:
  Dequantize(mx::Stream s, int group_size, int bits)
      : CpuKernel(s), gs_(group_size), bits_(bits) {}

  std::function<void()> task(const std::vector<mx::array>& in, mx::array out) const override {
    return [w = in[0], s = in[1], b = in[2], out, gs = gs_, bits = bits_]() mutable {
      std::vector<uint32_t> tw;
      std::vector<float> ts, tb;
      dequant_cpu(dense(w, tw), dense(s, ts), dense(b, tb), gs, bits,
                  out.data<float>(), static_cast<int>(out.shape(0)),
                  static_cast<int>(out.shape(1)));
    };
  }
  const char* name() const override { return "FxDequantize"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Dequantize&>(other);
    return gs_ == o.gs_ && bits_ == o.bits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {mx::Shape{in[0].shape(0), static_cast<int>(in[0].shape(1)) * 32 / bits_}};
  }

 private:
  int gs_, bits_;
};


class MaskedSoftmax : public CpuKernel {
 public:
  explicit MaskedSoftmax(mx::Stream s) : CpuKernel(s) {}
  std::function<void()> task(const std::vector<mx::array>& in, mx::array out) const override {
    return [x = in[0], m = in[1], out]() mutable {
      std::vector<float> tx;
      std::vector<uint8_t> tm;
      const float* xp = dense(x, tx);
      const uint8_t* mp = dense<uint8_t>(m, tm);
      masked_softmax_cpu(xp, mp, out.data<float>(), x.shape(0), x.shape(1), x.shape(2),
                         x.shape(3));
    };
  }
  const char* name() const override { return "FxMaskedSoftmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }
};

class RmsNorm : public CpuKernel {
 public:
  RmsNorm(mx::Stream s, float eps) : CpuKernel(s), eps_(eps) {}
  std::function<void()> task(const std::vector<mx::array>& in, mx::array out) const override {
    return [x = in[0], w = in[1], out, eps = eps_]() mutable {
      std::vector<float> tx, tw;
      const int D = static_cast<int>(x.shape(-1));
      rms_norm_cpu(dense(x, tx), dense(w, tw), eps, out.data<float>(),
                   static_cast<int64_t>(x.size() / D), D);
    };
  }
  const char* name() const override { return "FxRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }

 private:
  float eps_;
};

// kv_put: cache [B, H, S, D] with new [B, H, T, D] written at slots [B, T] (the cache
// write of a step: mx.put_along_axis(cache, slots[:, None, :, None], new, axis=2)), in
// place when the cache's buffer is donatable (the step holds the only reference), as MLX's
// own scatter does; otherwise into a copy. MLX's scatter costs ~18 us per call here (two per
// layer per step); this one copies T rows of D values per (b, h).
class KvPut : public mx::UnaryPrimitive {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const mx::array& cache = in[0];
    const bool donated = cache.flags().row_contiguous && cache.is_donatable() &&
                         cache.itemsize() == out.itemsize();
    if (donated)
      out.copy_shared_buffer(cache);
    else
      out.set_data(mx::allocator::malloc(out.nbytes()));
    if (out.size() == 0) return;
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([cache, nw = in[1], sl = in[2], out, donated]() mutable {
      const int B = static_cast<int>(out.shape(0)), H = static_cast<int>(out.shape(1));
      const int64_t S = out.shape(2), D = out.shape(3);
      const int T = static_cast<int>(nw.shape(2));
      const size_t isz = out.itemsize();
      char* o = out.data<char>();
      if (!donated) {  // an independent copy of the cache first
        if (cache.flags().row_contiguous) {
          std::memcpy(o, cache.data<char>(), out.nbytes());
        } else if (isz == 4) {
          std::vector<float> t4;
          std::memcpy(o, dense<float>(cache, t4), out.nbytes());
        } else {
          std::vector<uint16_t> t2;
          std::memcpy(o, dense<uint16_t>(cache, t2), out.nbytes());
        }
      }
      std::vector<int32_t> ts;
      const int32_t* slots = dense<int32_t>(sl, ts);
      const char* src = nw.data<char>();
      const auto& st = nw.strides();
      for (int b = 0; b < B; ++b)
        for (int t = 0; t < T; ++t) {
          const int64_t slot = slots[static_cast<int64_t>(b) * T + t];
          if (slot < 0 || slot >= S) continue;  // never produced by the cache's geometry
          for (int h = 0; h < H; ++h) {
            char* dst = o + (((static_cast<int64_t>(b) * H + h) * S + slot) * D) * isz;
            const char* from = src + (b * st[0] + h * st[1] + t * st[2]) * static_cast<int64_t>(isz);
            if (st[3] == 1) {
              std::memcpy(dst, from, D * isz);
            } else {
              for (int64_t d = 0; d < D; ++d)
                std::memcpy(dst + d * isz, from + d * st[3] * static_cast<int64_t>(isz), isz);
            }
          }
        }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("fx_engine native kernels run on the CPU only");
  }
  const char* name() const override { return "FxKvPut"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }
};

class Swiglu : public CpuKernel {
 public:
  explicit Swiglu(mx::Stream s) : CpuKernel(s) {}
  std::function<void()> task(const std::vector<mx::array>& in, mx::array out) const override {
    return [x = in[0], out]() mutable {
      std::vector<float> tx;
      const int F = static_cast<int>(out.shape(-1));
      swiglu_cpu(dense(x, tx), out.data<float>(), static_cast<int64_t>(out.size() / std::max(F, 1)), F);
    };
  }
  const char* name() const override { return "FxSwiglu"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto shape = in[0].shape();
    shape.back() /= 2;
    return {shape};
  }
};

class Attend : public CpuKernel {
 public:
  Attend(mx::Stream s, float scale) : CpuKernel(s), scale_(scale) {}
  std::function<void()> task(const std::vector<mx::array>& in, mx::array out) const override {
    return [q = in[0], k = in[1], v = in[2], m = in[3], out, scale = scale_]() mutable {
      std::vector<float> tq;
      std::vector<uint8_t> tm;
      const int B = q.shape(0), T = q.shape(1), Hq = q.shape(2), D = q.shape(3);
      const int Hk = k.shape(1), S = k.shape(2);
      // K and V are read through their strides (a span slice of the cache is a view):
      // only the head dimension must be contiguous, else they are copied here. (Strides
      // exist only once an array is evaluated, so this is decided here, not when the
      // graph is built.)
      auto run = [&](auto tag) {
        using E = decltype(tag);
        std::vector<E> tk, tv;
        auto view = [S, D, Hk](const mx::array& a, std::vector<E>& tmp) {
          if (a.strides()[3] != 1) {
            const E* p = dense<E>(a, tmp);
            return Strided4<E>{p, static_cast<int64_t>(Hk) * S * D, static_cast<int64_t>(S) * D, D};
          }
          return Strided4<E>{a.data<E>(), static_cast<int64_t>(a.strides()[0]),
                             static_cast<int64_t>(a.strides()[1]), static_cast<int64_t>(a.strides()[2])};
        };
        // A few query tokens (decode, verify): attend; many (prefill): attend_prefill.
        (T <= ATTEND_MAX_T ? attend_cpu<E> : attend_prefill_cpu<E>)(
            dense(q, tq), view(k, tk), view(v, tv), dense<uint8_t>(m, tm), scale,
            out.data<float>(), B, T, Hq, Hk, S, D);
      };
      if (k.dtype() == mx::float16)
        run(uint16_t{});
      else
        run(float{});
    };
  }
  const char* name() const override { return "FxAttend"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const Attend&>(other).scale_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {mx::Shape{in[0].shape(0), in[0].shape(1), in[0].shape(2) * in[0].shape(3)}};
  }

 private:
  float scale_;
};

mx::array attend(const mx::array& q, const mx::array& k, const mx::array& v,
                 const mx::array& mask, float scale) {
  const std::string p = "attend: ";
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    throw std::invalid_argument(p + "q must be [B, T, Hq, D] and k, v [B, Hk, S, D]");
  if (q.dtype() != mx::float32 || k.dtype() != v.dtype() ||
      (k.dtype() != mx::float32 && k.dtype() != mx::float16))
    throw std::invalid_argument(p + "q must be float32, and k and v both float32 or both float16");
  const int B = q.shape(0), T = q.shape(1), Hq = q.shape(2), D = q.shape(3);
  if (k.shape() != v.shape() || k.shape(0) != B || k.shape(3) != D || k.shape(1) == 0 ||
      Hq % k.shape(1) != 0)
    throw std::invalid_argument(p + "k and v must be [B, Hk, S, D] with Hq a multiple of Hk");
  if (D == 0 || D % 16 != 0)
    throw std::invalid_argument(p + "head_dim must be a positive multiple of 16");
  if (mask.ndim() != 3 || mask.dtype() != mx::bool_ || mask.shape(0) != B ||
      mask.shape(1) != T || mask.shape(2) != k.shape(2))
    throw std::invalid_argument(p + "mask must be bool [B, T, S]");
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  return mx::array(mx::Shape{B, T, Hq * D}, mx::float32, std::make_shared<Attend>(s, scale),
                   {q, k, v, mask});
}

class Rope : public CpuKernel {
 public:
  Rope(mx::Stream s, bool traditional) : CpuKernel(s), traditional_(traditional) {}
  std::function<void()> task(const std::vector<mx::array>& in, mx::array out) const override {
    return [x = in[0], c = in[1], sn = in[2], out, trad = traditional_]() mutable {
      std::vector<float> tx, tc, ts;
      const int D = x.shape(-1), H = x.shape(-2);
      rope_cpu(dense(x, tx), dense(c, tc), dense(sn, ts), out.data<float>(),
               static_cast<int64_t>(x.size() / (static_cast<int64_t>(H) * D)), H, D, trad);
    };
  }
  const char* name() const override { return "FxRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return traditional_ == static_cast<const Rope&>(other).traditional_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }

 private:
  bool traditional_;
};

mx::array rope(const mx::array& x, const mx::array& cos, const mx::array& sin, bool traditional) {
  if (x.ndim() != 4 || x.dtype() != mx::float32)
    throw std::invalid_argument("rope: x must be float32 [B, T, H, D]");
  const auto want = mx::Shape{x.shape(0), x.shape(1), 1, x.shape(3)};
  if (cos.shape() != want || sin.shape() != want || cos.dtype() != mx::float32 ||
      sin.dtype() != mx::float32)
    throw std::invalid_argument("rope: cos and sin must be float32 [B, T, 1, D]");
  if (x.shape(3) % 2 != 0) throw std::invalid_argument("rope: head_dim must be even");
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(s, traditional), {x, cos, sin});
}

mx::array masked_softmax(const mx::array& scores, const mx::array& mask) {
  if (scores.ndim() != 4 || scores.dtype() != mx::float32)
    throw std::invalid_argument("masked_softmax: scores must be float32 [B, H, T, S]");
  if (mask.ndim() != 3 || mask.dtype() != mx::bool_ || mask.shape(0) != scores.shape(0) ||
      mask.shape(1) != scores.shape(2) || mask.shape(2) != scores.shape(3))
    throw std::invalid_argument("masked_softmax: mask must be bool [B, T, S]");
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  return mx::array(scores.shape(), mx::float32, std::make_shared<MaskedSoftmax>(s),
                   {scores, mask});
}

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  if (x.ndim() < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1) || w.shape(0) == 0)
    throw std::invalid_argument("rms_norm: weight must be [D] for x [..., D], D > 0");
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  const auto dt = x.dtype();
  auto y = mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps),
                     {mx::astype(x, mx::float32, s), mx::astype(w, mx::float32, s)});
  return dt == mx::float32 ? y : mx::astype(y, dt, s);
}

mx::array kv_put(const mx::array& cache, const mx::array& nw, const mx::array& slots) {
  const auto dt = cache.dtype();
  if (cache.ndim() != 4 || (dt != mx::float32 && dt != mx::float16))
    throw std::invalid_argument("kv_put: cache must be float32 or float16 [B, H, S, D]");
  if (nw.ndim() != 4 || nw.shape(0) != cache.shape(0) || nw.shape(1) != cache.shape(1) ||
      nw.shape(3) != cache.shape(3))
    throw std::invalid_argument("kv_put: new must be [B, H, T, D] for the cache's B, H, D");
  if (slots.ndim() != 2 || slots.shape(0) != cache.shape(0) || slots.shape(1) != nw.shape(2))
    throw std::invalid_argument("kv_put: slots must be [B, T] for new [B, H, T, D]");
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  return mx::array(cache.shape(), dt, std::make_shared<KvPut>(s),
                   {cache, mx::astype(nw, dt, s), mx::astype(slots, mx::int32, s)});
}

mx::array swiglu(const mx::array& gu) {
  if (gu.ndim() < 1 || gu.shape(-1) % 2 != 0 || gu.shape(-1) == 0)
    throw std::invalid_argument("swiglu: gu must be [..., 2F] (gate | up), F > 0");
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  const auto dt = gu.dtype();
  auto shape = gu.shape();
  shape.back() /= 2;
  auto y = mx::array(shape, mx::float32, std::make_shared<Swiglu>(s),
                     {mx::astype(gu, mx::float32, s)});
  return dt == mx::float32 ? y : mx::astype(y, dt, s);
}

void check_quantized(const char* op, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, int group_size, int bits) {
  const std::string p = op;
  if (bits != 4 && bits != 8)
    throw std::invalid_argument(p + ": bits must be 4 or 8, got " + std::to_string(bits));
  if (group_size <= 0 || group_size % 32 != 0)
    throw std::invalid_argument(p + ": group_size must be a multiple of 32, got " +
                                std::to_string(group_size));
  if (w.ndim() != 2 || w.dtype() != mx::uint32)
    throw std::invalid_argument(p + ": w must be a 2-D uint32 array");
  const int K = static_cast<int>(w.shape(1)) * 32 / bits;
  if (K == 0) throw std::invalid_argument(p + ": the input size must be positive");
  if (K % group_size != 0)
    throw std::invalid_argument(p + ": the input size must be a multiple of group_size");
  if (scales.ndim() != 2 || scales.shape(0) != w.shape(0) || scales.shape(1) != K / group_size ||
      biases.shape() != scales.shape())
    throw std::invalid_argument(p + ": scales/biases must have shape [N, K / group_size]");
}

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits) {
  check_quantized("dequantize", w, scales, biases, group_size, bits);
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  const int K = static_cast<int>(w.shape(1)) * 32 / bits;
  return mx::array(mx::Shape{w.shape(0), K}, mx::float32,
                   std::make_shared<Dequantize>(s, group_size, bits),
                   {w, mx::astype(scales, mx::float32, s), mx::astype(biases, mx::float32, s)});
}

mx::array quantized_product(const char* op, int kind, const mx::array& x, const mx::array& w,
                            const mx::array& scales, const mx::array& biases, int group_size,
                            int bits) {
  check_quantized(op, w, scales, biases, group_size, bits);
  const int K = static_cast<int>(w.shape(1)) * 32 / bits;
  if (x.ndim() < 1 || x.shape(-1) != K)
    throw std::invalid_argument(std::string(op) + ": x's last axis (" + std::to_string(x.shape(-1)) +
                                ") must equal the weight's input size (" + std::to_string(K) +
                                ")");
  const int N = static_cast<int>(w.shape(0));
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  const auto dt = x.dtype();
  // astype is a no-op (no graph node) when the dtype already matches.
  auto xc = mx::astype(x, mx::float32, s);
  auto wc = w;
  auto sc = mx::astype(scales, mx::float32, s);
  auto bc = mx::astype(biases, mx::float32, s);
  auto shape = x.shape();
  shape.back() = N;
  auto y = mx::array(shape, mx::float32,
                     std::make_shared<QMatmul>(s, group_size, bits, kind),
                     {xc, wc, sc, bc});
  return dt == mx::float32 ? y : mx::astype(y, dt, s);
}

mx::array qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
              const mx::array& biases, int group_size, int bits) {
  return quantized_product("qmm", 0, x, w, scales, biases, group_size, bits);
}

mx::array qgemm(const mx::array& x, const mx::array& w, const mx::array& scales,
                const mx::array& biases, int group_size, int bits) {
  return quantized_product("qgemm", 1, x, w, scales, biases, group_size, bits);
}

mx::array qmm_a8(const mx::array& x, const mx::array& w, const mx::array& scales,
                 const mx::array& biases, int group_size, int bits) {
  return quantized_product("qmm_a8", 2, x, w, scales, biases, group_size, bits);
}

}  // namespace

NB_MODULE(_fx_native, m) {
  m.doc() = "fx-engine native CPU kernels (MLX primitives)";
  m.def("qmm", &qmm, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"),
        "x[..., K] @ dequantize(w, scales, biases)[N, K].T -> [..., N] (float32 math)");
  m.def("qgemm", &qgemm, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"),
        "qmm's product with the many-rows kernel (another fixed summation order)");
  m.def("qmm_a8", &qmm_a8, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"),
        "the product with x rounded to 8 bits per weight group (int8 dot products)");
#if defined(__AVX512VNNI__) || defined(FX_A8_AVX2)
  m.attr("int8_dot") = true;  // qmm_a8 runs int8 dot products (VNNI or AVX2; else a scalar loop)
#else
  m.attr("int8_dot") = false;
#endif
  m.def("dequantize", &dequantize, nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), "affine dequantization -> float32 [N, K]");
  m.def("masked_softmax", &masked_softmax, nb::arg("scores"), nb::arg("mask"),
        "softmax over the last axis of float32 scores [B, H, T, S] where bool mask [B, T, S]");
  m.def("attend", &attend, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("mask"),
        nb::arg("scale"), "GQA attention of q [B, T, Hq, D] over k, v [B, Hk, S, D] -> [B, T, Hq*D]");
  m.def("rope", &rope, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("traditional"),
        "x * cos + partner(x) * sin for x [B, T, H, D], tables [B, T, 1, D]");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("swiglu", &swiglu, nb::arg("gu"));
  m.def("kv_put", &kv_put, nb::arg("cache"), nb::arg("new"), nb::arg("slots"));
#if defined(__AVX512F__)
  m.attr("tiled_gemm") = true;  // qgemm's register tile fits (see qgemm_cpu)
#else
  m.attr("tiled_gemm") = false;
#endif
#if defined(__AVX512F__) || defined(FX_AVX2)
  m.attr("few_gemm") = true;  // qgemm has its few-row path (up to QG_FEW rows)
#else
  m.attr("few_gemm") = false;
#endif
  m.attr("isa") = nb::str(
#if defined(__AVX512F__)
      "avx512"
#elif defined(FX_AVX2)
      "avx2"
#elif defined(__ARM_NEON)
      "neon"
#else
      "generic"
#endif
  );
  m.def("set_num_threads", [](int n) { pool().resize(n); }, nb::arg("n"));
  m.def("num_threads", [] { return pool().size(); });
}
