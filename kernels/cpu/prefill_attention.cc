// xlaserve CPU prefill attention: blocks of consecutive query tokens of one sequence each against that
// sequence's pages of one layer of the KV pool, read in place through the page table.
//
// Why: the jnp reference (kernels/paged_attention/reference.py `prefill_attention_reference`) gathers
// every block's whole page bucket into a contiguous copy and scores each query against all of it. After a
// long cached prefix that is most of a step: 16 requests adding 128 tokens each to a 1,024-token cached
// prompt (SmolLM2) took 14 s of prefill against 4 s for the same tokens without the prefix, since each
// 16-token block gathered and scored the 2,048-slot bucket of its 1,152 tokens. Here each (block, KV head)
// is one chunk of work that reads only the keys its queries see, in tiles of kTile tokens, with an
// online softmax (flash attention), so neither a gathered copy nor a whole score row is ever made.
//
// Per tile: the tile's keys are transposed into [d, kTile] so that the scores of kRows query rows against
// the tile's 64 keys are 16 vector accumulators fed by one broadcast per row per element; the values are
// summed the same way, kRows rows x 64 output columns at a time. Semantics are the reference's: key t is
// visible to a query at position p iff t <= p (and p - window < t with a sliding window); scores are
// scaled, then soft-capped, then softmaxed in float32. A row that sees no key (none of the kernel's
// rows can, but a padding row of a block may) gets zeros. The pool is f32 or bf16 (`--kv-cache-dtype
// bfloat16` under an f32 model), widened to f32 as it is read. A bf16 model's queries against a bf16 pool are
// multiplied as the reference multiplies them, in bf16 pairs (AVX512-BF16 `vdpbf16ps`: queries and keys,
// then the softmax weights rounded to bf16 and the values; f32 sums), the tile's keys and values laid out in
// pairs once for all its rows: 57-80 -> 33-38 ms for 16 x 128 tokens after 1,024 (`python -m bench.kernels
// --ops "paged_attention (prefill)" --dtype bfloat16`, alternated, on a loaded Zen 4).
// The softmax between the two products: a row that sees the whole tile skips the masks, its scores stay in
// registers from the cap to the exponentials, the tile's maximum is a tree of halves (`hmax`; it was a scalar
// loop over the lanes) and the running sum a vector summed once at the end. `python -m bench.decode_attention
// --cases prefill` (16 x 128 tokens after 1,024, 30 layers, bf16 pool, f32 queries; AMD Zen 5, 2 cores),
// alternated 4 times, best of 11: 611-660 -> 541-584 ms. The exponentials are now ~15% of the kernel's
// samples and the two products ~65%.

#include <cmath>
#include <limits>
#include <type_traits>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

constexpr int64_t kTile = 64;              // keys per tile: four vectors of scores per row
constexpr int kRows = kWideRegisters ? 4 : 2;  // query rows per register tile (AVX2: 2, as the tiles below)
constexpr int64_t kTileVecs = kTile / kLanes;

template <typename T>  // the pool's element: float, or bf16_t (a bf16 pool)
struct Prefill {
  const float* q;            // [blocks * block_size, heads, d]
  const T* k;                // [num_slots, kv_heads, d] of the chosen layer
  const T* v;
  const int32_t* pages;      // [blocks, pages_per_seq]
  const int32_t* positions;  // [blocks * block_size]
  float* out;                // [blocks * block_size, heads, d]
  int64_t block_size, heads, kv_heads, d, num_slots, pages_per_seq, page_size, window;
  float scale, soft_cap;
  bool bf16_query;           // q holds bf16 values (a bf16 model's): with a bf16 pool, bf16 pair products
};

struct Scratch {
  std::vector<float> q, keys, scores, acc, max, sum;  // rows x d, d x kTile, rows x kTile, rows x d, rows,
                                                      // rows x kLanes
  std::vector<float> values;                          // a bf16 pool's tile of values widened: kTile x d
  std::vector<int64_t> offsets;                       // the tile's tokens' offsets in the pool
  // bf16 pairs (`pairs` in attend_block): the queries [rows, d/2], the tile's keys [d/2, kTile] and values
  // [kTile/2, d], and one row group's weights [kRows, kTile/2]
  std::vector<uint32_t> qp, kp, vp, wp;
};

// scores[r][0, kTile) = q[r] . keys[:, 0, kTile) for NR rows; keys is [d, kTile] (`transpose_keys`).
// The tile's columns in passes of CV vectors (AVX2: 2, the pass's accumulators and keys in 12 ymm).
template <int NR>
inline void score_rows(const float* q, const float* keys, int64_t d, float* scores) {
  constexpr int CV = kWideRegisters ? kTileVecs : 2;
  for (int c0 = 0; c0 < kTileVecs; c0 += CV)
    score_transposed<NR, CV>(q, keys + c0 * kLanes, kTile, d, scores + c0 * kLanes, kTile);
}

#if defined(__AVX512BF16__)
// `score_rows` on bf16 pairs (a bf16 model's queries against a bf16 pool, the reference's bf16 products):
// scores[r][0, kTile) = scale * sum_e2 qp[r][e2] . kp[e2][0, kTile), each pair product exact, sums f32; half
// the instructions of the f32 loop.
template <int NR>
inline void score_rows_pairs(const uint32_t* qp, const uint32_t* kp, int64_t d, float scale, float* scores) {
  vec acc[NR][kTileVecs] = {};
  for (int64_t e2 = 0; e2 < d / 2; ++e2) {
    __m512bh kv[kTileVecs];
    for (int c = 0; c < kTileVecs; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kp + e2 * kTile + c * kLanes);
    for (int i = 0; i < NR; ++i) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(int(qp[i * d / 2 + e2]));
      for (int c = 0; c < kTileVecs; ++c) acc[i][c] = (vec)_mm512_dpbf16_ps((__m512)acc[i][c], qb, kv[c]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < kTileVecs; ++c) store(scores + i * kTile + c * kLanes, acc[i][c] * splat(scale));
}

// `accumulate` on bf16 pairs: acc[r][0, d) += sum_t2 wp[r][t2] . vp[t2][0, d) for NR rows, the weights of
// tokens 2 t2 and 2 t2 + 1 rounded to bf16 (as the reference rounds its probabilities) against the values
// of those two tokens, paired; d a multiple of 4 kLanes.
template <int NR>
inline void accumulate_pairs(const uint32_t* wp, const uint32_t* vp, int64_t d, float* acc) {
  for (int64_t e0 = 0; e0 < d; e0 += 4 * kLanes) {
    vec sum[NR][4];
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < 4; ++c) sum[i][c] = load(acc + i * d + e0 + c * kLanes);
    for (int64_t t2 = 0; t2 < kTile / 2; ++t2) {
      __m512bh vv[4];
      for (int c = 0; c < 4; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + t2 * d + e0 + c * kLanes);
      for (int i = 0; i < NR; ++i) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(int(wp[i * kTile / 2 + t2]));
        for (int c = 0; c < 4; ++c) sum[i][c] = (vec)_mm512_dpbf16_ps((__m512)sum[i][c], w, vv[c]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < 4; ++c) store(acc + i * d + e0 + c * kLanes, sum[i][c]);
  }
}
#endif

// acc[r][e0, e0 + V*kLanes) += sum_t p[r][t] * values[t][e0, ...) for NR rows; p rows kTile apart, acc rows
// d apart.
template <int NR, int V, typename T>
inline void accumulate_rows(const float* p, const T* const* values, int64_t n, int64_t e0, int64_t d,
                            float* acc) {
  vec sum[NR][V];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < V; ++c) sum[i][c] = load(acc + i * d + e0 + c * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    vec vv[V];
    for (int c = 0; c < V; ++c) vv[c] = load_as_float(values[t] + e0 + c * kLanes);
    for (int i = 0; i < NR; ++i) {
      const vec pt = broadcast(p + i * kTile + t);
      for (int c = 0; c < V; ++c) sum[i][c] += pt * vv[c];
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < V; ++c) store(acc + i * d + e0 + c * kLanes, sum[i][c]);
}

template <int NR, typename T>
inline void accumulate(const float* p, const T* const* values, int64_t n, int64_t d, float* acc) {
  constexpr int V = kWideRegisters ? 4 : 2;  // AVX2: NR x 2 sums and 2 values in 12 ymm
  int64_t e0 = 0;
  for (; e0 + V * kLanes <= d; e0 += V * kLanes) accumulate_rows<NR, V>(p, values, n, e0, d, acc);
  for (; e0 < d; e0 += kLanes) accumulate_rows<NR, 1>(p, values, n, e0, d, acc);
}

#if defined(__AVX512BF16__)
// A tile's keys and values as bf16 pairs, from a bf16 pool (tokens at `offsets`, n of them; zeros past n):
// kp[e2][t] = keys t's elements 2 e2, 2 e2 + 1 (16 tokens x 16 pairs transposed in registers at a time), and
// vp[t2][e] = the values of tokens 2 t2, 2 t2 + 1 at element e (two rows interleaved); d a multiple of 64.
inline void fill_pairs(const bf16_t* k, const bf16_t* v, const int64_t* offsets, int64_t n, int64_t d,
                       uint32_t* kp, uint32_t* vp) {
  for (int64_t t0 = 0; t0 < kTile; t0 += kLanes)
    for (int64_t e2 = 0; e2 < d / 2; e2 += kLanes) {
      vec r[kLanes];
      for (int i = 0; i < kLanes; ++i)
        r[i] = t0 + i < n ? (vec)_mm512_loadu_si512(k + offsets[t0 + i] + 2 * e2) : vec{};
      transpose16(r);
      for (int i = 0; i < kLanes; ++i) _mm512_storeu_si512(kp + (e2 + i) * kTile + t0, (__m512i)r[i]);
    }
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t t2 = 0; t2 < kTile / 2; ++t2) {
    const int64_t t = 2 * t2;
    for (int64_t e = 0; e < d; e += 2 * kLanes) {
      const __m512i x = t < n ? _mm512_loadu_si512(v + offsets[t] + e) : _mm512_setzero_si512();
      const __m512i y = t + 1 < n ? _mm512_loadu_si512(v + offsets[t + 1] + e) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + t2 * d + e, _mm512_permutex2var_epi16(x, low, y));
      _mm512_storeu_si512(vp + t2 * d + e + kLanes, _mm512_permutex2var_epi16(x, high, y));
    }
  }
}
#endif

// Block b's queries of KV head j (group = heads / kv_heads query heads each) against their keys.
// Rows are token-major: row r is token r / group of the block, query head j * group + r % group.
template <typename T>
void attend_block(const Prefill<T>& a, int64_t b, int64_t j, Scratch& s) {
  const int64_t group = a.heads / a.kv_heads, d = a.d, rows = a.block_size * group;
  const int32_t* pos = a.positions + b * a.block_size;
  auto row_ptr = [&](float* base, int64_t r) {
    return base + ((b * a.block_size + r / group) * a.heads + j * group + r % group) * d;
  };
  const int64_t kv_len = a.pages_per_seq * a.page_size;
  // A block's real rows are consecutive positions from its first row on; padding rows after them sit at
  // position 0 and may see less than the real rows (their output is never used), so the window's first
  // key is the first row's.
  const int64_t hi = *std::max_element(pos, pos + a.block_size);
  const int64_t first = a.window > 0 ? std::max<int64_t>(pos[0] - a.window + 1, 0) : 0;
  const int64_t last = std::min<int64_t>(hi, kv_len - 1);
  if (last < first) {  // no row sees a key (a padding block)
    for (int64_t r = 0; r < rows; ++r) std::fill(row_ptr(a.out, r), row_ptr(a.out, r) + d, 0.f);
    return;
  }
  s.q.resize(rows * d);
  s.keys.assign(d * kTile, 0.f);
  s.scores.resize(rows * kTile);
  s.acc.assign(rows * d, 0.f);
  s.max.assign(rows, -std::numeric_limits<float>::infinity());
  s.sum.assign(rows * kLanes, 0.f);
  s.offsets.resize(kTile);
  for (int64_t r = 0; r < rows; ++r) {  // the scale folded into the queries
    const float* src = row_ptr(const_cast<float*>(a.q), r);
    for (int64_t e = 0; e < d; ++e) s.q[r * d + e] = src[e] * a.scale;
  }
#if defined(__AVX512BF16__)
  // A bf16 model's queries against a bf16 pool: products of bf16 pairs, as the reference's (the scale applied
  // to the scores, the weights rounded to bf16 before the values): half the instructions of the f32 loops.
  const bool pairs = std::is_same<T, bf16_t>::value && a.bf16_query && d % (4 * kLanes) == 0;
  if (pairs) {
    s.qp.resize(rows * d / 2);
    s.kp.resize(d / 2 * kTile);
    s.vp.resize(kTile / 2 * d);
    s.wp.resize(kRows * kTile / 2);
    for (int64_t r = 0; r < rows; ++r) {  // the bits of an f32 holding a bf16 value: that value's, upper half
      const float* src = row_ptr(const_cast<float*>(a.q), r);
      for (int64_t e2 = 0; e2 < d / 2; ++e2) {
        uint32_t lo, hi;
        std::memcpy(&lo, src + 2 * e2, 4);
        std::memcpy(&hi, src + 2 * e2 + 1, 4);
        s.qp[r * d / 2 + e2] = (lo >> 16) | (hi & 0xffff0000u);
      }
    }
  }
#else
  constexpr bool pairs = false;
#endif
  const int32_t* page_row = a.pages + b * a.pages_per_seq;
  const T* values[kTile];
  for (int64_t k0 = first; k0 <= last; k0 += kTile) {
    const int64_t n = std::min<int64_t>(kTile, last + 1 - k0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t p = k0 + t;
      const int64_t slot = int64_t(page_row[p / a.page_size]) * a.page_size + p % a.page_size;
      s.offsets[t] = (std::clamp<int64_t>(slot, 0, a.num_slots - 1) * a.kv_heads + j) * d;  // never outside
      values[t] = a.v + s.offsets[t];
    }
    int64_t r = 0;
#if defined(__AVX512BF16__)
    if (pairs) {
      fill_pairs(reinterpret_cast<const bf16_t*>(a.k), reinterpret_cast<const bf16_t*>(a.v), s.offsets.data(), n,
                 d, s.kp.data(), s.vp.data());
      for (; r + kRows <= rows; r += kRows)
        score_rows_pairs<kRows>(s.qp.data() + r * d / 2, s.kp.data(), d, a.scale, s.scores.data() + r * kTile);
      for (; r < rows; ++r)
        score_rows_pairs<1>(s.qp.data() + r * d / 2, s.kp.data(), d, a.scale, s.scores.data() + r * kTile);
    }
#endif
    if (!pairs) {
      // The tile's keys into [d, kTile], 16 tokens at a time (zeros past n; element by element took as many
      // instructions as a third of the tile's products, though the time moved within this machine's noise,
      // 41-47 ms for 16 x 128 tokens after 1,024: they ran beside the FMAs).
      for (int64_t t0 = 0; t0 < kTile; t0 += kLanes)
        transpose_keys(a.k, s.offsets.data() + t0, n - t0, d, s.keys.data() + t0, kTile);
      for (; r + kRows <= rows; r += kRows)
        score_rows<kRows>(s.q.data() + r * d, s.keys.data(), d, s.scores.data() + r * kTile);
      for (; r < rows; ++r) score_rows<1>(s.q.data() + r * d, s.keys.data(), d, s.scores.data() + r * kTile);
    }
    // Mask, soft-cap and the online softmax: each row's weights in place of its scores, its running sum (a
    // vector, summed once at the end) and output rescaled where its maximum grew. A row that sees the whole
    // tile (all of a long context's tiles but its last) skips the masks.
    ivec key_index;
    for (int i = 0; i < kLanes; ++i) key_index[i] = int32_t(k0 + i);
    for (r = 0; r < rows; ++r) {
      const int64_t p = pos[r / group];
      const int64_t row_lo = a.window > 0 ? p - a.window + 1 : 0;
      const bool seen = n == kTile && row_lo <= k0 && k0 + kTile - 1 <= p;
      float* sr = s.scores.data() + r * kTile;
      vec x[kTileVecs];
      ivec visible[kTileVecs];
      vec tile_max = splat(-std::numeric_limits<float>::infinity());
      for (int c = 0; c < kTileVecs; ++c) {
        x[c] = load(sr + c * kLanes);
        if (a.soft_cap > 0.f)
          for (int i = 0; i < kLanes; ++i) x[c][i] = a.soft_cap * std::tanh(x[c][i] / a.soft_cap);
        if (!seen) {
          const ivec idx = key_index + int32_t(c * kLanes);
          visible[c] = (idx >= int32_t(row_lo)) & (idx <= int32_t(p)) & (idx < int32_t(k0 + n));
          x[c] = select(visible[c], x[c], splat(-std::numeric_limits<float>::infinity()));
        }
        tile_max = vmax(tile_max, x[c]);
      }
      const float m = hmax(tile_max);
      if (m == -std::numeric_limits<float>::infinity()) {  // nothing visible in this tile
        std::fill(sr, sr + kTile, 0.f);
        continue;
      }
      const float new_max = std::max(m, s.max[r]);
      vec total = {};
      for (int c = 0; c < kTileVecs; ++c) {
        vec w = exp_vec(x[c] - splat(new_max));
        if (!seen) w = select(visible[c], w, vec{});
        store(sr + c * kLanes, w);
        total += w;
      }
      float* sum = s.sum.data() + r * kLanes;
      if (new_max > s.max[r]) {
        const float alpha = std::exp(s.max[r] - new_max);  // 0 on the first visible tile
        total += load(sum) * splat(alpha);
        float* acc = s.acc.data() + r * d;
        for (int64_t e = 0; e < d; e += kLanes) store(acc + e, load(acc + e) * splat(alpha));
        s.max[r] = new_max;
      } else {
        total += load(sum);
      }
      store(sum, total);
    }
#if defined(__AVX512BF16__)
    if (pairs) {
      for (r = 0; r < rows;) {
        const int nr = rows - r >= kRows ? kRows : 1;
        for (int i = 0; i < nr; ++i) {  // the weights in bf16 pairs: tokens 2 t2, 2 t2 + 1 in lane t2
          const float* w = s.scores.data() + (r + i) * kTile;
          for (int64_t c = 0; c < kTile; c += 2 * kLanes)
            _mm512_storeu_si512(s.wp.data() + i * kTile / 2 + c / 2,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + c + kLanes), _mm512_loadu_ps(w + c)));
        }
        if (nr == kRows)
          accumulate_pairs<kRows>(s.wp.data(), s.vp.data(), d, s.acc.data() + r * d);
        else
          accumulate_pairs<1>(s.wp.data(), s.vp.data(), d, s.acc.data() + r * d);
        r += nr;
      }
    }
#endif
    if (!pairs) {
      auto sum_rows = [&](const auto* const* rows_values) {  // each pair of rows' weights times the values
        for (r = 0; r + kRows <= rows; r += kRows)
          accumulate<kRows>(s.scores.data() + r * kTile, rows_values, n, d, s.acc.data() + r * d);
        for (; r < rows; ++r) accumulate<1>(s.scores.data() + r * kTile, rows_values, n, d, s.acc.data() + r * d);
      };
      if constexpr (std::is_same<T, bf16_t>::value) {
        // A bf16 pool's values widened once for all the tile's rows (each row pair widened them again: 24
        // times a tile for SmolLM2's 16-token blocks): `python -m bench.kernels --ops "paged_attention
        // (prefill)" --dtype bfloat16` (16 x 128 tokens after 1,024), alternated 3 times on AMD Zen 3 (AVX2):
        // 55.3-60.3 -> 51.4-54.1 ms.
        s.values.resize(kTile * d);
        const float* wide[kTile];
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t e = 0; e < d; e += kLanes) store(s.values.data() + t * d + e, load_as_float(values[t] + e));
          wide[t] = s.values.data() + t * d;
        }
        sum_rows(wide);
      } else {
        sum_rows(values);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = row_ptr(a.out, r);
    const float total = hsum(load(s.sum.data() + r * kLanes));
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t e = 0; e < d; ++e) out[e] = s.acc[r * d + e] * inv;
  }
}

template <typename T>
void run(const Prefill<T>& a, int64_t blocks) {
  Workers& workers = Workers::get();
  std::vector<Scratch> scratch(workers.size() + 1);
  // Chunks are claimed in order, and a sequence's later blocks see more keys than its earlier ones: hand
  // them out from the end, so a sequence's longest chunks start first and its short ones fill in behind.
  const int64_t chunks = blocks * a.kv_heads;
  workers.parallel_for(chunks, [&](int64_t c, int worker) {
    const int64_t i = chunks - 1 - c;
    attend_block(a, i / a.kv_heads, i % a.kv_heads, scratch[worker]);
  });
}

ffi::Error PrefillAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pages,
                                ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out,
                                int32_t page_size, int32_t block_size, int32_t window, float scale,
                                float soft_cap, int32_t bf16_query) {
  auto qd = q.dimensions(), kd = k_pool.dimensions(), pd = pages.dimensions(), vd = v_pool.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return ffi::Error::InvalidArgument("xlaserve_cpu_prefill_attention: bad ranks or K/V shapes");
  const ffi::DataType type = k_pool.element_type();
  if ((type != ffi::DataType::F32 && type != ffi::DataType::BF16) || v_pool.element_type() != type)
    return ffi::Error::InvalidArgument("xlaserve_cpu_prefill_attention: the pools must both be f32 or bf16");
  const int64_t tokens = qd[0], heads = qd[1], d = qd[2], blocks = pd[0];
  const int64_t num_layers = kd[0], num_slots = kd[1], kv_heads = kd[2];
  if (kd[3] != d || d % kLanes != 0 || heads % kv_heads != 0 || block_size < 1 ||
      tokens != blocks * block_size || positions.element_count() != tokens || page_size < 1)
    return ffi::Error::InvalidArgument("xlaserve_cpu_prefill_attention: shapes do not agree");
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, num_layers - 1);
  const int64_t layer_size = num_slots * kv_heads * d;
  auto problem = [&](auto* k, auto* v) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
    return Prefill<T>{q.typed_data(), k + l * layer_size, v + l * layer_size, pages.typed_data(),
                      positions.typed_data(), out->typed_data(), block_size, heads, kv_heads, d, num_slots,
                      pd[1], page_size, window, scale, soft_cap, bf16_query != 0};
  };
  if (type == ffi::DataType::F32)
    run(problem(static_cast<const float*>(k_pool.untyped_data()), static_cast<const float*>(v_pool.untyped_data())),
        blocks);
  else
    run(problem(static_cast<const bf16_t*>(k_pool.untyped_data()),
                static_cast<const bf16_t*>(v_pool.untyped_data())),
        blocks);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuPrefillAttention, xlaserve::PrefillAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("page_size")
                                  .Attr<int32_t>("block_size")
                                  .Attr<int32_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("bf16_query"));
