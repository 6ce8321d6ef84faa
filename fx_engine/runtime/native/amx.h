// Part of fx-engine's native kernels: qmm_a8's many-row tiles on Intel AMX (tdpbsud).
// Not a standalone header: qmm_a8.h includes it before qmm_a8_rows (it uses a8_step and
// A8Vec from there), inside kernels.cpp's anonymous namespace, as one translation unit.
#pragma once

// ---------------------------------------------------------------- AMX tiles
// Built where the compiler targets AMX-INT8 (-march=native on a Sapphire Rapids or later
// Xeon), used where Linux grants the process the tile state (arch_prctl
// ARCH_REQ_XCOMP_PERM, kernel >= 5.16) and set_amx has not turned it off.
//
// The same product as a8_tile's on an interleaved weight, with the same bits: per group,
// one tile multiply gives the exact int32 sums isum(m, n, g) of 16 rows x 16 features
// (tdpbsud: the activation bytes signed, the weight bytes unsigned, as vpdpbusd has them);
// each row's 16 features then take a8_step's two FMAs, lane by lane, in group order. A
// vpdpbusd covers 64 products; a tile multiply 16 x 16 x 64, so the integer work (two
// thirds of a 16-row tile's instructions with 32-value groups) leaves the vector units,
// and what remains is the per-group float step, the formula's own cost. Measured (an
// Intel Xeon, 2 vCPUs; docs/benchmarks.md): 1.2-1.6x the VNNI tiles' speed, a 1B Q4_K_M
// file's 8-bit prefill 1.6x (its Q6_K groups of 16 are the most integer work a float step).
//
// Layout: the weight block as every interleaved reader makes it, quads [K / 4][16][4]
// (a8_tile's QM: 8-bit blocks as stored, il16_quads4, ilp_quads) is exactly the B tile's
// form (rows of 4-byte quads, 16 features across), so a group's weights are one tile load.
// The activations are the A tiles: per 16 rows and per kb = min(gs, 64) values of k,
// [16 rows][kb] bytes in the weights' k order (amx_pack, from pack_a8's quad-major tiles),
// each tile one contiguous load. A group of gs values is one multiply of gs / 4 quads (gs
// 16 or 32), or gs / 64 multiplies of 64 values, summed in the tile (exact integers).
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__linux__)
#define FX_A8_AMX 1

// Whether the kernels may use AMX: built for it, granted the tile state, not turned off.
inline std::atomic<bool>& amx_wanted() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("FX_ENGINE_AMX");
    return !(v && std::string(v) == "0");
  }()};
  return on;
}
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}
inline bool amx_on() { return amx_wanted().load(std::memory_order_relaxed) && amx_permitted(); }

// Which group sizes the tiles take: a multiple of 16 up to 64, or of 64 (a tile row holds
// at most 64 bytes).
inline bool amx_fits(int gs) { return gs % 16 == 0 && (gs <= 64 || gs % 64 == 0); }

// pack_a8's tiles xq [tiles][K / 4][16][4] -> xa [tiles][K / kb][16][kb] (the A tiles).
inline void amx_pack(const int8_t* xq, int tiles, int K, int gs, int8_t* xa) {
  const int kq = std::min(gs, 64) / 4;  // quads per A tile row
  pool().run(tiles, [&](int t) {
    const int32_t* q = reinterpret_cast<const int32_t*>(xq) + static_cast<int64_t>(t) * K * 4;
    int32_t* a = reinterpret_cast<int32_t*>(xa) + static_cast<int64_t>(t) * K * 4;
    for (int c = 0; c < K / 4 / kq; ++c)
      for (int i = 0; i < 16; ++i)
        for (int u = 0; u < kq; ++u) a[(c * 16 + i) * kq + u] = q[(c * kq + u) * 16 + i];
  });
}

// The tile configuration for groups of gs: tmm0-3 the int32 sums of four groups in flight
// (16 x 16: a multiply's latency is several times its issue interval, and a group's float
// step reads its sums back through memory), tmm4 / tmm5 activations (16 rows x kb bytes),
// tmm6 / tmm7 weights (kb / 4 quads x 16 features), alternating between groups.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(AmxConfig) == 64, "ldtilecfg reads 64 bytes");

inline void amx_configure(int gs) {
  const int kb = std::min(gs, 64);
  AmxConfig c;
  for (int t = 0; t < 4; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  for (int t : {4, 5}) {
    c.rows[t] = 16;
    c.colsb[t] = static_cast<uint16_t>(kb);
    c.rows[t + 2] = static_cast<uint8_t>(kb / 4);
    c.colsb[t + 2] = 64;
  }
  _tile_loadconfig(&c);
}

// One group's sums into tile T (GCC's tile intrinsics paste the register number as text,
// so each is spelled out): the group's kb-byte steps of the A tiles (xa: this row tile's,
// [K / kb][16][kb]) against the block's quads (wb).
template <int T>
inline void amx_group(const int8_t* xa, const uint8_t* wb, int K, int gs, int g) {
  static_assert(T >= 0 && T < 4);
  const int kb = std::min(gs, 64);
  if constexpr (T == 0) _tile_zero(0);
  if constexpr (T == 1) _tile_zero(1);
  if constexpr (T == 2) _tile_zero(2);
  if constexpr (T == 3) _tile_zero(3);
  for (int k = g * gs; k < (g + 1) * gs; k += kb) {
    const int8_t* a = xa + static_cast<int64_t>(k) * 16;  // tile k / kb: 16 * kb bytes each
    const uint8_t* b = wb + static_cast<int64_t>(k) * 16;
    if constexpr (T % 2 == 0) {
      _tile_loadd(4, a, kb);
      _tile_loadd(6, b, 64);
    } else {
      _tile_loadd(5, a, kb);
      _tile_loadd(7, b, 64);
    }
    if constexpr (T == 0) _tile_dpbsud(0, 4, 6);
    if constexpr (T == 1) _tile_dpbsud(1, 5, 7);
    if constexpr (T == 2) _tile_dpbsud(2, 4, 6);
    if constexpr (T == 3) _tile_dpbsud(3, 5, 7);
  }
}

// a8_step for the 16 rows of a tile against one group: is [16 rows][16 features] int32,
// s / b the features' scale and bias (16 lanes), d / xs the rows' factors.
inline void amx_step(__m512 (&acc)[16], const int32_t* is, __m512 s, __m512 b, const float* d, const float* xs) {
  using V = A8Vec<16>;
  for (int m = 0; m < 16; ++m)
    acc[m] = a8_step<V>(acc[m], V::iload(is + m * 16), V::fbcast(d[m]), s, V::fbcast(xs[m]), b);
}

// y rows [0, mc) (stride ldy) of one 16-row tile against one interleaved 16-feature block:
// xa the tile's activations [16][K], dd / xs its factors [G][16] (pack_a8's), wb the
// block's quads, ds / db its scales and biases [G][16]. amx_configure(gs) first.
inline void a8_amx_tile(const int8_t* xa, const float* dd, const float* xs, const uint8_t* wb, const float* ds,
                        const float* db, int K, int gs, float* y, int64_t ldy, int mc) {
  const int G = K / gs;
  __m512 acc[16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  alignas(64) int32_t is[4][256];
  auto step = [&](const int32_t* sums, int g) {
    amx_step(acc, sums, _mm512_loadu_ps(ds + g * 16), _mm512_loadu_ps(db + g * 16), dd + g * 16, xs + g * 16);
  };
  // Four groups a round; the next round's multiplies are issued before this round's float
  // steps, so the tile unit works while the vector units step (still in group order).
  auto issue4 = [&](int g) {
    amx_group<0>(xa, wb, K, gs, g);
    amx_group<1>(xa, wb, K, gs, g + 1);
    amx_group<2>(xa, wb, K, gs, g + 2);
    amx_group<3>(xa, wb, K, gs, g + 3);
  };
  auto store4 = [&] {
    _tile_stored(0, is[0], 64);
    _tile_stored(1, is[1], 64);
    _tile_stored(2, is[2], 64);
    _tile_stored(3, is[3], 64);
  };
  const int G4 = G / 4 * 4;
  if (G4) {
    issue4(0);
    store4();
    for (int g = 4; g < G4; g += 4) {  // a tile pair is reloaded only after two float steps
      amx_group<0>(xa, wb, K, gs, g);
      amx_group<1>(xa, wb, K, gs, g + 1);
      step(is[0], g - 4);
      step(is[1], g - 3);
      amx_group<2>(xa, wb, K, gs, g + 2);
      amx_group<3>(xa, wb, K, gs, g + 3);
      step(is[2], g - 2);
      step(is[3], g - 1);
      store4();
    }
    for (int j = 0; j < 4; ++j) step(is[j], G4 - 4 + j);
  }
  for (int g = G4; g < G; ++g) {
    amx_group<0>(xa, wb, K, gs, g);
    _tile_stored(0, is[0], 64);
    step(is[0], g);
  }
  for (int m = 0; m < mc; ++m) _mm512_storeu_ps(y + m * ldy, acc[m]);
}
#endif
