// xlaserve CPU matmul on grouped 4- and 8-bit weights with int8 activations, for few rows (decode steps,
// draft verification): y f32[m, n] = x'[m, k] @ W.T, where x' is x rounded to int8 per group of 32 inputs
// (kernels/quant/reference.py `quantize_activations`: d = max|x| / 127, x' = d * round(x * (127 / max|x|)))
// and W is in kernels/quant/reference.py's layout, read in place. kernels/cpu/__init__.py sends it up to
// `max_qmatmul_i8_rows()` rows under `--activation-quantization int8`.
//
// Why: qmatmul.cc converts every weight to a float before its FMA, and that conversion, not DRAM, bounded
// a decode step on the AMD machine (a 4-row step cost 1.9x a 1-row one, so draft verification gained
// little). With int8 activations the products are integer: AVX512-VNNI's `vpdpbusd` multiplies 64 unsigned
// weight bytes by 64 signed activation bytes and adds each 4 into an int32 lane (llama.cpp multiplies its
// Q4/Q8 blocks so, with Q8 activation blocks). A 64-byte load of a weight row is 4 groups of 4 bits (or 2 of 8); the activations
// are laid out once per call in the same order, so each lane's sum belongs to one group, and the group's
// scales are applied per lane: acc += float(isum) * (weight scale * activation scale); for 4 bits the
// zeros times each group's sum of x', 16 groups a vector, after the blocks. One horizontal sum per output.
//   - 4 bits: byte j of a group holds element j (low nibble) and j + 16 (high nibble); the nibbles are
//     unsigned 0..15 as vpdpbusd's first operand wants.
//   - 8 bits: the signed weights are made unsigned by flipping the top bit (q + 128), and 128 x the lane's
//     four activations are subtracted from each lane's sum (integer, exact).
// Output rows are split into chunks over the helper threads, each output computed by one thread in one
// fixed order: the result does not depend on which thread took which chunk.
// Measured (Intel Xeon, 2 cores; SmolLM2 Q4_1): the 4-bit LM head W[49152, 576], one row, 0.67 -> 0.48 ms
// (~37 GB/s: the bandwidth); a batch-1 decode step 6.5 -> 5.3 ms. Extra rows still cost (4 rows ~2x one):
// each is 2 vpdpbusd (8 bits: 1 and a subtraction) and 3 float operations per 64-byte block of a weight
// row.
// Without AVX512-VNNI (and AVX512BW) or AVX2 the library leaves the target out of the dispatch
// (XlaserveCpuHasI8).

#include "common.h"
#include "quant.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

// Weight rows [0, n) in chunks claimed by the threads (at least 8 tiles a chunk), each chunk in tiles of TileW
// rows, `tile(c0, true)`, and a last single row, `tile(c0, false)`: each output by one thread, in one order.
template <int64_t TileW, typename Tile>
void over_weight_rows(int64_t n, int64_t chunks_per_worker, Tile tile) {
  Workers& workers = Workers::get();
  const int64_t threads = workers.size() + 1;
  const int64_t per_chunk = std::max<int64_t>(
      8 * TileW, (n + chunks_per_worker * threads - 1) / (chunks_per_worker * threads) + TileW - 1) / TileW * TileW;
  workers.parallel_for((n + per_chunk - 1) / per_chunk, [&](int64_t chunk, int) {
    const int64_t c1 = std::min(n, (chunk + 1) * per_chunk);
    int64_t c0 = chunk * per_chunk;
    for (; c0 + TileW <= c1; c0 += TileW) tile(c0, true);
    if (c0 < c1) tile(c0, false);
  });
}

#if defined(XLASERVE_I8)  // quant.h

constexpr int kTileX = 4;  // rows of x per register tile
constexpr int kTileW = 2;  // weight rows per register tile
constexpr int kChunksPerWorker = 4;
// Weight rows prefetched this far ahead (the loads otherwise waited on DRAM: 60% of a one-row product's time
// in `perf` without it), a cache line of each as the tile reaches the same offset in its own rows.
constexpr int64_t kPrefetchRows = 8 * kTileW;

template <int Bits>
struct Blocks {
  static constexpr int64_t kGroups = Bits == 4 ? 4 : 2;       // groups in a 64-byte block of a weight row
  static constexpr int64_t kXBytes = Bits == 4 ? 128 : 64;    // activation bytes a block multiplies
  static constexpr int64_t kLanesPerGroup = kLanes / kGroups;
};

// x quantized, block by block in the kernel's order (`prepare`).
struct Activations {
  const int8_t* q;      // [m, blocks, kXBytes]: 4 bits: the groups' elements 0-15, then their 16-31
  const float* scale;   // [m, blocks, 16]: each lane's activation scale d
  const float* extra;   // [m, blocks, 16]: 8 bits: 128 x the lane's 4 activations, as int32
  const float* sums;    // [m, sum_stride]: 4 bits: each group's sum of x' (zeros to a whole vector)
  int64_t blocks, sum_stride;
};

// Rounds row x[0, k) to int8 per group of 32 into the block layout of `Bits`.
template <int Bits>
void prepare_row(const float* x, int64_t k, int8_t* q, float* scale, float* extra, float* sums) {
  using B = Blocks<Bits>;
  const int64_t groups = k / kGroup, blocks = (groups + B::kGroups - 1) / B::kGroups;
  std::memset(q, 0, blocks * B::kXBytes);
  std::memset(scale, 0, blocks * kLanes * sizeof(float));
  std::memset(extra, 0, blocks * kLanes * sizeof(float));
  std::memset(sums, 0, (groups + kLanes - 1) / kLanes * kLanes * sizeof(float));
  for (int64_t g = 0; g < groups; ++g) {
    __m512i qlo, qhi;
    float d;
    quantize_group(x + g * kGroup, qlo, qhi, d);
    const int64_t b = g / B::kGroups, i = g % B::kGroups;
    int8_t* block = q + b * B::kXBytes;
    if (Bits == 4) {  // elements 0-15 at 16i of the first 64 bytes, 16-31 at 64 + 16i
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block + 16 * i), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block + 64 + 16 * i), _mm512_cvtsepi32_epi8(qhi));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block + 32 * i), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block + 32 * i + 16), _mm512_cvtsepi32_epi8(qhi));
    }
    float* lanes = scale + b * kLanes + i * B::kLanesPerGroup;
    for (int l = 0; l < B::kLanesPerGroup; ++l) lanes[l] = d;
    if (Bits == 4) sums[g] = d * float(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
  if (Bits == 8) {  // 128 x each lane's four activations: what q + 128 adds to the lane's sum
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512i bytes = _mm512_loadu_si512(q + b * B::kXBytes);
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), bytes);
      _mm512_storeu_si512(extra + b * kLanes, _mm512_slli_epi32(sums, 7));
    }
  }
}

struct Problem {
  Activations x;
  const uint8_t* q;       // [n, row_bytes]
  const uint16_t* scale;  // f16 [n, groups]
  const uint16_t* zero;   // f16 [n, groups]; 4 bits only
  float* y;               // [m, n]
  int64_t m, n, groups, row_bytes;
};

// A weight row's scales (or zeros) of block b, one per lane of its group: f16 -> f32, masked past the row.
template <int Bits>
inline __m512 lane_factors(const uint16_t* row, int64_t b, int64_t groups) {
  using B = Blocks<Bits>;
  const int64_t g0 = b * B::kGroups, live = std::min<int64_t>(B::kGroups, groups - g0);
  const __m128 f = _mm_cvtph_ps(_mm_maskz_loadu_epi16(__mmask8((1u << live) - 1), row + g0));
  const __m512i index = Bits == 4 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                  : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(f));
}

// y[r0 .. r0 + R, c0 .. c0 + C]: R rows of x by C weight rows.
template <int Bits, int R, int C>
void tile(const Problem& p, int64_t r0, int64_t c0) {
  using B = Blocks<Bits>;
  const int64_t blocks = p.x.blocks, row_blocks_bytes = p.row_bytes;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(15), top = _mm512_set1_epi8(char(0x80));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t offset = b * 64, live = std::min<int64_t>(64, row_blocks_bytes - offset);
    const __mmask64 mask = live >= 64 ? ~__mmask64(0) : (__mmask64(1) << live) - 1;
    __m512i w0[C], w1[C];
    __m512 s[C];
    if (r0 == 0) {  // the first tile of rows of x is the first to read these weight rows
      for (int c = 0; c < C; ++c) {
        const int64_t ahead = c0 + c + kPrefetchRows;
        if (ahead >= p.n) break;
        __builtin_prefetch(p.q + ahead * p.row_bytes + offset);
        if (b == 0) {
          __builtin_prefetch(p.scale + ahead * p.groups);
          if (Bits == 4) __builtin_prefetch(p.zero + ahead * p.groups);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m512i bytes = _mm512_maskz_loadu_epi8(mask, p.q + (c0 + c) * p.row_bytes + offset);
      if (Bits == 4) {
        w0[c] = _mm512_and_si512(bytes, nibble);
        w1[c] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
      } else {
        w0[c] = _mm512_xor_si512(bytes, top);
      }
      s[c] = lane_factors<Bits>(p.scale + (c0 + c) * p.groups, b, p.groups);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = p.x.q + ((r0 + r) * blocks + b) * B::kXBytes;
      const __m512 d = _mm512_loadu_ps(p.x.scale + ((r0 + r) * blocks + b) * kLanes);
      const float* extra = p.x.extra + ((r0 + r) * blocks + b) * kLanes;
      const __m512i x0 = _mm512_loadu_si512(xq);
      if (Bits == 4) {
        const __m512i x1 = _mm512_loadu_si512(xq + 64);
        for (int c = 0; c < C; ++c) {
          const __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w0[c], x0), w1[c], x1);
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s[c], d), acc[r][c]);
        }
      } else {
        const __m512i corr = _mm512_loadu_si512(extra);
        for (int c = 0; c < C; ++c) {
          const __m512i sum = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w0[c], x0), corr);
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s[c], d), acc[r][c]);
        }
      }
    }
  }
  if (Bits == 4) {  // + zero x (the group's sum of x'), 16 groups at a time
    for (int64_t g = 0; g < p.groups; g += kLanes) {
      const __mmask16 live = p.groups - g >= kLanes ? 0xffff : (1u << (p.groups - g)) - 1;
      for (int c = 0; c < C; ++c) {
        const __m512 z = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, p.zero + (c0 + c) * p.groups + g));
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm512_fmadd_ps(z, _mm512_loadu_ps(p.x.sums + (r0 + r) * p.x.sum_stride + g), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) p.y[(r0 + r) * p.n + c0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <int Bits, int C>
void tile_rows(const Problem& p, int64_t c0) {
  int64_t r0 = 0;
  for (; r0 + kTileX <= p.m; r0 += kTileX) tile<Bits, kTileX, C>(p, r0, c0);
  switch (p.m - r0) {
    case 1: return tile<Bits, 1, C>(p, r0, c0);
    case 2: return tile<Bits, 2, C>(p, r0, c0);
    case 3: return tile<Bits, 3, C>(p, r0, c0);
    default: return;
  }
}

template <int Bits>
void run(const float* x, int64_t k, Problem p) {
  using B = Blocks<Bits>;
  const int64_t blocks = (p.groups + B::kGroups - 1) / B::kGroups;
  const int64_t sum_stride = (p.groups + kLanes - 1) / kLanes * kLanes;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs, xe, xg;  // the caller's: a pointer to them goes to the helpers
  xq.resize(p.m * blocks * B::kXBytes);
  xs.resize(p.m * blocks * kLanes);
  xe.resize(p.m * blocks * kLanes);
  xg.resize(p.m * sum_stride);
  for (int64_t r = 0; r < p.m; ++r)
    prepare_row<Bits>(x + r * k, k, xq.data() + r * blocks * B::kXBytes, xs.data() + r * blocks * kLanes,
                      xe.data() + r * blocks * kLanes, xg.data() + r * sum_stride);
  p.x = Activations{xq.data(), xs.data(), xe.data(), xg.data(), blocks, sum_stride};
  over_weight_rows<kTileW>(p.n, kChunksPerWorker, [&](int64_t c0, bool whole) {
    if (whole) tile_rows<Bits, kTileW>(p, c0);
    else tile_rows<Bits, 1>(p, c0);
  });
}
#elif defined(XLASERVE_I8_AVX2)  // quant.h
// With AVX2 but no AVX512-VNNI (AMD Zen 2/3): a group of 32 at a time, as llama.cpp's AVX2 dot products do it:
// `vpmaddubsw` multiplies 32 unsigned weight bytes by 32 signed activation bytes into 16 int16 pair sums (at
// most 2 x 15 x 127, or 2 x 127 x 127 for 8 bits: no saturation), `vpmaddwd` by ones adds those into 8 int32;
// the group's scales follow as a float FMA: acc += float(isum) * (s_w * d_x), and for 4 bits zero_w * sum_x
// over the groups at the end.
//   - 4 bits: the low nibbles are elements 0-15, the high ones 16-31: one ymm in the activations' order.
//   - 8 bits: signed weights: |w| times x with w's sign (`vpsignb`), as vpmaddubsw's first operand is
//     unsigned.
// Tiles of 2 rows of x by 2 weight rows; each output by one thread, in one order. Whole runs of 8 groups
// sum their int32 lanes by a `vphaddd` tree into one vector of 8 group sums, converted and scaled by one FMA
// (one group at a time, each took a conversion, a broadcast factor and an FMA): the 8-bit LM head W[49152,
// 576] at one row 2.45-2.75 -> 1.38-1.90 ms, SmolLM2's 30 layers of 4-bit products at one row 15.5-19.2 ->
// 13.2-15.9 ms (calls included), alternated 3 times on the AMD Zen 3; 4 rows unchanged.
constexpr int kTileX = 2;
constexpr int kTileW = 2;
constexpr int kChunksPerWorker = 4;

struct Rounded {
  const int8_t* q;    // [m, k]: x rounded to int8, in order
  const float* d;     // [m, groups]: each group's scale
  const float* sums;  // [m, groups rounded up to 8]: d x the sum of the group's integers (zeros after)
  int64_t sum_stride;
};

struct Problem {
  Rounded x;
  const uint8_t* q;       // [n, row_bytes]
  const uint16_t* scale;  // f16 [n, groups]
  const uint16_t* zero;   // f16 [n, groups]; 4 bits only
  float* y;               // [m, n]
  int64_t m, k, n, groups, row_bytes;
};

// A group's 32 weights from its bytes: 4 bits as unsigned nibbles in the activations' order, 8 bits as they are.
template <int Bits>
inline __m256i group_weights(const uint8_t* bytes) {
  if (Bits == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)), nibble = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), nibble), _mm_and_si128(b, nibble));
  }
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
}

// A group's products w x (32 activation bytes) summed into 8 int32 lanes.
template <int Bits>
inline __m256i group_sums(__m256i w, __m256i x) {
  const __m256i pairs = Bits == 4 ? _mm256_maddubs_epi16(w, x)
                                  : _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// y[r0 .. r0 + R, c0 .. c0 + C]: R rows of x by C weight rows.
template <int Bits, int R, int C>
void tile(const Problem& p, int64_t r0, int64_t c0) {
  constexpr int64_t group_bytes = kGroup * Bits / 8;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t g = 0;  // whole runs of 8 groups (the header), then one group at a time
  for (; g + 8 <= p.groups; g += 8) {
    for (int c = 0; c < C; ++c) {
      const uint8_t* row = p.q + (c0 + c) * p.row_bytes + g * group_bytes;
      __m256i m[R], h[R], q0[R];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m256i w = group_weights<Bits>(row + i * group_bytes);
        for (int r = 0; r < R; ++r) {
          const __m256i sum = group_sums<Bits>(
              w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.x.q + (r0 + r) * p.k + (g + i) * kGroup)));
          // per 128-bit lane: i odd: h = (i-1, i) pair sums; i = 3: q0 = groups 0-3's 4-lane sums; i = 7: all
          if (i % 2 == 0) {
            m[r] = sum;
          } else if (i % 4 == 1) {
            h[r] = _mm256_hadd_epi32(m[r], sum);
          } else {
            const __m256i q = _mm256_hadd_epi32(h[r], _mm256_hadd_epi32(m[r], sum));
            if (i == 3) {
              q0[r] = q;
            } else {  // lane j: group j's sum (lanes 0-3 from the low 128-bit halves, 4-7 from the high)
              const __m256i all = _mm256_add_epi32(_mm256_permute2x128_si256(q0[r], q, 0x20),
                                                   _mm256_permute2x128_si256(q0[r], q, 0x31));
              const __m256 f = _mm256_mul_ps(
                  _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.scale + (c0 + c) * p.groups + g))),
                  _mm256_loadu_ps(p.x.d + (r0 + r) * p.groups + g));
              acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(all), f, acc[r][c]);
            }
          }
        }
      }
    }
  }
  for (; g < p.groups; ++g) {
    __m256i w[C];
    float s[C];
    for (int c = 0; c < C; ++c) {
      w[c] = group_weights<Bits>(p.q + (c0 + c) * p.row_bytes + g * group_bytes);
      s[c] = _cvtsh_ss(p.scale[(c0 + c) * p.groups + g]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.x.q + (r0 + r) * p.k + g * kGroup));
      const float d = p.x.d[(r0 + r) * p.groups + g];
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_sums<Bits>(w[c], x)), _mm256_set1_ps(s[c] * d), acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float y = hsum8(acc[r][c]);
      if (Bits == 4) {  // + zero x (the group's sum of x')
        const uint16_t* z = p.zero + (c0 + c) * p.groups;
        const float* xs = p.x.sums + (r0 + r) * p.x.sum_stride;
        __m256 t = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= p.groups; g += 8)
          t = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + g))),
                              _mm256_loadu_ps(xs + g), t);
        y += hsum8(t);
        for (; g < p.groups; ++g) y += _cvtsh_ss(z[g]) * xs[g];
      }
      p.y[(r0 + r) * p.n + c0 + c] = y;
    }
}

template <int Bits, int C>
void tile_rows(const Problem& p, int64_t c0) {
  int64_t r0 = 0;
  for (; r0 + kTileX <= p.m; r0 += kTileX) tile<Bits, kTileX, C>(p, r0, c0);
  if (r0 < p.m) tile<Bits, 1, C>(p, r0, c0);
}

template <int Bits>
void run(const float* x, int64_t k, Problem p) {
  const int64_t stride = (p.groups + 7) / 8 * 8;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs;  // the caller's: a pointer to them goes to the helpers
  xq.resize(p.m * k);
  xd.resize(p.m * p.groups);
  xs.assign(p.m * stride, 0.f);
  for (int64_t r = 0; r < p.m; ++r) round_row(x + r * k, k, xq.data() + r * k, xd.data() + r * p.groups, xs.data() + r * stride);
  p.x = Rounded{xq.data(), xd.data(), xs.data(), stride};
  over_weight_rows<kTileW>(p.n, kChunksPerWorker, [&](int64_t c0, bool whole) {
    if (whole) tile_rows<Bits, kTileW>(p, c0);
    else tile_rows<Bits, 1>(p, c0);
  });
}
#endif  // AVX512-VNNI / AVX2

ffi::Error QmatmulI8Impl(ffi::AnyBuffer x, ffi::AnyBuffer q, ffi::Buffer<ffi::F16> scale,
                         ffi::Buffer<ffi::F16> zero, ffi::ResultBuffer<ffi::F32> y, int32_t bits) {
  if (x.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("xlaserve_cpu_qmatmul_i8: x must be f32");
  QShape shape;
  if (ffi::Error error = check_quantized("xlaserve_cpu_qmatmul_i8", x, q, scale, zero, y, bits, shape);
      error.failure())
    return error;
#if defined(XLASERVE_I8) || defined(XLASERVE_I8_AVX2)
  const auto [m, k, n, groups, row_bytes] = shape;
  if (empty_product(shape, y->typed_data())) return ffi::Error::Success();
#if defined(XLASERVE_I8)
  Problem p{{}, static_cast<const uint8_t*>(q.untyped_data()), scale.typed_data(),
            bits == 4 ? zero.typed_data() : nullptr, y->typed_data(), m, n, groups, row_bytes};
#else
  Problem p{{}, static_cast<const uint8_t*>(q.untyped_data()), scale.typed_data(),
            bits == 4 ? zero.typed_data() : nullptr, y->typed_data(), m, k, n, groups, row_bytes};
#endif
  const float* xf = static_cast<const float*>(x.untyped_data());
  if (bits == 4) run<4>(xf, k, p);
  else run<8>(xf, k, p);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("xlaserve_cpu_qmatmul_i8: built without AVX512-VNNI or AVX2");
#endif
}

}  // namespace
}  // namespace xlaserve

// Whether this build has the int8-activation kernels (this file's and qgemm_i8.cc): 1 with AVX512-VNNI
// (AVX512BW, AVX512VL) or with AVX2 (their vpmaddubsw forms), 0 without.
extern "C" int XlaserveCpuHasI8() {
#if defined(XLASERVE_I8) || defined(XLASERVE_I8_AVX2)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuQmatmulI8, xlaserve::QmatmulI8Impl, xlaserve::quantized_binding());
