// xlaserve CPU GEMM on grouped 4- and 8-bit weights, for many rows (prefill, large decode batches):
// y f32[m, n] = x[m, k] @ W.T for W[n, k] in kernels/quant/reference.py's layout (GGML's Q4_1 / Q8_0 blocks
// as arrays). qmatmul.cc takes few rows (it dequantizes a group once per tile of 4 rows, which for hundreds
// of rows costs more than the products); kernels/cpu/__init__.py sends the rest here.
//
// Two precisions, chosen by x's dtype as the reference does (kernels/quant/reference.qmatmul_reference):
//   - f32 x: the weights dequantized to f32 and f32 products, as exact as the reference.
//   - bf16 x (a model computing in bfloat16): the weights dequantized to bf16 and the products taken two at
//     a time by AVX512-BF16's `vdpbf16ps` (a pair of bf16 products summed into each f32 lane: twice an
//     FMA's work per instruction), accumulated in f32.
//
// How: output columns (weight rows) in panels of kPanel; a panel's weights are dequantized, kBlockK inputs
// at a time, into the thread's own scratch in the layout the register tile reads: a row per input (f32) or
// per pair of inputs (bf16 pairs), kPanel columns wide. 16 weight rows x 16 inputs are dequantized as 16
// vectors (one per weight row) and transposed in registers. The panel block (48-96 KB, in L2) is then
// multiplied into every tile of kTileRows rows of x by kPanel columns (24 accumulators), each weight loaded
// once per tile of rows and each x value broadcast once per 48 columns; blocks after the first add to the
// partial sums of y. Each output is computed by one thread in one fixed order: the result does not depend on
// which thread took which panel.
// Measured: see `python -m bench.kernels` ("qmatmul, prefill").
// AVX-512 intrinsics where the host has them; elsewhere GCC/Clang vector extensions (and two f32 FMAs for
// each bf16 pair) do the same.

#include "amx.h"
#include "common.h"
#include "quant.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

// A register tile: kTileRows rows of x by kPanelVecs vectors of output columns, 24 accumulators (AVX2: 6, in
// 12 of its 16 ymm registers).
constexpr int kPanelVecs = kWideRegisters ? 3 : 1;  // vectors of output columns per register tile
constexpr int64_t kPanel = kPanelVecs * kLanes;     // output columns per panel
constexpr int kTileRows = kWideRegisters ? 8 : 6;   // rows of x per register tile
constexpr int64_t kBlockK = 512;                 // inputs per panel block: 96 KB of f32, 48 KB of bf16 pairs

struct GProblem {
  const float* x;         // [m, k] f32, or null
  const uint32_t* xpair;  // [m, k / 2] bf16 pairs (element 2i in the low half), or null
  const uint8_t* q;       // [n, k / 2] (4 bits) or [n, k] (8 bits)
  const uint16_t* scale;  // f16 [n, groups]
  const uint16_t* zero;   // f16 [n, groups]; 4 bits only
  float* y;               // [m, n]
  int64_t m, k, n, groups, row_bytes;
  LiveRows live;  // the rows computed (a step's tokens), the others zeros
  bool bf16() const { return xpair != nullptr; }
};

// Two vectors of f32 (inputs 0-15 and 16-31 of a group) as 16 bf16 pairs (inputs 2i, 2i + 1 in lane i),
// rounded to nearest even.
inline vec to_bf16_pairs(vec lo, vec hi) {
#if defined(__AVX512BF16__)
  return (vec)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
#else
  uint32_t bits[2 * kLanes], out[kLanes];
  std::memcpy(bits, &lo, sizeof(vec));
  std::memcpy(bits + kLanes, &hi, sizeof(vec));
  auto round = [](uint32_t b) -> uint32_t {
    if ((b & 0x7fffffff) > 0x7f800000) return (b >> 16) | 0x40;  // NaN stays a (quiet) NaN
    return (b + 0x7fff + ((b >> 16) & 1)) >> 16;
  };
  for (int i = 0; i < kLanes; ++i) out[i] = round(bits[2 * i]) | (round(bits[2 * i + 1]) << 16);
  vec v;
  std::memcpy(&v, out, sizeof(vec));
  return v;
#endif
}

// The panel block of weight rows [c0, c0 + kPanel) (rows past n as zeros), inputs [k0, k1): f32 rows
// panel[(kk - k0) * kPanel + c], or bf16 pairs panel[(kk - k0) / 2 * kPanel + c].
//
// 16 weight rows at a time are read a group of each at a time (32 or 16 bytes from 16 rows a row apart):
// the hardware prefetcher does not follow that, and the loads stalled on DRAM (the 8-bit LM head W[49152,
// 576] for 32 rows took 15 ms, 2 GB/s). So the next 16 rows' stretch is prefetched while these are done, a
// cache line of each row as the groups reach it, and the scales and zeros are converted a row's stretch at
// a time (vector conversions) before the groups are unpacked.
template <int Bits>
void dequantize_panel(const GProblem& p, int64_t c0, int64_t k0, int64_t k1, float* panel) {
  constexpr int64_t group_bytes = kGroup * Bits / 8;
  const bool pairs = p.bf16();
  const int64_t g0 = k0 / kGroup, ng = (k1 - k0) / kGroup, stretch = ng * group_bytes;
  const int64_t rows = std::min<int64_t>(kPanel, p.n - c0);
  thread_local std::vector<float> factors;  // scale [c * ng + g], zero [(kPanel + c) * ng + g]
  factors.resize(2 * kPanel * ng);
  float* const scales = factors.data();
  float* const zeros = scales + kPanel * ng;
  for (int64_t c = 0; c < rows; ++c) {
    halves_to_floats(p.scale + (c0 + c) * p.groups + g0, scales + c * ng, ng);
    if (Bits == 4) halves_to_floats(p.zero + (c0 + c) * p.groups + g0, zeros + c * ng, ng);
  }
  for (int64_t b = 0; b < rows; b += kLanes) {
    // The stretch read next: the panel's next 16 rows, else its first 16 rows' next block of inputs.
    const uint8_t* next = nullptr;
    int64_t next_rows = 0;
    if (b + kLanes < rows) {
      next = p.q + (c0 + b + kLanes) * p.row_bytes + g0 * group_bytes;
      next_rows = std::min<int64_t>(kLanes, rows - b - kLanes);
    } else if (k1 < p.k) {
      next = p.q + c0 * p.row_bytes + (k1 / kGroup) * group_bytes;
      next_rows = std::min<int64_t>(kLanes, rows);
    }
    const int64_t live = std::min<int64_t>(kLanes, rows - b);
    for (int64_t g = 0; g < ng; ++g) {
      if (next != nullptr && (g * group_bytes) % 64 == 0) {
        const int64_t offset = std::min(g * group_bytes + 63, stretch - 1);  // the line's end: any alignment
        for (int64_t i = 0; i < next_rows; ++i) {
          if (g == 0) __builtin_prefetch(next + i * p.row_bytes);
          __builtin_prefetch(next + i * p.row_bytes + offset);
        }
      }
      vec lo[kLanes], hi[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        if (i >= live) {
          lo[i] = hi[i] = vec{};
          continue;
        }
        const int64_t c = b + i;
        unpack<Bits>(p.q + (c0 + c) * p.row_bytes + (g0 + g) * group_bytes, lo[i], hi[i]);
        const vec s = broadcast(scales + c * ng + g);
        if (Bits == 4) {
          const vec z = broadcast(zeros + c * ng + g);
          lo[i] = lo[i] * s + z;
          hi[i] = hi[i] * s + z;
        } else {
          lo[i] *= s;
          hi[i] *= s;
        }
      }
      const int64_t row = g * kGroup;
      if (pairs) {
        for (int i = 0; i < kLanes; ++i) lo[i] = to_bf16_pairs(lo[i], hi[i]);
        transpose16(lo);
        for (int j = 0; j < kLanes; ++j) store(panel + (row / 2 + j) * kPanel + b, lo[j]);
      } else {
        transpose16(lo);
        transpose16(hi);
        for (int j = 0; j < kLanes; ++j) {
          store(panel + (row + j) * kPanel + b, lo[j]);
          store(panel + (row + kLanes + j) * kPanel + b, hi[j]);
        }
      }
    }
  }
  // Column blocks past n: zeros (a panel cut short; its products are not copied out, but must be finite).
  for (int64_t b = (rows + kLanes - 1) / kLanes * kLanes; b < kPanel; b += kLanes)
    for (int64_t r = 0; r < (pairs ? (k1 - k0) / 2 : k1 - k0); ++r) store(panel + r * kPanel + b, vec{});
}

// acc[i][v] += the products of rows r0 + i of x with the panel block (inputs [k0, k1)).
template <int R>
inline void multiply_block(const GProblem& p, const float* panel, int64_t r0, int64_t k0, int64_t k1,
                           vec (&acc)[R][kPanelVecs]) {
  if (!p.bf16()) {
    const float* x0 = p.x + r0 * p.k;
    for (int64_t kk = k0; kk < k1; ++kk) {
      const float* w = panel + (kk - k0) * kPanel;
      vec b[kPanelVecs];
      for (int v = 0; v < kPanelVecs; ++v) b[v] = load(w + v * kLanes);
      for (int i = 0; i < R; ++i) {
        const vec a = broadcast(x0 + i * p.k + kk);
        for (int v = 0; v < kPanelVecs; ++v) acc[i][v] += a * b[v];
      }
    }
    return;
  }
  const int64_t half_k = p.k / 2;
  const uint32_t* x0 = p.xpair + r0 * half_k;
  for (int64_t kp = k0 / 2; kp < k1 / 2; ++kp) {
    const float* w = panel + (kp - k0 / 2) * kPanel;
#if defined(__AVX512BF16__)
    __m512bh b[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) b[v] = (__m512bh)_mm512_loadu_ps(w + v * kLanes);
    for (int i = 0; i < R; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(x0[i * half_k + kp]));
      for (int v = 0; v < kPanelVecs; ++v) acc[i][v] = (vec)_mm512_dpbf16_ps((__m512)acc[i][v], a, b[v]);
    }
#else
    uvec b[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) std::memcpy(&b[v], w + v * kLanes, sizeof(uvec));
    for (int i = 0; i < R; ++i) {
      const uint32_t pair = x0[i * half_k + kp];
      float a_lo, a_hi;
      const uint32_t lo_bits = pair << 16, hi_bits = pair & 0xffff0000u;
      std::memcpy(&a_lo, &lo_bits, 4);
      std::memcpy(&a_hi, &hi_bits, 4);
      for (int v = 0; v < kPanelVecs; ++v) {
        vec w_lo, w_hi;
        const uvec lo = b[v] << 16, hi = b[v] & 0xffff0000u;
        std::memcpy(&w_lo, &lo, sizeof(vec));
        std::memcpy(&w_hi, &hi, sizeof(vec));
        acc[i][v] += splat(a_hi) * w_hi + splat(a_lo) * w_lo;
      }
    }
#endif
  }
}

// out[(r0 + i) * ld + j] (+)= rows [r0, r0 + R) of x times the panel block, j < kPanel.
template <int R>
void tile(const GProblem& p, const float* panel, int64_t r0, int64_t k0, int64_t k1, float* out, int64_t ld,
          bool first) {
  vec acc[R][kPanelVecs];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < kPanelVecs; ++v) acc[i][v] = first ? vec{} : load(out + (r0 + i) * ld + v * kLanes);
  multiply_block<R>(p, panel, r0, k0, k1, acc);
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < kPanelVecs; ++v) store(out + (r0 + i) * ld + v * kLanes, acc[i][v]);
}

void tile_rows(const GProblem& p, const float* panel, int64_t r0, int64_t rows, int64_t k0, int64_t k1,
               float* out, int64_t ld, bool first) {
  switch (rows) {
    case 1: return tile<1>(p, panel, r0, k0, k1, out, ld, first);
    case 2: return tile<2>(p, panel, r0, k0, k1, out, ld, first);
    case 3: return tile<3>(p, panel, r0, k0, k1, out, ld, first);
    case 4: return tile<4>(p, panel, r0, k0, k1, out, ld, first);
    case 5: return tile<5>(p, panel, r0, k0, k1, out, ld, first);
    case 6: return tile<6>(p, panel, r0, k0, k1, out, ld, first);
    case 7: return tile<7>(p, panel, r0, k0, k1, out, ld, first);
    default: return tile<kTileRows>(p, panel, r0, k0, k1, out, ld, first);
  }
}

#if defined(XLASERVE_AMX)
// Tile instructions by inline asm with "memory" clobbers: GCC 12's _tile_loadd / _tile_stored have none, so
// the compiler may move the panel's stores past a tile load, or a read of y before a tile store.
#define XLASERVE_TILE_ZERO(t) asm volatile("tilezero %%tmm" #t ::)
#define XLASERVE_TILE_LOAD(t, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define XLASERVE_TILE_STORE(t, base, stride) \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define XLASERVE_TILE_DPBF16PS(c, a, b) asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// The tiles of `amx_tile`: C (f32 sums) tmm0-2, one per 16 output columns of the panel; A (16 rows x 32
// inputs of x, bf16) tmm3; B (16 input pairs x 16 columns of the panel) tmm4-6. All 16 rows x 64 bytes.
constexpr int kAmxRows = 16;
static_assert(kPanelVecs == 3 && kLanes == 16, "amx_tile holds a panel's 48 columns in three C tiles");

const TileConfig& amx_config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 7; ++t) {
      c.rows[t] = kAmxRows;
      c.colsb[t] = 64;
    }
    return c;
  }();
  return config;
}

// out[(r0 + i) * ld + j] (+)= rows [r0, r0 + 16) of bf16 x times the panel block (inputs [k0, k1)), j <
// kPanel, on the AMX tiles: TDPBF16PS multiplies 16 rows x 32 inputs by 32 inputs x 16 columns (the panel's
// bf16 pairs are the B operand's layout as they are) and adds to the f32 tile, 16 x 16 x 32 products an
// instruction against `multiply_block`'s 16 x 2. The tile configuration must be loaded (`panel_columns`).
void amx_tile(const GProblem& p, const float* panel, int64_t r0, int64_t k0, int64_t k1, float* out, int64_t ld,
              bool first) {
  float* const c = out + r0 * ld;
  const int64_t c_stride = ld * sizeof(float), a_stride = p.k * 2, b_stride = kPanel * sizeof(float);
  if (first) {
    XLASERVE_TILE_ZERO(0);
    XLASERVE_TILE_ZERO(1);
    XLASERVE_TILE_ZERO(2);
  } else {
    XLASERVE_TILE_LOAD(0, c, c_stride);
    XLASERVE_TILE_LOAD(1, c + kLanes, c_stride);
    XLASERVE_TILE_LOAD(2, c + 2 * kLanes, c_stride);
  }
  const uint32_t* const a = p.xpair + r0 * (p.k / 2);
  for (int64_t kk = k0; kk < k1; kk += kGroup) {
    const float* b = panel + (kk - k0) / 2 * kPanel;
    XLASERVE_TILE_LOAD(3, a + kk / 2, a_stride);
    XLASERVE_TILE_LOAD(4, b, b_stride);
    XLASERVE_TILE_LOAD(5, b + kLanes, b_stride);
    XLASERVE_TILE_LOAD(6, b + 2 * kLanes, b_stride);
    XLASERVE_TILE_DPBF16PS(0, 3, 4);
    XLASERVE_TILE_DPBF16PS(1, 3, 5);
    XLASERVE_TILE_DPBF16PS(2, 3, 6);
  }
  XLASERVE_TILE_STORE(0, c, c_stride);
  XLASERVE_TILE_STORE(1, c + kLanes, c_stride);
  XLASERVE_TILE_STORE(2, c + 2 * kLanes, c_stride);
}
#endif

// Output columns [c0, c0 + kPanel) of y, by the calling thread. A panel cut short by n is summed into the
// thread's scratch (kPanel wide) and its columns copied out at the end.
template <int Bits>
void panel_columns(const GProblem& p, int64_t c0) {
  thread_local std::vector<float> panel_scratch, partial_scratch;
  panel_scratch.resize(kBlockK * kPanel);
  float* const panel = panel_scratch.data();
  const bool whole = c0 + kPanel <= p.n;
  if (!whole) partial_scratch.resize(p.m * kPanel);
  float* const out = whole ? p.y + c0 : partial_scratch.data();
  const int64_t ld = whole ? p.n : kPanel;
  // bf16 rows in blocks of 16 on the AMX tiles where the process may use them, the rest (and every row
  // without AMX) by the AVX-512 register tiles.
  [[maybe_unused]] bool amx = false;
#if defined(XLASERVE_AMX)
  if (p.bf16() && p.m >= kAmxRows && amx_on()) {
    amx = true;
    load_tile_config(amx_config());
  }
#endif
  for (int64_t k0 = 0; k0 < p.k; k0 += kBlockK) {
    const int64_t k1 = std::min(p.k, k0 + kBlockK);
    dequantize_panel<Bits>(p, c0, k0, k1, panel);
    for (int range = 0; range < 2; ++range) {  // the live rows: AMX tiles of 16, then register tiles
      const int64_t lo = p.live.r[2 * range], hi = p.live.r[2 * range + 1];
      int64_t r0 = lo;
#if defined(XLASERVE_AMX)
      if (amx)
        for (; r0 + kAmxRows <= hi; r0 += kAmxRows) amx_tile(p, panel, r0, k0, k1, out, ld, k0 == 0);
#endif
      for (; r0 < hi; r0 += kTileRows)
        tile_rows(p, panel, r0, std::min<int64_t>(kTileRows, hi - r0), k0, k1, out, ld, k0 == 0);
    }
  }
#if defined(XLASERVE_AMX)
  if (amx) release_tiles();
#endif
  if (!whole)
    p.live.for_tiles<1>([&](int64_t r, int64_t) {
      std::memcpy(p.y + r * p.n + c0, out + r * kPanel, sizeof(float) * (p.n - c0));
    });
}

// `live`: s32 [4], the rows to compute (LiveRows), the others written as zeros.
ffi::Error QgemmImpl(ffi::AnyBuffer x, ffi::AnyBuffer q, ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> zero,
                     ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y, int32_t bits) {
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  if (!bf16 && x.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("xlaserve_cpu_qgemm: x must be f32 or bf16");
  QShape shape;
  if (ffi::Error error = check_quantized("xlaserve_cpu_qgemm", x, q, scale, zero, y, bits, shape); error.failure())
    return error;
  const auto [m, k, n, groups, row_bytes] = shape;
  if (empty_product(shape, y->typed_data())) return ffi::Error::Success();
  if (live.element_count() != 4) return ffi::Error::InvalidArgument("xlaserve_cpu_qgemm: live must hold 4 row bounds");
  const GProblem p{bf16 ? nullptr : static_cast<const float*>(x.untyped_data()),
                   bf16 ? static_cast<const uint32_t*>(x.untyped_data()) : nullptr,
                   static_cast<const uint8_t*>(q.untyped_data()), scale.typed_data(),
                   bits == 4 ? zero.typed_data() : nullptr, y->typed_data(), m, k, n, groups, row_bytes,
                   LiveRows::of(live.typed_data(), m)};
  p.live.zero_others(p.y, m, n);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  Workers::get().parallel_for(panels, [&](int64_t c, int) {
    if (bits == 4) panel_columns<4>(p, c * kPanel);
    else panel_columns<8>(p, c * kPanel);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

// Why AMX is off in this process (0: on; xlaserve::AmxStatus), for kernels/cpu/build.py to log once.
extern "C" int XlaserveCpuAmxStatus() { return xlaserve::amx_status(); }
// on = 0: the AVX-512 path only (tests compare it with the tiles'), 1: AMX where available (the default).
extern "C" void XlaserveCpuSetAmx(int on) { xlaserve::amx_requested().store(on ? 1 : 0); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuQgemm, xlaserve::QgemmImpl, xlaserve::quantized_binding<true>());
