// xlaserve CPU matmul on grouped 4- and 8-bit weights: y f32[m, n] = x f32[m, k] @ W.T for W[n, k] stored
// as kernels/quant/reference.py lays it out (GGML's Q4_1 / Q8_0 blocks as arrays): groups of 32 inputs of
// one output row, each with an f16 scale (and, 4 bits, an f16 zero); the reference is qmatmul_reference.
// kernels/cpu/__init__.py sends at most MAX_NATIVE_ROWS rows (prefill dequantizes and runs XLA's dot).
//
// Why: a decode step streams every weight from DRAM once, and a 4-bit weight is 5 bits of it against an
// f32's 32. The weights are read in place and dequantized in registers: a group's 32 integers unpacked into
// two vectors of floats, scaled (see `tile` for how), and multiplied into up to kTileRows rows of x, so each
// group is unpacked once per tile of rows; one horizontal sum per output at the end.
// Output rows are split into chunks over the helper threads: each chunk streams a contiguous stretch of q,
// scales and zeros, and every output is computed by one thread in one fixed order, so the result does not
// depend on which thread took which chunk.
// Measured (2 cores, SmolLM2-135M's LM head W[49152, 576], one row, from DRAM): 4 bits 0.93-0.97 ms (17.7 MB,
// ~18 GB/s: bound by the unpacking, see `tile`), 8 bits 1.0-1.5 ms, against 3.3-4.5 ms for matmul.cc on its
// f32 weight (113 MB at 25-34 GB/s).
// AVX-512 intrinsics where the host has them; elsewhere GCC/Clang vector extensions do the same.

#include "common.h"
#include "quant.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

// A register tile (AVX2: 2 x 2, its x and accumulators in 16 ymm registers; 4 x 4 spilled them).
constexpr int kTileCols = kWideRegisters ? 4 : 2;  // output rows (weight rows) per register tile
constexpr int kTileRows = kWideRegisters ? 4 : 2;  // rows of x per register tile
// Chunks per worker, claimed dynamically: a helper that comes late takes fewer. 1 and 2 measured the same
// as 4 within the noise (a synthetic decode step of SmolLM2's 121 4-bit products, 5-7 ms).
constexpr int kChunksPerWorker = 4;
constexpr int64_t kScaleRows = 64;  // weight rows whose scales and zeros are converted to floats at once
// The weights are prefetched this many tiles ahead (kTileCols rows of 4 bits: a cache line a group), and the
// scales and zeros a block ahead, a tile's worth with each tile. Measured on the SmolLM2 LM head (W[49152,
// 576]) at one row, both cores: 4 bits 1.14-1.41 -> 0.91-1.13 ms with the weights', -> 0.81-0.98 with the
// scales' too; 8 bits 2.9 -> 1.4 ms. 3 and 6-8 tiles ahead measured slower than 4; prefetching into L2 only,
// or a block's scales all at once, no faster.
constexpr int64_t kPrefetchTiles = 4;

struct QProblem {
  const float* x;         // [m, k]
  const uint8_t* q;       // [n, k / 2] (4 bits) or [n, k] (8 bits)
  const uint16_t* scale;  // f16 [n, groups]
  const uint16_t* zero;   // f16 [n, groups]; 4 bits only
  const float* xsum;      // the last row of x summed over each group, zeros after to a whole vector; 4 bits,
                          // m % kTileRows == 1 only (that row is the only one-row tile)
  float* y;               // [m, n]
  int64_t m, k, n, groups, row_bytes;
};

// p[0, count) and zeros in the other lanes (count <= kLanes).
inline vec load_first(const float* p, int64_t count) {
#if defined(__AVX512F__)
  return (vec)_mm512_maskz_loadu_ps(count >= kLanes ? 0xffff : (1u << count) - 1, p);
#else
  float v[kLanes] = {};
  std::memcpy(v, p, sizeof(float) * std::min<int64_t>(count, kLanes));
  return load(v);
#endif
}

// y[r0 .. r0 + R, c0 .. c0 + C] for R rows of x by C weight rows, whose scales and zeros are already floats:
// s[c * groups + g], z[c * groups + g].
//
// The vector unit bounds it, not DRAM: a group of 4 bits costs ~8 16-lane operations (unpack 3, convert 2,
// multiply 3) on Zen 4's double-pumped 512-bit pipes. So each row count takes the form with fewer multiplies:
//   - R >= 2: dequantize (w = q * s + z, two FMAs a group) and multiply into every row (two a row):
//     2 + 2R a group.
//   - R = 1: sum x * q over the group (two), then scale that (one), and add zero * (x's sum over the group)
//     at the end, a vector of groups at a time: 3 a group. Measured on one core with the weights in L2:
//     1.9 -> 1.3 ns a group in isolation, 1.6 in the kernel. Unpacking four groups of a row from one 64-byte
//     load (a nibble of each 32-bit lane at a time, x permuted to match, one multiply by the four scales)
//     has fewer multiplies but more shifts, and measured slower: 2.1 ns.
template <int Bits, int R, int C>
void tile(const QProblem& p, const float* s, const float* z, int64_t r0, int64_t c0) {
  constexpr int64_t group_bytes = kGroup * Bits / 8;
  const int64_t groups = p.groups;
  vec acc[R][C] = {};
  const float* x0 = p.x + r0 * p.k;
  const uint8_t* q0 = p.q + c0 * p.row_bytes;
  for (int64_t g = 0; g < groups; ++g) {
    if (r0 == 0) {  // a whole tile's stretch of q, kPrefetchTiles tiles on, over its groups
      const uint8_t* ahead = q0 + kPrefetchTiles * kTileCols * p.row_bytes + g * kTileCols * group_bytes;
      for (int64_t b = 0; b < kTileCols * group_bytes; b += 64) __builtin_prefetch(ahead + b);
    }
    vec xl[R], xh[R];
    for (int r = 0; r < R; ++r) {
      xl[r] = in_register(load(x0 + r * p.k + g * kGroup));
      xh[r] = in_register(load(x0 + r * p.k + g * kGroup + kLanes));
    }
    for (int c = 0; c < C; ++c) {
      vec lo, hi;
      unpack<Bits>(q0 + c * p.row_bytes + g * group_bytes, lo, hi);
      const vec sc = broadcast(s + c * groups + g);
      if (R == 1) {
        vec t = xl[0] * lo;
        t += xh[0] * hi;
        acc[0][c] += t * sc;
        continue;
      }
      if (Bits == 4) {
        const vec zc = broadcast(z + c * groups + g);
        lo = lo * sc + zc;
        hi = hi * sc + zc;
      } else {
        lo *= sc;
        hi *= sc;
      }
      for (int r = 0; r < R; ++r) {
        acc[r][c] += xl[r] * lo;
        acc[r][c] += xh[r] * hi;
      }
    }
  }
  if (R == 1 && Bits == 4) {
    for (int64_t g = 0; g < groups; g += kLanes)
      for (int c = 0; c < C; ++c) acc[0][c] += load_first(z + c * groups + g, groups - g) * load(p.xsum + g);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) p.y[(r0 + r) * p.n + c0 + c] = hsum(acc[r][c]);
}

template <int Bits, int C>
void tile_rows(const QProblem& p, const float* s, const float* z, int64_t c0) {
  int64_t r0 = 0;
  for (; r0 + kTileRows <= p.m; r0 += kTileRows) tile<Bits, kTileRows, C>(p, s, z, r0, c0);
  switch (p.m - r0) {
    case 1: return tile<Bits, 1, C>(p, s, z, r0, c0);
    case 2: return tile<Bits, 2, C>(p, s, z, r0, c0);
    case 3: return tile<Bits, 3, C>(p, s, z, r0, c0);
    default: return;
  }
}

// Output columns [c_begin, c_end): blocks of kScaleRows weight rows, each block's scales and zeros converted
// to floats first (into the thread's own scratch), then its tiles of kTileCols weight rows, each against
// every tile of rows of x. Converting a tile's own right before it took ~20% of a one-row product (k = 576):
// a vector of 16 then holds one row's 18 and the tile's first loads wait for the conversions.
template <int Bits>
void chunk(const QProblem& p, int64_t c_begin, int64_t c_end) {
  thread_local std::vector<float> scratch;
  const int64_t per_block = kScaleRows * p.groups;
  if (scratch.size() < size_t(2 * per_block)) scratch.resize(2 * per_block);
  float* const s = scratch.data();
  float* const z = s + per_block;
  for (int64_t b0 = c_begin; b0 < c_end; b0 += kScaleRows) {
    const int64_t b1 = std::min(c_end, b0 + kScaleRows);
    halves_to_floats(p.scale + b0 * p.groups, s, (b1 - b0) * p.groups);
    if (Bits == 4) halves_to_floats(p.zero + b0 * p.groups, z, (b1 - b0) * p.groups);
    for (int64_t c0 = b0; c0 < b1; c0 += kTileCols) {
      // This tile's scales and zeros in the next block, so that block's conversion finds them in cache.
      const int64_t ahead = (c0 + kScaleRows) * p.groups;
      for (int64_t b = 0; b < kTileCols * p.groups * 2 + 64; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(p.scale + ahead) + b);
        if (Bits == 4) __builtin_prefetch(reinterpret_cast<const char*>(p.zero + ahead) + b);
      }
      const float* sc = s + (c0 - b0) * p.groups;
      const float* zc = z + (c0 - b0) * p.groups;
      switch (std::min<int64_t>(kTileCols, b1 - c0)) {
        case 1: tile_rows<Bits, 1>(p, sc, zc, c0); break;
        case 2: tile_rows<Bits, 2>(p, sc, zc, c0); break;
        case 3: tile_rows<Bits, 3>(p, sc, zc, c0); break;
        default: tile_rows<Bits, kTileCols>(p, sc, zc, c0); break;
      }
    }
  }
}

void qmatmul(QProblem p, int bits) {
  // The last row's sums over each group, for the zeros of its one-row tiles (m % kTileRows == 1), by the
  // caller into its own scratch (kept between calls); a pointer, so that helper threads read the caller's.
  thread_local std::vector<float> xsum_scratch;
  if (bits == 4 && p.m % kTileRows == 1) {
    xsum_scratch.assign((p.groups + kLanes - 1) / kLanes * kLanes, 0.f);
    const float* x = p.x + (p.m - 1) * p.k;
    for (int64_t g = 0; g < p.groups; ++g)
      xsum_scratch[g] = hsum(load(x + g * kGroup) + load(x + g * kGroup + kLanes));
    p.xsum = xsum_scratch.data();
  }
  Workers& workers = Workers::get();
  const int64_t threads = workers.size() + 1, n = p.n;
  // Chunks of whole tiles of weight rows.
  const int64_t per_chunk = std::max<int64_t>(
      4 * kTileCols, (n + kChunksPerWorker * threads - 1) / (kChunksPerWorker * threads) + kTileCols - 1) /
      kTileCols * kTileCols;
  const int64_t nchunks = (n + per_chunk - 1) / per_chunk;
  workers.parallel_for(nchunks, [&](int64_t c, int) {
    const int64_t c0 = c * per_chunk, c1 = std::min(n, c0 + per_chunk);
    if (bits == 4) chunk<4>(p, c0, c1);
    else chunk<8>(p, c0, c1);
  });
}

ffi::Error QmatmulImpl(ffi::AnyBuffer x, ffi::AnyBuffer q, ffi::Buffer<ffi::F16> scale,
                       ffi::Buffer<ffi::F16> zero, ffi::ResultBuffer<ffi::F32> y, int32_t bits) {
  if (x.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("xlaserve_cpu_qmatmul: x must be f32");
  QShape shape;
  if (ffi::Error error = check_quantized("xlaserve_cpu_qmatmul", x, q, scale, zero, y, bits, shape);
      error.failure())
    return error;
  const auto [m, k, n, groups, row_bytes] = shape;
  if (empty_product(shape, y->typed_data())) return ffi::Error::Success();
  const QProblem p{static_cast<const float*>(x.untyped_data()), static_cast<const uint8_t*>(q.untyped_data()),
                   scale.typed_data(),
                   bits == 4 ? zero.typed_data() : nullptr, nullptr, y->typed_data(),
                   m, k, n, groups, row_bytes};
  qmatmul(p, bits);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuQmatmul, xlaserve::QmatmulImpl,
                              xlaserve::quantized_binding());
