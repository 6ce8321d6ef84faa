// fx-engine's native CPU kernels, as MLX primitives (graph nodes that mx.compile keeps).
//
// Why this file exists: on the Linux CPU backend MLX's quantized matmul is a naive
// one-core kernel (~0.5 GB/s of packed weights), its attention, softmax and RMSNorm are
// chains of unfused ops, and every graph node costs microseconds. The kernels here are
// the hot loops of LLM inference on a CPU, each one node:
//
//   qmm:        y[M, N] = x[M, K] @ dequantize(w)[N, K].T for MLX's affine-quantized
//               weights (4 or 8 bits, group a multiple of 32: what GGUF Q4_0/Q4_1/Q8_0 and
//               mlx-community models load as; 5 and 6 bits, GGUF's Q5_0/Q5_K/Q6_K, are
//               unpacked to bytes a block of rows at a time and run as 8; 5, 6 and 8 bits
//               also in groups of 16, Q6_K's). Four weight rows are dequantized into an
//               L1 buffer once and reused by every activation row, so a decode step
//               streams the packed bytes and a batch of rows shares one pass over them.
//   qgemm:      the same product for many rows (prefill chunks, wide decode batches):
//               register tiles of 12 features x 32 rows, vectors along the rows, each
//               dequantized weight broadcast; FMA-bound, ~2x qmm from ~16 rows up. Up to
//               16 rows (decode), vectors along 16 features dequantized in registers:
//               the same bits at every row count, ~2x qmm at 8 rows (AVX-512 builds).
//   gather_qmm: a stacked expert tensor's products (mixture-of-experts layers): the
//               (token, expert) pairs grouped by expert, each group through qmm, qgemm or
//               qmm_a8 on its expert's matrix (only the chosen experts' bytes are read).
//   qmm_a8:     the product with each activation row rounded to 8 bits per weight group
//               (opt-in numerics, as llama.cpp's): exact int8 dot products (AVX-512
//               VNNI, AVX2 vpmaddubsw; above 32 rows AMX tile multiplies where the CPU
//               and the kernel allow them), no float copy of the weights; 2-3x qmm/qgemm
//               from 8 rows up.
//   (Quant and biases come as float32, float16, bfloat16, or in GGUF's K-quant two-level
//   form: scales.h. Each decodes to the same float32 values, so the same bits.)
//   dequantize: the same values as mx.dequantize, from the same code qmm and qgemm
//               unpack their weights with (fx_engine.nn runs a BLAS GEMM on it where
//               fx_engine.native.plan measures that faster).
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
//
// Layout: this file holds the MLX primitives and the Python bindings; the kernels live in
// one header per family beside it (simd.h, pool.h, scales.h, qmatmul.h, amx.h, qmm_a8.h, attention.h,
// pointwise.h), included below as one translation unit. build.py's cache key hashes
// every source file of this folder.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
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
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>  // arch_prctl: the AMX tile state is granted per process (amx.h)
#include <unistd.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
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

// The kernel families, in dependency order (one translation unit):
#include "simd.h"       // the v16 vector type and per-ISA primitives
#include "pool.h"       // the thread pool
#include "scales.h"     // group scales and biases: float32, float16, bfloat16, two-level
#include "qmatmul.h"    // dequantize, qmm, qgemm
#include "qmm_a8.h"     // qmm_a8 (8-bit activations; its AMX tiles: amx.h, included there)
#include "attention.h"  // masked_softmax, attend
#include "pointwise.h"  // rms_norm, swiglu, rope

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

// The Quant view of a quantized product's scales and biases inputs (made row-contiguous
// into ts / tb when strided), in the format scale_format chose.
inline Quant scales_of(const mx::array& s, const mx::array& b, int fmt, int groups, int wbits,
                        std::vector<float>& ts, std::vector<float>& tb,
                        std::vector<uint16_t>& hs, std::vector<uint16_t>& hb) {
  if (fmt == SF_F32) return Quant{dense(s, ts), dense(b, tb), fmt, groups, 1, wbits};
  if (fmt == SF_F16M) return Quant{dense(s, hs), dense(b, tb), fmt, groups, 1, wbits};
  // (int16 codes are read through their 16 bits, like the halves)
  const int sb = two_level_fmt(fmt) ? groups / static_cast<int>(b.shape(-2)) : 1;
  if (fmt == SF_KQ1) {  // (int8 codes: a strided view copied byte by byte)
    thread_local std::vector<int8_t> bs;
    return Quant{dense(s, bs), dense(b, hb), fmt, groups, sb, wbits};
  }
  return Quant{dense(s, hs), dense(b, hb), fmt, groups, sb, wbits};
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

// kind: 0 qmm, 1 qgemm, 2 qmm_a8 (three kernels for one product; see each), 3 qmm_a8 on an
// interleaved weight (qmm_a8.h: il16_index).
class QMatmul : public CpuKernel {
 public:
  QMatmul(mx::Stream s, int group_size, int bits, int kind, int fmt, bool add = false)
      : CpuKernel(s), gs_(group_size), bits_(bits), kind_(kind), fmt_(fmt), add_(add) {}

  std::function<void()> task(const std::vector<mx::array>& in, mx::array out) const override {
    auto product = product_task(in, out);
    if (!add_) return product;
    // out = c + product: the product first, then one add an element (a residual branch's
    // last projection: the bits of the separate add, without its graph node)
    return [product = std::move(product), c = in[4], out]() mutable {
      product();
      std::vector<float> tc;
      const float* cp = dense(c, tc);
      float* o = out.data<float>();
      for (size_t i = 0; i < out.size(); ++i) o[i] = cp[i] + o[i];
    };
  }

  std::function<void()> product_task(const std::vector<mx::array>& in, mx::array out) const {
    return [x = in[0], w = in[1], s = in[2], b = in[3], out, gs = gs_, bits = bits_,
            kind = kind_, fmt = fmt_]() mutable {
      const int K = static_cast<int>(x.shape(-1));
      const int M = static_cast<int>(x.size() / K);
      const int N = static_cast<int>(out.shape(-1));
      std::vector<uint32_t> tw;
      std::vector<float> tx, ts, tb;
      std::vector<uint16_t> hs, hb;
      const Quant sc = scales_of(s, b, fmt, K / gs, bits, ts, tb, hs, hb);
      if (kind >= 2)  // 3: the weight interleaved (qmm_a8.h's il16_index)
        return qmm_a8_cpu(dense(x, tx), M, K, dense(w, tw), sc, gs, bits, out.data<float>(), N, kind == 3);
      auto* f = kind == 1 ? qgemm_cpu : qmm_cpu;
      f(dense(x, tx), M, K, dense(w, tw), sc, gs, bits, out.data<float>(), N);
    };
  }
  const char* name() const override {
    return kind_ == 3 ? "FxQMatmulA8Interleaved" : kind_ == 2 ? "FxQMatmulA8" : kind_ == 1 ? "FxQGemm" : "FxQMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QMatmul&>(other);
    return gs_ == o.gs_ && bits_ == o.bits_ && kind_ == o.kind_ && fmt_ == o.fmt_ && add_ == o.add_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto shape = in[0].shape();
    shape.back() = in[1].shape(0);
    return {shape};
  }

 private:
  int gs_, bits_, kind_, fmt_;
  bool add_;
};

// A stacked expert tensor's products (mixture-of-experts layers): out[t, j] = x[t, j or 0]
// @ W[idx[t, j]].T for x [T, X, K] (X = 1: each token's row for all its experts; X = k: a
// row per (token, expert) pair), idx [T, k], W [E, N, K] packed -> out [T, k, N]. The
// pairs are grouped by expert (a counting sort), then each expert's rows run through one
// of the 2-D kernels on that expert's matrix (kind as QMatmul's: 0 qmm, 1 qgemm, 2
// qmm_a8, 3 qmm_a8 on a stack interleaved per expert), so a decode step streams only the
// chosen experts' packed bytes, and a prefill chunk reads each chosen expert once for all
// its rows. Every kernel is batch-invariant,
// so a pair's result does not depend on which other pairs share its expert.
class GatherQMatmul : public CpuKernel {
 public:
  GatherQMatmul(mx::Stream s, int group_size, int bits, int kind, int fmt)
      : CpuKernel(s), gs_(group_size), bits_(bits), kind_(kind), fmt_(fmt) {}

  std::function<void()> task(const std::vector<mx::array>& in, mx::array out) const override {
    return [x = in[0], idx = in[1], w = in[2], s = in[3], b = in[4], out, gs = gs_, bits = bits_,
            kind = kind_, fmt = fmt_]() mutable {
      const int T = static_cast<int>(idx.shape(0)), k = static_cast<int>(idx.shape(1));
      const int X = static_cast<int>(x.shape(1)), K = static_cast<int>(x.shape(2));
      const int E = static_cast<int>(w.shape(0)), N = static_cast<int>(w.shape(1));
      const int64_t words = w.shape(2);
      std::vector<uint32_t> tw, ti;
      std::vector<float> tx, ts, tb;
      std::vector<uint16_t> hs, hb;
      const float* xp = dense(x, tx);
      const uint32_t* ip = dense(idx, ti);
      const uint32_t* wp = dense(w, tw);
      const Quant sc = scales_of(s, b, fmt, K / gs, bits, ts, tb, hs, hb);
      float* y = out.data<float>();
      // pairs grouped by expert, in pair order within each expert
      std::vector<int> start(E + 1, 0), order(static_cast<size_t>(T) * k);
      for (int p = 0; p < T * k; ++p) {
        if (ip[p] >= static_cast<uint32_t>(E)) {  // (a router picks among E: never; say so loudly)
          std::fill(y, y + out.size(), std::nanf(""));
          return;
        }
        ++start[ip[p] + 1];
      }
      for (int e = 0; e < E; ++e) start[e + 1] += start[e];
      std::vector<int> fill(start.begin(), start.end() - 1);
      for (int p = 0; p < T * k; ++p) order[fill[ip[p]]++] = p;
      std::vector<float> xe, ye;
      for (int e = 0; e < E; ++e) {
        const int m = start[e + 1] - start[e];
        if (m == 0) continue;
        xe.resize(static_cast<size_t>(m) * K);
        ye.resize(static_cast<size_t>(m) * N);
        for (int i = 0; i < m; ++i) {
          const int p = order[start[e] + i];
          const int64_t row = X == 1 ? p / k : p;
          std::memcpy(xe.data() + static_cast<int64_t>(i) * K, xp + row * K, sizeof(float) * K);
        }
        const uint32_t* we = wp + static_cast<int64_t>(e) * N * words;
        const Quant qe = sc.at_row(static_cast<int64_t>(e) * N);
        if (kind >= 2)  // 3: the stack interleaved per expert (interleave16 / planes of each matrix)
          qmm_a8_cpu(xe.data(), m, K, we, qe, gs, bits, ye.data(), N, kind == 3);
        else
          (kind == 1 ? qgemm_cpu : qmm_cpu)(xe.data(), m, K, we, qe, gs, bits, ye.data(), N);
        for (int i = 0; i < m; ++i)
          std::memcpy(y + static_cast<int64_t>(order[start[e] + i]) * N,
                      ye.data() + static_cast<int64_t>(i) * N, sizeof(float) * N);
      }
    };
  }
  const char* name() const override {
    return kind_ == 3 ? "FxGatherQMatmulA8IL" : kind_ == 2 ? "FxGatherQMatmulA8" : kind_ == 1 ? "FxGatherQGemm"
                                                                                        : "FxGatherQMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const GatherQMatmul&>(other);
    return gs_ == o.gs_ && bits_ == o.bits_ && kind_ == o.kind_ && fmt_ == o.fmt_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {mx::Shape{in[1].shape(0), in[1].shape(1), in[2].shape(1)}};
  }

 private:
  int gs_, bits_, kind_, fmt_;
};

class Dequantize : public CpuKernel {
 public:
  Dequantize(mx::Stream s, int group_size, int bits, int fmt)
      : CpuKernel(s), gs_(group_size), bits_(bits), fmt_(fmt) {}

  std::function<void()> task(const std::vector<mx::array>& in, mx::array out) const override {
    return [w = in[0], s = in[1], b = in[2], out, gs = gs_, bits = bits_, fmt = fmt_]() mutable {
      std::vector<uint32_t> tw;
      std::vector<float> ts, tb;
      std::vector<uint16_t> hs, hb;
      const int K = static_cast<int>(out.shape(1));
      dequant_cpu(dense(w, tw), scales_of(s, b, fmt, K / gs, bits, ts, tb, hs, hb), gs, bits,
                  out.data<float>(), static_cast<int>(out.shape(0)), K);
    };
  }
  const char* name() const override { return "FxDequantize"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Dequantize&>(other);
    return gs_ == o.gs_ && bits_ == o.bits_ && fmt_ == o.fmt_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {mx::Shape{in[0].shape(0), static_cast<int>(in[0].shape(1)) * 32 / bits_}};
  }

 private:
  int gs_, bits_, fmt_;
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

// An output that takes over a donatable cache input's buffer (the step holds the only
// reference: the cache write is in place, as MLX's own scatter does) or gets a fresh one;
// true when donated (the cache writes: KvPut, QkvPart).
inline bool take_or_alloc(const mx::array& cache, mx::array& out) {
  if (cache.flags().row_contiguous && cache.is_donatable() && cache.itemsize() == out.itemsize()) {
    out.copy_shared_buffer(cache);
    return true;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return false;
}

// A cache's row-contiguous copy into out (when its buffer could not be taken over).
inline void copy_cache(const mx::array& cache, mx::array& out) {
  if (cache.flags().row_contiguous) {
    std::memcpy(out.data<char>(), cache.data<char>(), out.nbytes());
  } else if (cache.itemsize() == 4) {
    std::vector<float> t;
    std::memcpy(out.data<char>(), dense<float>(cache, t), out.nbytes());
  } else {
    std::vector<uint16_t> t;
    std::memcpy(out.data<char>(), dense<uint16_t>(cache, t), out.nbytes());
  }
}

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
    const bool donated = take_or_alloc(cache, out);
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
      if (!donated) copy_cache(cache, out);  // an independent copy of the cache first
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

// qkv_rope_put: an attention layer's inputs from its fused projection, in three nodes.
// qkv [B*T, (Hq + 2 Hk) * D] (q | k | v heads, as the fused projection returns them),
// tables cos / signed sin [B, T, 1, D], caches keys / values [B, Hk, S, D] (float32 or
// float16), slots [B, T] -> q [B, T, Hq, D] rotated, and the caches with the rotated k and
// v written at the slots (in place when donatable; slots outside [0, S) skipped). The same
// values as reshape, slices, rope (rope_cpu: the same expression), transposes, astypes and
// two kv_puts: ten graph nodes a layer, each several microseconds of MLX's scheduling on
// the CPU, where the work itself is a few hundred values a token. One node per output
// (part 0: q, 1: keys, 2: values), not one node with three: MLX gives each output of a
// multi-output node its own reference to the inputs, so a cache input could never be
// donated (written in place) there.
class QkvPart : public mx::UnaryPrimitive {
 public:
  QkvPart(mx::Stream s, int part, int hq, bool traditional)
      : mx::UnaryPrimitive(s), part_(part), hq_(hq), trad_(traditional) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    // q: a fresh buffer; keys / values: the cache's own where it can be taken over
    const bool donated = part_ != 0 && take_or_alloc(in[0], out);
    if (part_ == 0) out.set_data(mx::allocator::malloc(out.nbytes()));
    if (out.size() == 0) return;
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    if (part_ == 0) {
      enc.dispatch([qkv = in[0], c = in[1], sn = in[2], out, hq = hq_, trad = trad_]() mutable {
        const int D = static_cast<int>(out.shape(3));
        const int64_t N = static_cast<int64_t>(out.shape(0)) * out.shape(1);
        const int64_t W = qkv.shape(1);
        std::vector<float> tx, tc, ts;
        const float* x = dense(qkv, tx);
        const float* cp = dense(c, tc);
        const float* sp = dense(sn, ts);
        for (int64_t n = 0; n < N; ++n)
          rope_cpu(x + n * W, cp + n * D, sp + n * D, out.data<float>() + n * hq * D, 1, hq, D, trad);
      });
      return;
    }
    // parts 1, 2: in = (cache, qkv, slots[, cos, sin])
    enc.dispatch([in, out, part = part_, hq = hq_, trad = trad_, donated]() mutable {
      const mx::array &cache = in[0], &qkv = in[1], &sl = in[2];
      if (!donated) copy_cache(cache, out);
      const int B = static_cast<int>(out.shape(0)), Hk = static_cast<int>(out.shape(1));
      const int64_t S = out.shape(2);
      const int D = static_cast<int>(out.shape(3));
      const int T = static_cast<int>(sl.shape(1));
      const int64_t W = qkv.shape(1);
      const int64_t off = static_cast<int64_t>(part == 1 ? hq : hq + Hk) * D;  // the k or v heads
      std::vector<float> tx, tc, ts, kr(static_cast<size_t>(Hk) * D);
      std::vector<int32_t> tsl;
      const float* x = dense(qkv, tx);
      const int32_t* slots = dense<int32_t>(sl, tsl);
      const float* cp = part == 1 ? dense(in[3], tc) : nullptr;
      const float* sp = part == 1 ? dense(in[4], ts) : nullptr;
      const bool half = out.itemsize() == 2;
      for (int64_t n = 0; n < static_cast<int64_t>(B) * T; ++n) {
        const int64_t slot = slots[n];
        if (slot < 0 || slot >= S) continue;  // never produced by the cache's geometry
        const float* src = x + n * W + off;
        if (part == 1) {  // k: rotated first
          rope_cpu(src, cp + n * D, sp + n * D, kr.data(), 1, Hk, D, trad);
          src = kr.data();
        }
        const int64_t b = n / T;
        for (int h = 0; h < Hk; ++h) {
          const int64_t at = ((b * Hk + h) * S + slot) * D;
          const float* sh = src + static_cast<int64_t>(h) * D;
          if (half) {
            uint16_t* dst = out.data<uint16_t>() + at;
            for (int d = 0; d < D; ++d) dst[d] = float_to_half(sh[d]);
          } else {
            std::memcpy(out.data<float>() + at, sh, sizeof(float) * D);
          }
        }
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("fx_engine native kernels run on the CPU only");
  }
  const char* name() const override {
    return part_ == 0 ? "FxQkvRopeQ" : part_ == 1 ? "FxQkvRopePutK" : "FxQkvPutV";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QkvPart&>(other);
    return part_ == o.part_ && hq_ == o.hq_ && trad_ == o.trad_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    if (part_ == 0) return {mx::Shape{in[1].shape(0), in[1].shape(1), hq_, in[1].shape(3)}};
    return {in[0].shape()};
  }

 private:
  int part_, hq_;
  bool trad_;
};

std::vector<mx::array> qkv_rope_put(const mx::array& qkv, const mx::array& cos, const mx::array& sin,
                                    bool traditional, int q_heads, const mx::array& keys,
                                    const mx::array& values, const mx::array& slots) {
  const std::string p = "qkv_rope_put: ";
  const auto dt = keys.dtype();
  if (keys.ndim() != 4 || (dt != mx::float32 && dt != mx::float16) || values.dtype() != dt ||
      values.shape() != keys.shape())
    throw std::invalid_argument(p + "keys and values must be float32 or float16 [B, Hk, S, D], alike");
  const int B = keys.shape(0), Hk = keys.shape(1), D = keys.shape(3);
  if (D == 0 || D % 2 != 0) throw std::invalid_argument(p + "head_dim must be even and positive");
  if (slots.ndim() != 2 || slots.shape(0) != B)
    throw std::invalid_argument(p + "slots must be [B, T] for the caches' B rows");
  const int T = slots.shape(1);
  if (q_heads <= 0 || Hk == 0 || q_heads % Hk != 0)
    throw std::invalid_argument(p + "q_heads must be a positive multiple of the caches' KV heads");
  if (qkv.ndim() != 2 || qkv.dtype() != mx::float32 || qkv.shape(0) != B * T ||
      qkv.shape(1) != (q_heads + 2 * Hk) * D)
    throw std::invalid_argument(p + "qkv must be float32 [B*T, (q_heads + 2 * Hk) * D]");
  const auto want = mx::Shape{B, T, 1, D};
  if (cos.shape() != want || sin.shape() != want || cos.dtype() != mx::float32 || sin.dtype() != mx::float32)
    throw std::invalid_argument(p + "cos and sin must be float32 [B, T, 1, D]");
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  const auto sl = mx::astype(slots, mx::int32, s);
  auto part = [&](int k) { return std::make_shared<QkvPart>(s, k, q_heads, traditional); };
  return {mx::array(mx::Shape{B, T, q_heads, D}, mx::float32, part(0), {qkv, cos, sin}),
          mx::array(keys.shape(), dt, part(1), {keys, qkv, sl, cos, sin}),
          mx::array(values.shape(), dt, part(2), {values, qkv, sl})};
}

// add_rms_norm: (h + a, rms_norm(h + a) * w) in one node: a residual add and the next
// branch's pre-norm (the sum as MLX's add computes it, the norm as rms_norm's).
class AddRmsNorm : public mx::Primitive {
 public:
  AddRmsNorm(mx::Stream s, float eps) : mx::Primitive(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    for (auto& o : outs) o.set_data(mx::allocator::malloc(o.nbytes()));
    if (outs[0].size() == 0) return;
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    for (auto& o : outs) enc.set_output_array(o);
    enc.dispatch([h = in[0], a = in[1], w = in[2], sum = outs[0], y = outs[1], eps = eps_]() mutable {
      std::vector<float> th, ta, tw;
      const float* hp = dense(h, th);
      const float* ap = dense(a, ta);
      float* sp = sum.data<float>();
      for (size_t i = 0; i < sum.size(); ++i) sp[i] = hp[i] + ap[i];
      const int D = static_cast<int>(sum.shape(-1));
      rms_norm_cpu(sp, dense(w, tw), eps, y.data<float>(), static_cast<int64_t>(sum.size() / D), D);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("fx_engine native kernels run on the CPU only");
  }
  const char* name() const override { return "FxAddRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const AddRmsNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape(), in[0].shape()};
  }

 private:
  float eps_;
};

std::vector<mx::array> add_rms_norm(const mx::array& h, const mx::array& a, const mx::array& w, float eps) {
  if (h.ndim() < 1 || h.dtype() != mx::float32 || a.dtype() != mx::float32 || a.shape() != h.shape())
    throw std::invalid_argument("add_rms_norm: h and a must be float32 arrays of one shape");
  if (w.ndim() != 1 || w.shape(0) != h.shape(-1) || w.shape(0) == 0)
    throw std::invalid_argument("add_rms_norm: weight must be [D] for h [..., D], D > 0");
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  return mx::array::make_arrays({h.shape(), h.shape()}, {mx::float32, mx::float32},
                                std::make_shared<AddRmsNorm>(s, eps), {h, a, mx::astype(w, mx::float32, s)});
}

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
  Attend(mx::Stream s, float scale, bool flat) : CpuKernel(s), scale_(scale), flat_(flat) {}
  std::function<void()> task(const std::vector<mx::array>& in, mx::array out) const override {
    return [q = in[0], k = in[1], v = in[2], m = in[3], out, scale = scale_]() mutable {
      std::vector<float> tq;
      std::vector<uint8_t> tm;
      const int B = q.shape(0), T = q.shape(1), Hq = q.shape(2), D = q.shape(3);
      // The first S = mask's slots of K and V are read (they may hold more: the whole
      // cache, no span slice in the graph), through their strides: only the head
      // dimension must be contiguous, else they are copied here. (Strides exist only once
      // an array is evaluated, so this is decided here, not when the graph is built.)
      const int Hk = k.shape(1), S = m.shape(2);
      auto run = [&](auto tag) {
        using E = decltype(tag);
        std::vector<E> tk, tv;
        auto view = [D, Hk](const mx::array& a, std::vector<E>& tmp) {
          if (a.strides()[3] != 1) {
            const E* p = dense<E>(a, tmp);
            const int64_t Sa = a.shape(2);
            return Strided4<E>{p, static_cast<int64_t>(Hk) * Sa * D, Sa * D, D};
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
    auto& o = static_cast<const Attend&>(other);
    return scale_ == o.scale_ && flat_ == o.flat_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {attend_shape(in[0], flat_)};
  }
  static mx::Shape attend_shape(const mx::array& q, bool flat) {
    const int hd = q.shape(2) * q.shape(3);
    return flat ? mx::Shape{q.shape(0) * q.shape(1), hd} : mx::Shape{q.shape(0), q.shape(1), hd};
  }

 private:
  float scale_;
  bool flat_;
};

mx::array attend(const mx::array& q, const mx::array& k, const mx::array& v,
                 const mx::array& mask, float scale, bool flat) {
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
      mask.shape(1) != T || mask.shape(2) > k.shape(2))
    throw std::invalid_argument(p + "mask must be bool [B, T, S] with S at most k's slots");
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  return mx::array(Attend::attend_shape(q, flat), mx::float32, std::make_shared<Attend>(s, scale, flat),
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

// Whether scales are a two-level form's codes (scales.h SF_KQ: int16; SF_KQ1: int8).
inline bool two_level(const mx::array& scales) {
  return scales.dtype() == mx::int16 || scales.dtype() == mx::int8;
}

// The biases input of scales.h's SF_F16M form: float16 scales and, as the biases, the one
// float32 multiplier m of b = m * s (a [1] array, for every row: an expert stack's too).
inline bool biases_implied(const mx::array& scales, const mx::array& biases) {
  return scales.dtype() == mx::float16 && biases.dtype() == mx::float32 && biases.ndim() == 1 &&
         biases.size() == 1;
}

void check_quantized(const char* op, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, int group_size, int bits) {
  const std::string p = op;
  // 5 and 6 bits (GGUF's Q5_0/Q5_1/Q5_K, Q6_K) run on the 8-bit kernels, unpacked a block of
  // rows at a time (qmm_a8's too: bytes 0..31 / 0..63 in its u8 x s8 dot products)
  if (bits != 4 && bits != 8 && bits != 5 && bits != 6)
    throw std::invalid_argument(p + ": bits must be 4, 5, 6 or 8" +
                                ", got " + std::to_string(bits));
  // 5-, 6- and 8-bit weights also in groups of 16 (a GGUF's Q6_K; qmm_a8 rounds the
  // activations per group of 16 then)
  const bool g16 = bits >= 5 && group_size == 16;
  if (group_size <= 0 || (group_size % 32 != 0 && !g16))
    throw std::invalid_argument(p + ": group_size must be a multiple of 32" +
                                " (or 16 for 5, 6 and 8 bits), got " +
                                std::to_string(group_size));
  if (w.ndim() != 2 || w.dtype() != mx::uint32)
    throw std::invalid_argument(p + ": w must be a 2-D uint32 array");
  const int K = static_cast<int>(w.shape(1)) * 32 / bits;
  if (K == 0) throw std::invalid_argument(p + ": the input size must be positive");
  if (K % group_size != 0)
    throw std::invalid_argument(p + ": the input size must be a multiple of group_size");
  if (K % 32 != 0)  // (the kernels step through K 32 values at a time)
    throw std::invalid_argument(p + ": the input size must be a multiple of 32, got " + std::to_string(K));
  if (static_cast<int64_t>(K) * bits != static_cast<int64_t>(w.shape(1)) * 32)
    throw std::invalid_argument(p + ": w's row of " + std::to_string(w.shape(1)) + " words is not a whole "
                                "number of " + std::to_string(bits) + "-bit values");
  if (scales.ndim() != 2 || scales.shape(0) != w.shape(0) || scales.shape(1) != K / group_size)
    throw std::invalid_argument(p + ": scales/biases must have shape [N, K / group_size]");
  if (two_level(scales)) {  // the two-level forms (scales.h SF_KQ, SF_KQ1)
    if (biases.dtype() != mx::float16 || biases.ndim() != 3 || biases.shape(0) != w.shape(0) ||
        biases.shape(2) != 2 || biases.shape(1) <= 0 || scales.shape(1) % biases.shape(1) != 0)
      throw std::invalid_argument(p + ": int16 / int8 (two-level) scales take float16 biases of shape "
                                      "[N, super-blocks, 2] dividing the groups");
    return;
  }
  if (biases_implied(scales, biases)) return;  // (scales.h SF_F16M)
  if (biases.shape() != scales.shape())
    throw std::invalid_argument(p + ": scales/biases must have shape [N, K / group_size]"
                                " (or float16 scales with one float32 multiplier as the biases)");
  for (const auto& a : {scales, biases})
    if (!mx::issubdtype(a.dtype(), mx::floating))
      throw std::invalid_argument(p + ": scales/biases must be floating point (or int16 / int8 two-level scales)");
}

// The storage format of a product's scales and biases (scales.h), and the arrays the
// kernel reads: float32, float16 or bfloat16 pairs as they are, the two-level form as it
// is, any other mix converted to float32 in the graph.
int scale_format(mx::array& scales, mx::array& biases, mx::Stream s) {
  if (scales.dtype() == mx::int16) return SF_KQ;
  if (scales.dtype() == mx::int8) return SF_KQ1;
  if (biases_implied(scales, biases)) return SF_F16M;
  if (scales.dtype() == biases.dtype()) {
    if (scales.dtype() == mx::float32) return SF_F32;
    if (scales.dtype() == mx::float16) return SF_F16;
    if (scales.dtype() == mx::bfloat16) return SF_BF16;
  }
  scales = mx::astype(scales, mx::float32, s);
  biases = mx::astype(biases, mx::float32, s);
  return SF_F32;
}

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits) {
  check_quantized("dequantize", w, scales, biases, group_size, bits);
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  const int K = static_cast<int>(w.shape(1)) * 32 / bits;
  auto sc = scales, bc = biases;
  const int fmt = scale_format(sc, bc, s);
  return mx::array(mx::Shape{w.shape(0), K}, mx::float32,
                   std::make_shared<Dequantize>(s, group_size, bits, fmt), {w, sc, bc});
}

mx::array quantized_product(const char* op, int kind, const mx::array& x, const mx::array& w,
                            const mx::array& scales, const mx::array& biases, int group_size,
                            int bits, const std::optional<mx::array>& add) {
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
  auto sc = scales, bc = biases;
  const int fmt = scale_format(sc, bc, s);
  auto shape = x.shape();
  shape.back() = N;
  if (add) {
    if (dt != mx::float32 || add->dtype() != mx::float32 || add->shape() != shape)
      throw std::invalid_argument(std::string(op) + ": add must be float32 of the product's shape, "
                                  "with float32 x");
    return mx::array(shape, mx::float32, std::make_shared<QMatmul>(s, group_size, bits, kind, fmt, true),
                     {xc, wc, sc, bc, *add});
  }
  auto y = mx::array(shape, mx::float32,
                     std::make_shared<QMatmul>(s, group_size, bits, kind, fmt),
                     {xc, wc, sc, bc});
  return dt == mx::float32 ? y : mx::astype(y, dt, s);
}

// Whether a [N, K] matrix of `bits` can be read interleaved by qmm_a8: N a multiple of 16,
// 4 or 8 bits (words: K a multiple of 32 values' worth of 4 words), or 5 / 6 bits as planes
// (K a multiple of 32) where the build has that path.
bool il_layout_ok(int bits, int K, int N) {
  if (N % 16 != 0) return false;
#if defined(FX_A8_PLANES)
  if (bits == 5 || bits == 6) return K % 32 == 0;
#endif
  return (bits == 4 || bits == 8) && (int64_t{K} * bits) % 128 == 0;
}

mx::array gather_qmm(const mx::array& x, const mx::array& indices, const mx::array& w,
                     const mx::array& scales, const mx::array& biases, int group_size, int bits,
                     int kind) {
  if (kind < 0 || kind > 3)
    throw std::invalid_argument("gather_qmm: kind must be 0 (qmm), 1 (qgemm), 2 (qmm_a8) or 3 (qmm_a8 on a stack "
                                "interleaved per expert)");
  const bool implied = biases_implied(scales, biases);  // (one multiplier for the stack)
  if (w.ndim() != 3 || scales.ndim() != 3 || scales.shape(0) != w.shape(0) ||
      (!implied && (biases.shape(0) != w.shape(0) || biases.ndim() != (two_level(scales) ? 4 : 3))))
    throw std::invalid_argument("gather_qmm: w, scales and biases must be stacked [E, N, ...] "
                                "(biases [E, N, super-blocks, 2] with int16 / int8 scales, [1] as float16 scales' "
                                "multiplier)");
  const int E = static_cast<int>(w.shape(0)), N = static_cast<int>(w.shape(1));
  // the checks of one expert's matrix hold for all (the same shapes): the stack as rows
  auto rows = [&](const mx::array& a) {
    auto shape = a.shape();
    shape.erase(shape.begin());
    shape[0] *= E;
    return mx::reshape(a, shape);
  };
  check_quantized("gather_qmm", rows(w), rows(scales), implied ? biases : rows(biases), group_size, bits);
  const int K = static_cast<int>(w.shape(2)) * 32 / bits;
  if (kind == 3 && !il_layout_ok(bits, K, N))
    throw std::invalid_argument("gather_qmm: an interleaved stack must have 4 or 8 bits (5 or 6 in planes where the "
                                "build has them: il_planes) and a multiple of 16 rows per expert");
  if (x.ndim() != 3 || x.shape(2) != K)
    throw std::invalid_argument("gather_qmm: x must be [T, 1 or k, K] with K = " + std::to_string(K) +
                                ", the experts' input size");
  if (indices.ndim() != 2 || indices.shape(0) != x.shape(0) ||
      (x.shape(1) != 1 && x.shape(1) != indices.shape(1)))
    throw std::invalid_argument("gather_qmm: indices must be [T, k] for x [T, 1 or k, K]");
  if (!mx::issubdtype(indices.dtype(), mx::integer))
    throw std::invalid_argument("gather_qmm: indices must be integers");
  const mx::Stream s = mx::to_stream(mx::Device(mx::Device::cpu));
  const auto dt = x.dtype();
  auto sc = scales, bc = biases;
  const int fmt = scale_format(sc, bc, s);
  auto y = mx::array(mx::Shape{indices.shape(0), indices.shape(1), N}, mx::float32,
                     std::make_shared<GatherQMatmul>(s, group_size, bits, kind, fmt),
                     {mx::astype(x, mx::float32, s), mx::astype(indices, mx::uint32, s), w, sc, bc});
  return dt == mx::float32 ? y : mx::astype(y, dt, s);
}

mx::array qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
              const mx::array& biases, int group_size, int bits, const std::optional<mx::array>& add) {
  return quantized_product("qmm", 0, x, w, scales, biases, group_size, bits, add);
}

mx::array qgemm(const mx::array& x, const mx::array& w, const mx::array& scales,
                const mx::array& biases, int group_size, int bits, const std::optional<mx::array>& add) {
  return quantized_product("qgemm", 1, x, w, scales, biases, group_size, bits, add);
}

mx::array qmm_a8(const mx::array& x, const mx::array& w, const mx::array& scales,
                 const mx::array& biases, int group_size, int bits, bool interleaved,
                 const std::optional<mx::array>& add) {
  if (interleaved && (w.ndim() != 2 || !il_layout_ok(bits, static_cast<int>(w.shape(1) * 32 / bits),
                                                     static_cast<int>(w.shape(0)))))
    throw std::invalid_argument("qmm_a8: an interleaved weight must have 4 or 8 bits (5 or 6 in planes where "
                                "the build has them: il_planes) and a multiple of 16 rows");
  return quantized_product("qmm_a8", interleaved ? 3 : 2, x, w, scales, biases, group_size, bits, add);
}

}  // namespace

NB_MODULE(_fx_native, m) {
  m.doc() = "fx-engine native CPU kernels (MLX primitives)";
  m.def("qmm", &qmm, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("add") = nb::none(),
        "x[..., K] @ dequantize(w, scales, biases)[N, K].T -> [..., N] (float32 math); "
        "add: a float32 [..., N] added to the product (add + product, in the same node)");
  m.def("qgemm", &qgemm, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("add") = nb::none(),
        "qmm's product with the many-rows kernel (another fixed summation order)");
  m.def("qmm_a8", &qmm_a8, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("interleaved") = false, nb::arg("add") = nb::none(),
        "the product with x rounded to 8 bits per weight group (int8 dot products); "
        "interleaved: w in 16-row blocks, word by word (fx_engine.core.kernels.interleave16)");
#if defined(__AVX512VNNI__) || defined(FX_A8_AVX2)
  m.attr("int8_dot") = true;  // qmm_a8 runs int8 dot products (VNNI or AVX2; else a scalar loop)
#else
  m.attr("int8_dot") = false;
#endif
#if defined(FX_A8_PLANES)
  m.attr("il_planes") = true;  // qmm_a8 reads 5-/6-bit weights interleaved as planes (interleave16_planes)
#else
  m.attr("il_planes") = false;
#endif
  m.attr("int8_dot_isa") = nb::str(  // which instructions qmm_a8's integer sums use
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
      "AVX-512 VNNI vpdpbusd"
#elif defined(FX_A8_AVX2) && defined(__AVXVNNI__)
      "AVX-VNNI vpdpbusd (ymm)"
#elif defined(FX_A8_AVX2)
      "AVX2 vpmaddubsw/vpmaddwd"
#else
      "a scalar loop"
#endif
  );
#if defined(FX_A8_AMX)
  m.def("amx", [] { return amx_on(); }, "whether qmm_a8's many-row tiles run on AMX (built, granted, not turned off)");
  m.def("set_amx", [](bool on) { amx_wanted() = on; }, nb::arg("on"),
        "use AMX where granted (the default; FX_ENGINE_AMX=0 starts with it off); the same bits either way");
#else
  m.def("amx", [] { return false; }, "whether qmm_a8's many-row tiles run on AMX (not built for it here)");
  m.def("set_amx", [](bool) {}, nb::arg("on"), "no AMX in this build: nothing to turn on or off");
#endif
  m.def("gather_qmm", &gather_qmm, nb::arg("x"), nb::arg("indices"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"), nb::arg("kind"),
        "stacked experts: x [T, 1 or k, K], indices [T, k] into w [E, N, K] -> [T, k, N]; "
        "kind 0 qmm, 1 qgemm, 2 qmm_a8, 3 qmm_a8 on a stack interleaved per expert (interleave16 of each matrix)");
  m.def("dequantize", &dequantize, nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), "affine dequantization -> float32 [N, K]");
  m.def("masked_softmax", &masked_softmax, nb::arg("scores"), nb::arg("mask"),
        "softmax over the last axis of float32 scores [B, H, T, S] where bool mask [B, T, S]");
  m.def("attend", &attend, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("mask"),
        nb::arg("scale"), nb::arg("flat") = false, "GQA attention of q [B, T, Hq, D] over the first S slots of k, v [B, Hk, >= S, D] "
        "(S: mask [B, T, S]) -> [B, T, Hq*D] ([B*T, Hq*D] if flat)");
  m.def("rope", &rope, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("traditional"),
        "x * cos + partner(x) * sin for x [B, T, H, D], tables [B, T, 1, D]");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("swiglu", &swiglu, nb::arg("gu"));
  m.def("kv_put", &kv_put, nb::arg("cache"), nb::arg("new"), nb::arg("slots"));
  m.def("qkv_rope_put", &qkv_rope_put, nb::arg("qkv"), nb::arg("cos"), nb::arg("sin"),
        nb::arg("traditional"), nb::arg("q_heads"), nb::arg("keys"), nb::arg("values"), nb::arg("slots"),
        "qkv [B*T, (Hq + 2Hk) * D] -> (q [B, T, Hq, D] rotated, keys, values with k, v written at slots [B, T])");
  m.def("add_rms_norm", &add_rms_norm, nb::arg("h"), nb::arg("a"), nb::arg("weight"), nb::arg("eps"),
        "(h + a, rms_norm(h + a) * weight)");
#if defined(__AVX512F__)
  m.attr("tiled_gemm") = true;  // qgemm's register tile fits (see qgemm_cpu)
#else
  m.attr("tiled_gemm") = false;
#endif
#if defined(__AVX512F__) || defined(FX_AVX2)
  m.attr("few_gemm") = true;  // qgemm has its few-row path (AVX-512: up to QG_FEW rows; AVX2: all)
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
