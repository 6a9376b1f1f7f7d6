// xlaserve CPU GEMM on grouped 4- and 8-bit weights with int8 activations, for many rows (prefill, batched
// decode under `--activation-quantization int8`): y f32[m, n] = x'[m, k] @ W.T, x' being x rounded to int8
// per group of 32 inputs (kernels/quant/reference.py `quantize_activations`) and W in that file's layout
// (GGML's Q4_1 / Q8_0 blocks as arrays). qmatmul_i8.cc takes few rows (lanes along the inputs, one horizontal
// sum per output); kernels/cpu/__init__.py sends more rows here.
//
// Why: qgemm.cc's bf16 path dequantizes every weight to a bf16 pair per call (unpack, scale, convert,
// transpose: on Zen 4 an estimated ~10 ms of a SmolLM2 batch-16 step's ~23 ms of products, what
// 16 rows cost beyond 16/128 of 128 rows' time), and `vdpbf16ps` takes 32
// products an instruction. Here the weights stay integers: AVX512-VNNI's `vpdpbusd` takes 64 (u8 x s8 into
// int32 lanes, 4 each) at the same rate on that core (0.56-0.69 ns an instruction for both), and a panel of
// integers is laid out with masks and in-lane unpacks, no conversions.
//
// How: output columns in panels of kPanel = 48 (three vectors of 16); per panel block of kBlockGroups groups
// the weights are laid out as bytes [input quad][column][4] (`pack_panel`: lane c of a vector holds column c's
// four consecutive inputs, as `vpdpbusd` pairs them with a broadcast quad of one row's activations), and the
// groups' factors as floats [group][column]. A register tile of kTileRows rows x 48 columns sums each group's
// integer products in its own int32 accumulators (8 `vpdpbusd` a row and vector), then adds them into f32:
//   acc += float(isum) * (s_w * d_x) + zero_w * sum_x
// where d_x is the row's activation scale for the group and sum_x = d_x * (the sum of its integers).
//   - 4 bits: the nibbles 0..15 are the unsigned operand; zero_w is the group's zero.
//   - 8 bits: the signed weights are made unsigned by flipping the top bit (q + 128), which adds 128 * sum of
//     the integers to each sum: zero_w = -128 s_w takes it back out.
// Each output is computed by one thread in one fixed order: the result does not depend on which thread took
// which panel. Measured: see docs/benchmarks.md ("int8 activations, many rows").
// Stored panels (`stored_tile`, kernels/quant/reference.py `to_panels`, what models/quantization.py lays a
// model's weights out in where this is built): the same products on weights laid out once at load, so no
// per-call packing; any number of rows, a batch-1 decode's included.
// With AVX2 and no AVX512-VNNI the same scheme runs on 16-column panels with `vpmaddubsw` (its section below;
// docs/benchmarks.md "Without AVX-512"). Without either the library leaves the target out of the dispatch
// (XlaserveCpuHasI8).

#include "common.h"
#include "quant.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

#if defined(XLASERVE_I8) || defined(XLASERVE_I8_AVX2)  // quant.h
struct I8Problem {
  const int8_t* xq;       // [m, k]: x rounded to int8
  const float* xd;        // [m, groups]: each group's activation scale d
  const float* xsum;      // [m, groups]: d * the sum of the group's integers
  const uint8_t* q;       // [n, k / 2] (4 bits) or [n, k] (8 bits)
  const uint16_t* scale;  // f16 [n, groups]
  const uint16_t* zero;   // f16 [n, groups]; 4 bits only
  float* y;               // [m, n]
  int64_t m, k, n, groups, row_bytes;
  LiveRows live;  // the rows computed (a step's tokens), the others zeros
};

// fn(std::integral_constant<int, R>{}) for a tile of `rows` rows: R = 1, 2 or 3, or else Full (a whole tile).
template <int Full, typename Fn>
inline void with_tile_rows(int64_t rows, Fn fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    default: return fn(std::integral_constant<int, Full>{});
  }
}
#endif

#if defined(XLASERVE_I8)  // quant.h

constexpr int kVecs = 3;                         // vectors of output columns per register tile
constexpr int64_t kPanel = kVecs * kLanes;       // output columns per panel
constexpr int kTileRows = 4;                     // rows of x per register tile: 12 int32 + 12 f32 accumulators
constexpr int64_t kBlockGroups = 16;             // groups per panel block: 24 KB of weight bytes
constexpr int64_t kRunsPerThread = 0;            // 0: panels claimed one at a time
constexpr int64_t kQuads = kGroup / 4;           // input quads per group
constexpr int64_t kQuadBytes = kPanel * 4;       // a quad's bytes in the panel
// Rows [r0, r1) of f32 x[m, k] rounded to int8 per group: xq [m, k], xd and xsum [m, groups] as I8Problem's.
void quantize_rows(const float* x, int64_t k, int64_t r0, int64_t r1, int8_t* xq, float* xd, float* xsum) {
  const int64_t groups = k / kGroup;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      __m512i lo, hi;
      float d;
      quantize_group(x + r * k + g * kGroup, lo, hi, d);
      int8_t* out = xq + r * k + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + kLanes), _mm512_cvtsepi32_epi8(hi));
      xd[r * groups + g] = d;
      xsum[r * groups + g] = d * float(_mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi)));
    }
}

// a, b, c, d's 128-bit lanes transposed: out[u] = [a_u, b_u, c_u, d_u].
inline void transpose_lanes(__m512i a, __m512i b, __m512i c, __m512i d, __m512i (&out)[4]) {
  const __m512i t0 = _mm512_shuffle_i64x2(a, b, 0x44), t1 = _mm512_shuffle_i64x2(a, b, 0xee);
  const __m512i t2 = _mm512_shuffle_i64x2(c, d, 0x44), t3 = _mm512_shuffle_i64x2(c, d, 0xee);
  out[0] = _mm512_shuffle_i64x2(t0, t2, 0x88);
  out[1] = _mm512_shuffle_i64x2(t0, t2, 0xdd);
  out[2] = _mm512_shuffle_i64x2(t1, t3, 0x88);
  out[3] = _mm512_shuffle_i64x2(t1, t3, 0xdd);
}

// v[t] (t = 0..3) holding column 4j + t's four dwords (input quads 0-3) in 128-bit lane j -> out[quad] holding
// quad `quad` of columns 0..15 in order: a 4 x 4 transpose of dwords in every 128-bit lane.
inline void quads_by_column(const __m512i (&v)[4], __m512i (&out)[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// The panel block of columns [c0, c0 + kPanel) and groups [g0, g0 + ng): weight bytes w[(g - g0) * kQuads +
// quad][column][4] as unsigned integers, factors s[(g - g0) * kPanel + column] (the weight scale) and
// z[...] (4 bits: the zero; 8 bits: -128 x the scale); columns past n all zeros.
template <int Bits>
void pack_panel(const I8Problem& p, int64_t c0, int64_t g0, int64_t ng, uint8_t* w, float* s, float* z) {
  constexpr int64_t group_bytes = kGroup * Bits / 8;
  const __m512i nibble = _mm512_set1_epi8(15), top = _mm512_set1_epi8(char(0x80));
  const int64_t live = std::min<int64_t>(kPanel, p.n - c0);
  // The factors 16 columns at a time: each column's halves of the block's groups converted as one vector,
  // the 16 vectors transposed into [group][column] (a column past n: zeros). Column after column, each
  // factor stored on its own a kPanel apart, SmolLM2's products at 16 rows took 20.1-21.3 ms against
  // 17.7-21.1 (best of 12-24, alternated; docs/benchmarks.md "Session 26").
  static_assert(kBlockGroups <= kLanes, "a block's groups are one vector of a column's factors");
  const __mmask16 groups = __mmask16((1u << ng) - 1);
  for (int64_t b = 0; b < kPanel; b += kLanes) {
    for (int f = 0; f < (Bits == 4 ? 2 : 1); ++f) {
      const uint16_t* src = f == 0 ? p.scale : p.zero;
      vec v[kLanes];
      for (int i = 0; i < kLanes; ++i)
        v[i] = b + i < live
                   ? (vec)_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(groups, src + (c0 + b + i) * p.groups + g0))
                   : splat(0.f);
      transpose16(v);
      for (int64_t g = 0; g < ng; ++g) {
        store((f == 0 ? s : z) + g * kPanel + b, v[g]);
        if (Bits == 8) store(z + g * kPanel + b, v[g] * splat(-128.f));
      }
    }
  }
  // 16 columns at a time, a cache line of each row at a time (4 groups of 4 bits, 2 of 8): the 16 lines'
  // 128-bit units (a group, or half of one at 8 bits) gathered four columns a vector by lane transposes, each
  // unit's bytes made unsigned integers (4 bits: split into the low nibbles, inputs 0-15, and the high ones,
  // 16-31), and its quads put in column order (`quads_by_column`).
  const int64_t end = (g0 + ng) * group_bytes;
  for (int64_t b = 0; b < kPanel; b += kLanes) {
    const int64_t next = b + kLanes < live ? std::min<int64_t>(kLanes, live - b - kLanes) : 0;
    for (int64_t offset = g0 * group_bytes; offset < end; offset += 64) {
      // The next 16 columns' same line: rows a row apart, which the hardware prefetcher does not follow.
      for (int64_t i = 0; i < next; ++i) __builtin_prefetch(p.q + (c0 + b + kLanes + i) * p.row_bytes + offset);
      const __mmask64 bytes = end - offset >= 64 ? ~__mmask64(0) : (__mmask64(1) << (end - offset)) - 1;
      __m512i line[kLanes];
      for (int i = 0; i < kLanes; ++i)  // a column past n: zeros (its factors are zero)
        line[i] = b + i < live ? _mm512_maskz_loadu_epi8(bytes, p.q + (c0 + b + i) * p.row_bytes + offset)
                               : _mm512_setzero_si512();
      __m512i unit[4][4];  // [t][u]: lane j holds column 4j + t's unit u
      for (int t = 0; t < 4; ++t) transpose_lanes(line[t], line[4 + t], line[8 + t], line[12 + t], unit[t]);
      const int64_t units = std::min<int64_t>(4, (end - offset) / 16);
      for (int u = 0; u < units; ++u) {
        const int64_t g = (offset - g0 * group_bytes + 16 * u) / group_bytes;  // within the block
        __m512i quads[4];
        if (Bits == 4) {
          __m512i lo[4], hi[4];
          for (int t = 0; t < 4; ++t) {
            lo[t] = _mm512_and_si512(unit[t][u], nibble);
            hi[t] = _mm512_and_si512(_mm512_srli_epi16(unit[t][u], 4), nibble);
          }
          uint8_t* out = w + g * kQuads * kQuadBytes + b * 4;
          quads_by_column(lo, quads);
          for (int i = 0; i < 4; ++i) _mm512_storeu_si512(out + i * kQuadBytes, quads[i]);
          quads_by_column(hi, quads);
          for (int i = 0; i < 4; ++i) _mm512_storeu_si512(out + (4 + i) * kQuadBytes, quads[i]);
        } else {  // (a column past n: 0x80 bytes, finite products that its zero factors cancel)
          __m512i v[4];
          for (int t = 0; t < 4; ++t) v[t] = _mm512_xor_si512(unit[t][u], top);
          uint8_t* out = w + (g * kQuads + 4 * (u % 2)) * kQuadBytes + b * 4;
          quads_by_column(v, quads);
          for (int i = 0; i < 4; ++i) _mm512_storeu_si512(out + i * kQuadBytes, quads[i]);
        }
      }
    }
  }
}

// out[(r0 + i) * ld + j] (+)= rows [r0, r0 + R) of x' times the panel block (groups [g0, g0 + ng)), j < kPanel.
template <int R>
void tile(const I8Problem& p, const uint8_t* w, const float* s, const float* z, int64_t r0, int64_t g0,
          int64_t ng, float* out, int64_t ld, bool first) {
  __m512 acc[R][kVecs];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < kVecs; ++v)
      acc[i][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (r0 + i) * ld + v * kLanes);
  for (int64_t g = 0; g < ng; ++g) {
    __m512i sum[R][kVecs];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < kVecs; ++v) sum[i][v] = _mm512_setzero_si512();
    const uint8_t* wg = w + g * kQuads * kQuadBytes;
    const int8_t* xg = p.xq + r0 * p.k + (g0 + g) * kGroup;
    for (int64_t quad = 0; quad < kQuads; ++quad) {
      __m512i wv[kVecs];
      for (int v = 0; v < kVecs; ++v) wv[v] = _mm512_loadu_si512(wg + quad * kQuadBytes + v * 64);
      for (int i = 0; i < R; ++i) {
        int32_t four;
        std::memcpy(&four, xg + i * p.k + quad * 4, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        for (int v = 0; v < kVecs; ++v) sum[i][v] = _mm512_dpbusd_epi32(sum[i][v], wv[v], xb);
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m512 d = _mm512_set1_ps(p.xd[(r0 + i) * p.groups + g0 + g]);
      const __m512 xs = _mm512_set1_ps(p.xsum[(r0 + i) * p.groups + g0 + g]);
      for (int v = 0; v < kVecs; ++v) {
        const __m512 sw = _mm512_loadu_ps(s + g * kPanel + v * kLanes);
        acc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][v]), _mm512_mul_ps(sw, d), acc[i][v]);
        acc[i][v] = _mm512_fmadd_ps(_mm512_loadu_ps(z + g * kPanel + v * kLanes), xs, acc[i][v]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(out + (r0 + i) * ld + v * kLanes, acc[i][v]);
}

template <int Bits>  // (one tile for both: the 8-bit weights' offset is in z)
void tile_rows(const I8Problem& p, const uint8_t* w, const float* s, const float* z, int64_t r0, int64_t rows,
               int64_t g0, int64_t ng, float* out, int64_t ld, bool first) {
  with_tile_rows<kTileRows>(rows, [&](auto r) {
    tile<decltype(r)::value>(p, w, s, z, r0, g0, ng, out, ld, first);
  });
}

// Live rows for which a tile prefetches the next tile's weights: from DRAM such a tile took about as long as
// reading its weights plus multiplying them from cache (SmolLM2's 3,072 x 576 4-bit product, 8 rows: 65 us
// against 40 for 1 row and 27 from L3), the hardware prefetcher not running ahead of the multiplies. One
// tile on, 8 rows took 41-44 us and 16 rows 104 -> 62-63 (2 threads, chained products, alternated); with
// one run of tiles per thread (`stored_fetch`), 1 row 40 -> 34-37 too. Prefill (hundreds of rows)
// multiplies each block of weights by many tiles and is left to the hardware.
constexpr int64_t kFetchRows[2] = {1, 32};

// Whether a product of these live rows on stored panels prefetches. Its tiles are then split into one run of
// contiguous tiles per thread, so the tile a thread prefetches is the one it multiplies next (claimed one at
// a time, it was often the other thread's): 200 chained 960 x 576 products, 8 rows 3.7-3.9 -> 2.9-3.0 ms,
// 16 rows 5.0-5.3 -> 4.3-4.5; 1 row (prefetching only with the runs) 2.9-3.4 -> 2.2-2.5.
inline bool stored_fetch(const LiveRows& live) {
  return live.count() >= kFetchRows[0] && live.count() <= kFetchRows[1];
}

// Stored panels (kernels/quant/reference.py `to_panels`, its PANEL = kLanes): the weights already lie as a
// tile wants them, so nothing is packed per call. A stored unit's 64 bytes are one vector, 16 columns x 4:
// 4 bits, quad u of those columns in the low nibbles and quad u + 4 in the high ones (split by a mask and a
// shift as they are read); 8 bits, quad u as signed bytes, made unsigned by flipping the top bit (as
// pack_panel does; the offset taken back out by -128 x the scale). The factors stay f16 ([group][column]),
// a vector's 16 converted at once. A register tile takes V <= kVecs consecutive stored panels: V streams.
// out[(r0 + i) * n + j] (+)= rows [r0, r0 + R) of x' times stored panels [panel, panel + V)'s groups
// [g0, g0 + ng), j < V * kLanes.
template <int Bits, int R, int V, bool Fetch>
void stored_tile(const I8Problem& p, int64_t panel, int64_t r0, int64_t g0, int64_t ng, bool first) {
  constexpr int64_t group_bytes = kLanes * kGroup * Bits / 8;  // a group's bytes in a stored panel
  const __m512i nibble = _mm512_set1_epi8(15), top = _mm512_set1_epi8(char(0x80));
  const uint8_t* w[V];
  const uint16_t* s[V];
  const uint16_t* z[V];
  for (int v = 0; v < V; ++v) {
    w[v] = p.q + (panel + v) * kLanes * p.row_bytes;
    s[v] = p.scale + (panel + v) * kLanes * p.groups;
    z[v] = Bits == 4 ? p.zero + (panel + v) * kLanes * p.groups : nullptr;
  }
  float* const out = p.y + panel * kLanes;
  // `Fetch`: the next tile's panels (the same offsets one tile on) prefetched as this tile reads its own.
  const int64_t next_w = V * kLanes * p.row_bytes, next_s = V * kLanes * p.groups;
  __m512 acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v)
      acc[i][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (r0 + i) * p.n + v * kLanes);
  for (int64_t g = g0; g < g0 + ng; ++g) {
    __m512i sum[R][V];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < V; ++v) sum[i][v] = _mm512_setzero_si512();
    const int8_t* xg = p.xq + r0 * p.k + g * kGroup;
    if (Bits == 4) {
      for (int u = 0; u < 4; ++u) {
        __m512i b[V];
        for (int v = 0; v < V; ++v) b[v] = _mm512_loadu_si512(w[v] + g * group_bytes + u * 64);
        if constexpr (Fetch)
          for (int v = 0; v < V; ++v) __builtin_prefetch(w[v] + next_w + g * group_bytes + u * 64);
        for (int half = 0; half < 2; ++half) {
          __m512i nib[V];
          for (int v = 0; v < V; ++v)
            nib[v] = _mm512_and_si512(half ? _mm512_srli_epi16(b[v], 4) : b[v], nibble);
          for (int i = 0; i < R; ++i) {
            int32_t four;
            std::memcpy(&four, xg + i * p.k + 16 * half + u * 4, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            for (int v = 0; v < V; ++v) sum[i][v] = _mm512_dpbusd_epi32(sum[i][v], nib[v], xb);
          }
        }
      }
    } else {
      for (int64_t quad = 0; quad < kQuads; ++quad) {
        __m512i wv[V];
        for (int v = 0; v < V; ++v)
          wv[v] = _mm512_xor_si512(_mm512_loadu_si512(w[v] + g * group_bytes + quad * 64), top);
        if constexpr (Fetch)
          for (int v = 0; v < V; ++v) __builtin_prefetch(w[v] + next_w + g * group_bytes + quad * 64);
        for (int i = 0; i < R; ++i) {
          int32_t four;
          std::memcpy(&four, xg + i * p.k + quad * 4, 4);
          const __m512i xb = _mm512_set1_epi32(four);
          for (int v = 0; v < V; ++v) sum[i][v] = _mm512_dpbusd_epi32(sum[i][v], wv[v], xb);
        }
      }
    }
    if (Fetch && g % 2 == 0)  // a line holds two groups' factors
      for (int v = 0; v < V; ++v) {
        __builtin_prefetch(s[v] + next_s + g * kLanes);
        if (Bits == 4) __builtin_prefetch(z[v] + next_s + g * kLanes);
      }
    __m512 sw[V], zw[V];
    for (int v = 0; v < V; ++v) {
      sw[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s[v] + g * kLanes)));
      zw[v] = Bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(z[v] + g * kLanes)))
                        : _mm512_mul_ps(sw[v], _mm512_set1_ps(-128.f));
    }
    for (int i = 0; i < R; ++i) {
      const __m512 d = _mm512_set1_ps(p.xd[(r0 + i) * p.groups + g]);
      const __m512 xs = _mm512_set1_ps(p.xsum[(r0 + i) * p.groups + g]);
      for (int v = 0; v < V; ++v) {
        acc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][v]), _mm512_mul_ps(sw[v], d), acc[i][v]);
        acc[i][v] = _mm512_fmadd_ps(zw[v], xs, acc[i][v]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + (r0 + i) * p.n + v * kLanes, acc[i][v]);
}

template <int Bits, int V>
void stored_tile_rows(const I8Problem& p, int64_t panel, int64_t r0, int64_t rows, int64_t g0, int64_t ng,
                      bool first, bool fetch) {
  with_tile_rows<kTileRows>(rows, [&](auto r) {
    if (fetch) stored_tile<Bits, decltype(r)::value, V, true>(p, panel, r0, g0, ng, first);
    else stored_tile<Bits, decltype(r)::value, V, false>(p, panel, r0, g0, ng, first);
  });
}

// Output columns [c * kPanel, (c + 1) * kPanel) of y (stored panels [c * kVecs, ...), fewer at the end), by
// the calling thread: blocks of kBlockGroups groups, each multiplied by every tile of rows while in L1.
template <int Bits>
void stored_panel_columns(const I8Problem& p, int64_t c) {
  const int64_t panel = c * kVecs, count = std::min<int64_t>(kVecs, p.n / kLanes - panel);
  const bool ahead = stored_fetch(p.live);
  for (int64_t g0 = 0; g0 < p.groups; g0 += kBlockGroups) {
    const int64_t ng = std::min(kBlockGroups, p.groups - g0);
    bool fetch = ahead;  // the block's first tile of rows (the others find its weights in L1)
    p.live.for_tiles<kTileRows>([&](int64_t r0, int64_t rows) {
      static_assert(kVecs == 3, "a tile of 1 to 3 stored panels");
      if (count == 3) stored_tile_rows<Bits, 3>(p, panel, r0, rows, g0, ng, g0 == 0, fetch);
      else if (count == 2) stored_tile_rows<Bits, 2>(p, panel, r0, rows, g0, ng, g0 == 0, fetch);
      else stored_tile_rows<Bits, 1>(p, panel, r0, rows, g0, ng, g0 == 0, fetch);
      fetch = false;
    });
  }
}
constexpr int64_t kStoredPanel = kLanes;
#define XLASERVE_STORED_PANELS 1  // qmatmul_panels below is built

#elif defined(XLASERVE_I8_AVX2)  // quant.h
// With AVX2 but no AVX512-VNNI (AMD Zen 2/3): `vpmaddubsw` multiplies 32 unsigned weight bytes by 32 signed
// activation bytes into 16 int16 pair sums, `vpmaddwd` by ones adds pairs of those into 8 int32 (llama.cpp's
// AVX2 way, as qmatmul_i8.cc's AVX2 form). The panel is laid out as above, 16 columns (two ymm of 8) wide.
//   - 4 bits: a pair sum is at most 2 x 15 x 127 = 3810, so a group's 8 quads add up in the int16 lanes
//     (`vpaddw`, at most 30480) and one `vpmaddwd` a group turns them into int32: 2 integer operations a quad,
//     row and vector, against 3 for a `vpdpbusd` emulated quad by quad.
//   - 8 bits: signed weights, |w| times x with w's sign (`vpsignb`; 2 x 127 x 127 at most a pair, no room
//     to add two), `vpmaddwd` and `vpaddd` every quad; no offset to take back out (z unused).
constexpr int kVecs = 2;                         // vectors (8 columns) of output columns per register tile
constexpr int64_t kPanel = kVecs * 8;            // output columns per panel
constexpr int kTileRows = 4;                     // rows of x per register tile: 8 integer + 8 f32 accumulators
constexpr int64_t kBlockGroups = 16;             // groups per panel block: 8 KB of weight bytes
constexpr int64_t kRunsPerThread = 4;            // runs of contiguous panels per thread
constexpr int64_t kQuads = kGroup / 4;           // input quads per group
constexpr int64_t kQuadBytes = kPanel * 4;       // a quad's bytes in the panel

void quantize_rows(const float* x, int64_t k, int64_t r0, int64_t r1, int8_t* xq, float* xd, float* xsum) {
  const int64_t groups = k / kGroup;
  for (int64_t r = r0; r < r1; ++r) round_row(x + r * k, k, xq + r * k, xd + r * groups, xsum + r * groups);
}

// v[t] (t = 0..3) holding column t's four dwords (input quads) in its low 128-bit lane and column 4 + t's in
// its high one -> out[quad] holding quad `quad` of columns 0..7 in order: a 4 x 4 transpose of dwords per lane.
inline void quads_by_column(const __m256i (&v)[4], __m256i (&out)[4]) {
  const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2);
  out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3);
  out[3] = _mm256_unpackhi_epi64(t1, t3);
}

// The panel block of columns [c0, c0 + kPanel) and groups [g0, g0 + ng): weight bytes w[(g - g0) * kQuads +
// quad][column][4] (4 bits: the nibbles; 8 bits: the signed weights as they are), factors s[(g - g0) * kPanel
// + column] (the weight scale) and, 4 bits, z[...] (the zero); columns past n all zeros.
template <int Bits>
void pack_panel(const I8Problem& p, int64_t c0, int64_t g0, int64_t ng, uint8_t* w, float* s, float* z) {
  constexpr int64_t group_bytes = kGroup * Bits / 8;
  const int64_t live = std::min<int64_t>(kPanel, p.n - c0);
  for (int64_t c = 0; c < kPanel; ++c) {
    for (int f = 0; f < (Bits == 4 ? 2 : 1); ++f) {
      float* out = (f == 0 ? s : z) + c;
      if (c >= live) {
        for (int64_t g = 0; g < ng; ++g) out[g * kPanel] = 0.f;
        continue;
      }
      const uint16_t* src = (f == 0 ? p.scale : p.zero) + (c0 + c) * p.groups + g0;
      float v[kBlockGroups];
      halves_to_floats(src, v, ng);
      for (int64_t g = 0; g < ng; ++g) out[g * kPanel] = v[g];
    }
  }
  const __m128i nibble = _mm_set1_epi8(15);
  for (int64_t b = 0; b < kPanel; b += 8) {
    for (int64_t g = 0; g < ng; ++g) {
      const uint8_t* src[8];
      for (int i = 0; i < 8; ++i) src[i] = b + i < live ? p.q + (c0 + b + i) * p.row_bytes + (g0 + g) * group_bytes : nullptr;
      // At each new cache line of the rows, the same line of the next 8 columns (this panel's or the next
      // panel's first): rows a row apart, which the hardware prefetcher does not follow.
      if ((g0 + g) * group_bytes % 64 == 0)
        for (int64_t c = c0 + b + 8; c < std::min(p.n, c0 + b + 16); ++c)
          __builtin_prefetch(p.q + c * p.row_bytes + (g0 + g) * group_bytes);
      uint8_t* out = w + g * kQuads * kQuadBytes + b * 4;
      __m256i quads[4];
      if (Bits == 4) {  // a column's 16 bytes: quads 0-3 in the low nibbles, 4-7 in the high ones
        __m256i lo[4], hi[4];
        for (int t = 0; t < 4; ++t) {
          const __m128i a = src[t] ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[t])) : _mm_setzero_si128();
          const __m128i e = src[4 + t] ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[4 + t]))
                                       : _mm_setzero_si128();
          lo[t] = _mm256_set_m128i(_mm_and_si128(e, nibble), _mm_and_si128(a, nibble));
          hi[t] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(e, 4), nibble),
                                   _mm_and_si128(_mm_srli_epi16(a, 4), nibble));
        }
        quads_by_column(lo, quads);
        for (int i = 0; i < 4; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * kQuadBytes), quads[i]);
        quads_by_column(hi, quads);
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (4 + i) * kQuadBytes), quads[i]);
      } else {  // a column's 32 bytes: quads 0-3, then 4-7
        __m256i row[8];
        for (int i = 0; i < 8; ++i)
          row[i] = src[i] ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[i])) : _mm256_setzero_si256();
        for (int half = 0; half < 2; ++half) {
          __m256i v[4];
          for (int t = 0; t < 4; ++t) v[t] = _mm256_permute2x128_si256(row[t], row[4 + t], half ? 0x31 : 0x20);
          quads_by_column(v, quads);
          for (int i = 0; i < 4; ++i)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (4 * half + i) * kQuadBytes), quads[i]);
        }
      }
    }
  }
}

// out[(r0 + i) * ld + j] (+)= rows [r0, r0 + R) of x' times the panel block (groups [g0, g0 + ng)), j < kPanel.
template <int Bits, int R>
void tile(const I8Problem& p, const uint8_t* w, const float* s, const float* z, int64_t r0, int64_t g0,
          int64_t ng, float* out, int64_t ld, bool first) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][kVecs];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < kVecs; ++v)
      acc[i][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (r0 + i) * ld + v * 8);
  for (int64_t g = 0; g < ng; ++g) {
    __m256i sum[R][kVecs];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < kVecs; ++v) sum[i][v] = _mm256_setzero_si256();
    const uint8_t* wg = w + g * kQuads * kQuadBytes;
    const int8_t* xg = p.xq + r0 * p.k + (g0 + g) * kGroup;
#pragma GCC unroll 1
    for (int64_t quad = 0; quad < kQuads; ++quad) {
      __m256i wv[kVecs];
      for (int v = 0; v < kVecs; ++v) wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + quad * kQuadBytes + v * 32));
      __m256i wabs[kVecs];
      if (Bits == 8)
        for (int v = 0; v < kVecs; ++v) wabs[v] = _mm256_sign_epi8(wv[v], wv[v]);
      for (int i = 0; i < R; ++i) {
        int32_t four;
        std::memcpy(&four, xg + i * p.k + quad * 4, 4);
        const __m256i xb = _mm256_set1_epi32(four);
        for (int v = 0; v < kVecs; ++v) {
          if (Bits == 4) {
            sum[i][v] = _mm256_add_epi16(sum[i][v], _mm256_maddubs_epi16(wv[v], xb));
          } else {
            const __m256i pairs = _mm256_maddubs_epi16(wabs[v], _mm256_sign_epi8(xb, wv[v]));
            sum[i][v] = _mm256_add_epi32(sum[i][v], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m256 d = _mm256_set1_ps(p.xd[(r0 + i) * p.groups + g0 + g]);
      const __m256 xs = _mm256_set1_ps(p.xsum[(r0 + i) * p.groups + g0 + g]);
      for (int v = 0; v < kVecs; ++v) {
        const __m256i isum = Bits == 4 ? _mm256_madd_epi16(sum[i][v], ones) : sum[i][v];
        const __m256 sw = _mm256_loadu_ps(s + g * kPanel + v * 8);
        acc[i][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sw, d), acc[i][v]);
        if (Bits == 4) acc[i][v] = _mm256_fmadd_ps(_mm256_loadu_ps(z + g * kPanel + v * 8), xs, acc[i][v]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(out + (r0 + i) * ld + v * 8, acc[i][v]);
}

template <int Bits>
void tile_rows(const I8Problem& p, const uint8_t* w, const float* s, const float* z, int64_t r0, int64_t rows,
               int64_t g0, int64_t ng, float* out, int64_t ld, bool first) {
  with_tile_rows<kTileRows>(rows, [&](auto r) {
    tile<Bits, decltype(r)::value>(p, w, s, z, r0, g0, ng, out, ld, first);
  });
}

// Stored panels (kernels/quant/reference.py `to_panels`, kPanel = its PANEL): the weights already lie as a
// panel block wants them, so nothing is packed per call; the 4-bit ones stay packed two to a byte, a
// stored unit's 32 bytes (8 columns x 4) holding quad u of those columns in their low nibbles and quad
// u + 4 in their high ones, split by a mask and a shift as they are read; the factors stay f16
// ([group][column]), converted 8 at a time.
// out[(r0 + i) * n + j] (+)= rows [r0, r0 + R) of x' times panel `panel`'s groups [g0, g0 + ng), j < kPanel.
template <int Bits, int R>
void stored_tile(const I8Problem& p, int64_t panel, int64_t r0, int64_t g0, int64_t ng, bool first) {
  constexpr int64_t group_bytes = kPanel * kGroup * Bits / 8;  // a group's bytes in a panel
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15);
  const uint8_t* const w = p.q + panel * kPanel * p.row_bytes;
  const uint16_t* const s = p.scale + panel * kPanel * p.groups;
  const uint16_t* const z = Bits == 4 ? p.zero + panel * kPanel * p.groups : nullptr;
  float* const out = p.y + panel * kPanel;
  __m256 acc[R][kVecs];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < kVecs; ++v)
      acc[i][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (r0 + i) * p.n + v * 8);
  for (int64_t g = g0; g < g0 + ng; ++g) {
    __m256i sum[R][kVecs];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < kVecs; ++v) sum[i][v] = _mm256_setzero_si256();
    const uint8_t* wg = w + g * group_bytes;
    const int8_t* xg = p.xq + r0 * p.k + g * kGroup;
    if (Bits == 4) {
#pragma GCC unroll 1
      for (int u = 0; u < 4; ++u) {
        __m256i lo[kVecs], hi[kVecs];
        for (int v = 0; v < kVecs; ++v) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + u * kQuadBytes + v * 32));
          lo[v] = _mm256_and_si256(b, nibble);
          hi[v] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
        }
        for (int i = 0; i < R; ++i) {
          int32_t a, c;
          std::memcpy(&a, xg + i * p.k + u * 4, 4);
          std::memcpy(&c, xg + i * p.k + 16 + u * 4, 4);
          const __m256i xa = _mm256_set1_epi32(a), xc = _mm256_set1_epi32(c);
          for (int v = 0; v < kVecs; ++v)  // 8 quads of pair sums, at most 8 x 3810: no int16 overflow
            sum[i][v] = _mm256_add_epi16(sum[i][v], _mm256_add_epi16(_mm256_maddubs_epi16(lo[v], xa),
                                                                     _mm256_maddubs_epi16(hi[v], xc)));
        }
      }
    } else {
#pragma GCC unroll 1
      for (int64_t quad = 0; quad < kQuads; ++quad) {
        __m256i wv[kVecs], wabs[kVecs];
        for (int v = 0; v < kVecs; ++v) {
          wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + quad * kQuadBytes + v * 32));
          wabs[v] = _mm256_sign_epi8(wv[v], wv[v]);
        }
        for (int i = 0; i < R; ++i) {
          int32_t four;
          std::memcpy(&four, xg + i * p.k + quad * 4, 4);
          const __m256i xb = _mm256_set1_epi32(four);
          for (int v = 0; v < kVecs; ++v)
            sum[i][v] = _mm256_add_epi32(
                sum[i][v], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[v], _mm256_sign_epi8(xb, wv[v])), ones));
        }
      }
    }
    __m256 sw[kVecs], zw[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      sw[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g * kPanel + v * 8)));
      if (Bits == 4) zw[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + g * kPanel + v * 8)));
    }
    for (int i = 0; i < R; ++i) {
      const __m256 d = _mm256_set1_ps(p.xd[(r0 + i) * p.groups + g]);
      const __m256 xs = _mm256_set1_ps(p.xsum[(r0 + i) * p.groups + g]);
      for (int v = 0; v < kVecs; ++v) {
        const __m256i isum = Bits == 4 ? _mm256_madd_epi16(sum[i][v], ones) : sum[i][v];
        acc[i][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sw[v], d), acc[i][v]);
        if (Bits == 4) acc[i][v] = _mm256_fmadd_ps(zw[v], xs, acc[i][v]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(out + (r0 + i) * p.n + v * 8, acc[i][v]);
}

// Output columns of panel `panel` of y, by the calling thread: blocks of kBlockGroups groups, each multiplied
// by every tile of rows while it is in L1.
template <int Bits>
void stored_panel_columns(const I8Problem& p, int64_t panel) {
  for (int64_t g0 = 0; g0 < p.groups; g0 += kBlockGroups) {
    const int64_t ng = std::min(kBlockGroups, p.groups - g0);
    p.live.for_tiles<kTileRows>([&](int64_t r0, int64_t rows) {
      with_tile_rows<kTileRows>(rows, [&](auto r) {
        stored_tile<Bits, decltype(r)::value>(p, panel, r0, g0, ng, g0 == 0);
      });
    });
  }
}
constexpr int64_t kStoredPanel = kPanel;
#define XLASERVE_STORED_PANELS 1  // qmatmul_panels below is built
#endif  // XLASERVE_I8 / XLASERVE_I8_AVX2

#if defined(XLASERVE_I8) || defined(XLASERVE_I8_AVX2)
// Output columns [c0, c0 + kPanel) of y, by the calling thread. A panel cut short by n is summed into the
// thread's scratch (kPanel wide) and its columns copied out at the end.
template <int Bits>
void panel_columns(const I8Problem& p, int64_t c0) {
  thread_local std::vector<uint8_t> weights;
  thread_local std::vector<float> factors, partial;
  weights.resize(kBlockGroups * kQuads * kQuadBytes);
  factors.resize(2 * kBlockGroups * kPanel);
  float* const s = factors.data();
  float* const z = s + kBlockGroups * kPanel;
  const bool whole = c0 + kPanel <= p.n;
  if (!whole) partial.resize(p.m * kPanel);
  float* const out = whole ? p.y + c0 : partial.data();
  const int64_t ld = whole ? p.n : kPanel;
  // The next panel's scales and zeros (rows `groups` halves apart, each read in a few places): their loads
  // waited on DRAM at the start of each panel block.
  for (int64_t c = c0 + kPanel; c < std::min(p.n, c0 + 2 * kPanel); ++c)
    for (int64_t b = 0; b < p.groups * 2; b += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(p.scale + c * p.groups) + b);
      if (Bits == 4) __builtin_prefetch(reinterpret_cast<const char*>(p.zero + c * p.groups) + b);
    }
  for (int64_t g0 = 0; g0 < p.groups; g0 += kBlockGroups) {
    const int64_t ng = std::min(kBlockGroups, p.groups - g0);
    pack_panel<Bits>(p, c0, g0, ng, weights.data(), s, z);
    p.live.for_tiles<kTileRows>([&](int64_t r0, int64_t rows) {
      tile_rows<Bits>(p, weights.data(), s, z, r0, rows, g0, ng, out, ld, g0 == 0);
    });
  }
  if (!whole)
    p.live.for_tiles<1>([&](int64_t r, int64_t) {
      std::memcpy(p.y + r * p.n + c0, out + r * kPanel, sizeof(float) * (p.n - c0));
    });
}

// `stored`: W in stored panels (stored_panel_columns), else in rows (panel_columns packs them).
void run(const float* x, I8Problem p, int bits, [[maybe_unused]] bool stored) {
  thread_local std::vector<int8_t> xq;  // the caller's: pointers to them go to the helpers
  thread_local std::vector<float> xd, xsum;
  xq.resize(p.m * p.k);
  xd.resize(p.m * p.groups);
  xsum.resize(p.m * p.groups);
  // Locals, not the thread_locals themselves, in the lambdas: a helper thread naming those gets its own.
  int8_t* const q8 = xq.data();
  float* const scales = xd.data();
  float* const sums = xsum.data();
  p.xq = q8;
  p.xd = scales;
  p.xsum = sums;
  Workers& workers = Workers::get();
  // Padding rows (outside the live ranges) are zeros, neither rounded nor multiplied.
  p.live.zero_others(p.y, p.m, p.n);
  constexpr int64_t kRowsPerChunk = 16;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  p.live.for_tiles<kRowsPerChunk>([&](int64_t r0, int64_t rows) { chunks.emplace_back(r0, r0 + rows); });
  workers.parallel_for(int64_t(chunks.size()), [&](int64_t c, int) {
    quantize_rows(x, p.k, chunks[c].first, chunks[c].second, q8, scales, sums);
  });
  // Runs of panels, claimed dynamically: each thread walks its run's weight rows front to back (the AVX2
  // pack_panel prefetches the next columns' lines: SmolLM2's products at 32 rows, AMD Zen 3, 74-79 -> 64-70
  // ms, alternated; with AVX-512 one panel at a time, as measured there, except one run a thread where the
  // stored tiles prefetch: `stored_fetch`).
  const int64_t panels = (p.n + kPanel - 1) / kPanel;
  const int64_t threads = workers.size() + 1;
  int64_t run_panels = 1;
  if constexpr (kRunsPerThread > 0) run_panels = std::max<int64_t>(1, panels / (kRunsPerThread * threads));
#if defined(XLASERVE_STORED_PANELS) && defined(XLASERVE_I8)
  if (stored && stored_fetch(p.live)) run_panels = (panels + threads - 1) / threads;
#endif
  workers.parallel_for((panels + run_panels - 1) / run_panels, [&](int64_t r, int) {
    for (int64_t c = r * run_panels; c < std::min(panels, (r + 1) * run_panels); ++c) {
#if defined(XLASERVE_STORED_PANELS)
      if (stored) {
        if (bits == 4) stored_panel_columns<4>(p, c);
        else stored_panel_columns<8>(p, c);
        continue;
      }
#endif
      if (bits == 4) panel_columns<4>(p, c * kPanel);
      else panel_columns<8>(p, c * kPanel);
    }
  });
}
#endif

// The product of `target`: on W in rows (qgemm_i8, repacking each panel per call), or with `stored` on W in
// stored panels (qmatmul_panels: kernels/quant/reference.py `to_panels`, any number of rows).
// `live`: s32 [4], the rows to compute (LiveRows), the others written as zeros.
ffi::Error product(const char* target, [[maybe_unused]] bool stored, ffi::AnyBuffer x, ffi::AnyBuffer q,
                   ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> zero,
                   [[maybe_unused]] ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y, int32_t bits) {
  auto fail = [&](const char* why) { return std::string(target) + ": " + why; };
  if (x.element_type() != ffi::DataType::F32) return ffi::Error::InvalidArgument(fail("x must be f32"));
  QShape shape;
  if (ffi::Error error = check_quantized(target, x, q, scale, zero, y, bits, shape); error.failure()) return error;
#if defined(XLASERVE_I8) || defined(XLASERVE_I8_AVX2)
  const auto [m, k, n, groups, row_bytes] = shape;
#if defined(XLASERVE_STORED_PANELS)
  if (stored && n % kStoredPanel) return ffi::Error::InvalidArgument(fail("n must be a multiple of 16"));
#else
  if (stored) return ffi::Error::Internal(fail("built without stored panels"));
#endif
  if (empty_product(shape, y->typed_data())) return ffi::Error::Success();
  if (live.element_count() != 4) return ffi::Error::InvalidArgument(fail("live must hold 4 row bounds"));
  const I8Problem p{nullptr, nullptr, nullptr, static_cast<const uint8_t*>(q.untyped_data()), scale.typed_data(),
                    bits == 4 ? zero.typed_data() : nullptr, y->typed_data(), m, k, n, groups, row_bytes,
                    LiveRows::of(live.typed_data(), m)};
  run(static_cast<const float*>(x.untyped_data()), p, bits, stored);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal(fail("built without AVX512-VNNI or AVX2"));
#endif
}

ffi::Error QgemmI8Impl(ffi::AnyBuffer x, ffi::AnyBuffer q, ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> zero,
                       ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y, int32_t bits) {
  return product("xlaserve_cpu_qgemm_i8", false, x, q, scale, zero, live, y, bits);
}

ffi::Error QmatmulPanelsImpl(ffi::AnyBuffer x, ffi::AnyBuffer q, ffi::Buffer<ffi::F16> scale,
                             ffi::Buffer<ffi::F16> zero, ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y,
                             int32_t bits) {
  return product("xlaserve_cpu_qmatmul_panels", true, x, q, scale, zero, live, y, bits);
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuQgemmI8, xlaserve::QgemmI8Impl, xlaserve::quantized_binding<true>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuQmatmulPanels, xlaserve::QmatmulPanelsImpl,
                              xlaserve::quantized_binding<true>());

// Outputs per stored panel of this build's qmatmul_panels (kernels/quant/reference.py PANEL), 0 without it.
extern "C" int XlaserveCpuPanelWidth() {
#if defined(XLASERVE_STORED_PANELS)
  return static_cast<int>(xlaserve::kStoredPanel);
#else
  return 0;
#endif
}
