// xlaserve CPU decode attention: one query token per sequence against its pages of one layer of the
// KV pool, read in place through the page table.
//
// Why: the jnp reference gathers each sequence's pages into a contiguous copy, masks the slots past
// the sequence and runs two batched matmuls; on XLA:CPU those are a dozen small ops per layer that
// cost several times the bytes they read. Here each sequence (or, with fewer sequences than threads,
// each (sequence, KV head)) is one chunk of work: the scores of its query heads against the visible
// keys, a softmax, and the weighted sum of values, reading each visible key and value row once.
// Semantics are the reference's (kernels/paged_attention/reference.py): key t is visible to a query at
// position p iff t <= p (and p - window < t with a sliding window), scores are scaled, then soft-capped,
// then softmaxed in float32. The pool is f32 or bf16 (`--kv-cache-dtype bfloat16` under an f32 model:
// half the bytes; values widened to f32 as they are read, keys scored in place by AVX512-BF16 pair products
// against the query split into two bf16 parts, where the CPU has them).
//
// Measured (SmolLM2 shapes: 32 sequences of 141 tokens, 9 query and 3 KV heads of 64; 30 layers' pools,
// so read from DRAM): 0.34-0.41 ms per layer, 7 MB of K and V at 17-20 GB/s against ~30 for a plain
// stream; with the KV in L2 the same work takes 0.13-0.15 ms, so it is bound by memory. A single pass
// with an online softmax (K and V of a token read together, as flash decoding) measured slower from
// DRAM, 0.42-0.44 ms, and changing the prefetch distance (2-64 tokens) or hint did not move either.
// Later (AMD EPYC Zen 4, 16 sequences of 1,300 tokens, 30 layers, bf16 pool): 40-50 ms from DRAM, 17-24 ms
// with one layer's KV in L3 (this shared machine's runs varied by 30%); scoring the keys in place instead of
// widening them into a scratch block took ~12% off the latter. Tried there, not kept (no difference beyond
// the noise, in the kernel or a model's decode step): also prefetching keys and values 32-128 tokens ahead
// into L2 on top of the near prefetches into L1 (which themselves stalled: below); blocks of 64 tokens
// with an online softmax (each block's values summed right after its keys).
// A bf16 query against a bf16 pool (a bf16 model's; `--activation-quantization bf16` over a bf16 KV cache)
// also sums the values in pairs of tokens (`sum_value_pairs`: the weights rounded to bf16, as the
// reference rounds a bf16 model's): `python -m bench.kernels --ops "decode, SmolLM2" --dtype bfloat16`
// 0.45-0.46 -> 0.37-0.39 ms, its shared-prefix case 0.38-0.40 -> 0.30-0.31 (alternated twice); a SmolLM2
// batch-16 step at 1.2 k tokens of context, whose queries were f32 before, 67-76 -> 62-63 ms.
// On that AMD machine the prefetch hint did matter (unlike the Intel one above): `prefetcht1` rather than t0,
// 24 tokens ahead, 1.4x from DRAM (`attend_span`).
// AVX2 (AMD EPYC Zen 3, no AVX-512): the 16-lane forms spilled their accumulators (`dots` holds 32 ymm of
// them), so the AVX2 build has its own 8-lane tiles (`dots4`, `sum_values8`); every build now attends a
// span's tokens in blocks with an online softmax (`attend_span`), first written for AVX2. `python -m
// bench.kernels --ops "decode, SmolLM2,shared" --dtype bfloat16`, alternated 3 times: "decode" 7.6-8.6 ->
// 5.5-6.4 ms, "decode, SmolLM2" 1.15-1.40 -> 0.91-1.21, its shared prefix 0.96-1.24 -> 0.79-0.92; 30 layers'
// pools of 16 sequences x 1,152 tokens from DRAM 41-58 -> 37-39 ms (still ~12 GB/s of KV). Without the
// software prefetches 44-47 ms (they stay); keys prefetched 48 or 96 tokens ahead instead of 24: no faster. A
// block's scores scaled and their maximum taken 8 at a time (a scalar loop, which re-read the scale and the
// cap after every store, had ~9% of the samples): 30 layers of 16 x 1,350 tokens 41.5-43.4 -> 35.2-39.1 ms
// (alternated 3 times). Tried and not kept, within this machine's noise: the heads' runs worked out once a
// span instead of per 4 tokens (an integer division), 4 column vectors per pass of the values for 3 heads.
// From L3 (one layer's pools, 16.6 MB) 30 calls still take ~26 ms, ~80 cycles a token and KV head for 48
// FMAs: what remains is the loads' latency, not DRAM (2 threads read 27 GB/s here).

#include <array>
#include <cmath>
#include <type_traits>
#include <utility>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

constexpr int64_t kPrefetchTokens = 24;  // keys prefetched this many tokens ahead (8: 28-34 ms below)

template <typename T>  // the pool's element: float, or bf16_t (a bf16 pool)
struct Attention {
  const float* q;         // [B, heads, D]
  const T* k;             // [num_slots, kv_heads, D] of the chosen layer
  const T* v;
  const int32_t* pages;   // [B, pages_per_seq]
  const int32_t* positions;  // [B]
  float* out;             // [B, heads, D]
  int64_t heads, kv_heads, d, num_slots, pages_per_seq, page_size, window;
  float scale, soft_cap;
  bool bf16_query;        // q holds bf16 values (a bf16 model's): with a bf16 pool, scored by bf16 pair products
};

template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  const int64_t dv = d / kLanes * kLanes;
  vec acc = {};
  for (int64_t i = 0; i < dv; i += kLanes) acc += load(a + i) * load_as_float(b + i);
  float s = hsum(acc);
  for (int64_t i = dv; i < d; ++i) s += a[i] * to_float(b[i]);
  return s;
}

// Lane i of the result: dot(q[0, d), keys[i] + offset)[0, d)), for kLanes key rows; d a multiple of kLanes.
// Each dot is summed in its own vector, then the kLanes vectors are reduced together: four rounds of
// adding the two halves of every group of lanes of a pair of vectors, a quarter of the shuffles that
// a horizontal sum per dot takes. Fed in bit-reversed order, the rounds leave token i in lane i.
inline vec reduce16(const vec (&acc)[kLanes]);

template <typename T>
inline vec dots(const float* q, const T* const* keys, int64_t offset, int64_t d) {
  vec acc[kLanes] = {};
  for (int64_t j = 0; j < d; j += kLanes) {
    const vec qv = load(q + j);
    for (int i = 0; i < kLanes; ++i) acc[i] += qv * load_as_float(keys[i] + offset + j);
  }
  return reduce16(acc);
}

#if defined(__AVX512BF16__)
// `dots` for a bf16 query (`qp`: its bf16 pairs) against keys of a bf16 pool, read as they are: AVX512-BF16
// multiplies pairs of bf16 into f32 lanes (exact products, f32 sums), no widening; d a multiple of 32.
inline vec dots_bf16(const uint32_t* qp, const bf16_t* const* keys, int64_t offset, int64_t d) {
  vec acc[kLanes] = {};
  for (int64_t j = 0; j < d; j += 2 * kLanes) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + j / 2);
    for (int i = 0; i < kLanes; ++i)
      acc[i] = (vec)_mm512_dpbf16_ps((__m512)acc[i], qv, (__m512bh)_mm512_loadu_si512(keys[i] + offset + j));
  }
  return reduce16(acc);
}

// `dots` for an f32 query split into two bf16 parts (`hi` + `lo`: q to 16 bits of mantissa, a score's error
// at most 2^-18 of sum |q k|, below what the f32 sums themselves round) against keys of a bf16 pool, read in
// place: two pair products a key, where widening the keys to f32 took a conversion, a store and a load.
inline vec dots_bf16x2(const uint32_t* hi, const uint32_t* lo, const bf16_t* const* keys, int64_t offset,
                       int64_t d) {
  vec acc[kLanes] = {};
  for (int64_t j = 0; j < d; j += 2 * kLanes) {
    const __m512bh qh = (__m512bh)_mm512_loadu_si512(hi + j / 2), ql = (__m512bh)_mm512_loadu_si512(lo + j / 2);
    for (int i = 0; i < kLanes; ++i) {
      const __m512bh key = (__m512bh)_mm512_loadu_si512(keys[i] + offset + j);
      acc[i] = (vec)_mm512_dpbf16_ps(_mm512_dpbf16_ps((__m512)acc[i], qh, key), ql, key);
    }
  }
  return reduce16(acc);
}
#endif

// x rounded to the nearest bf16 (ties to even), as its 16 bits.
inline bf16_t round_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bf16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Lane i: the sum of acc[i]'s lanes.
inline vec reduce16(const vec (&acc)[kLanes]) {
#if defined(XLASERVE_SPLIT_VEC)
  __m256 lo[8], hi[8];
  for (int i = 0; i < 8; ++i) {
    lo[i] = (__m256)(acc[i].lo + acc[i].hi);
    hi[i] = (__m256)(acc[8 + i].lo + acc[8 + i].hi);
  }
  return {(f32x8)hsum8x8(lo), (f32x8)hsum8x8(hi)};
#endif
  static_assert(kLanes == 16, "the reduction below is written for 16 lanes");
  constexpr int kBitReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  vec r1[8], r2[4], r3[2];
  for (int i = 0; i < 8; ++i) {  // groups of 16 lanes -> 8
    const vec x = acc[kBitReversed[2 * i]], y = acc[kBitReversed[2 * i + 1]];
    r1[i] = XLASERVE_SHUFFLE2(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            XLASERVE_SHUFFLE2(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i)  // 8 -> 4
    r2[i] = XLASERVE_SHUFFLE2(r1[2 * i], r1[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            XLASERVE_SHUFFLE2(r1[2 * i], r1[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // 4 -> 2
    r3[i] = XLASERVE_SHUFFLE2(r2[2 * i], r2[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
            XLASERVE_SHUFFLE2(r2[2 * i], r2[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return XLASERVE_SHUFFLE2(r3[0], r3[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +  // 2 -> 1
         XLASERVE_SHUFFLE2(r3[0], r3[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// The key lines of tokens [next, end) (a token's `row_bytes` at base + offsets[t] elements of `elem` bytes) to
// prefetch (into L2) a line at a time from inside a loop that has no loads of its own to wait on, worked out as
// it goes: a vector of the lines, filled a block ahead, had ~9% of the kernel's samples (30 layers of 16 x 1,152
// tokens from L3, alternated: 18.3-18.6 -> 16.5-16.6 ms; from DRAM 21.7-23.3 -> 20.7-22.7).
struct LineQueue {
  const char* base;
  const int64_t* offsets;
  int64_t elem, row_bytes, next, end, byte = 0, per = 1;
  // `lines` spread over `visits` calls of `one`.
  void pace(int64_t lines, int64_t visits) {
    per = visits > 0 ? std::max<int64_t>(1, (lines + visits - 1) / visits) : 1;
  }
  void one() {
    for (int64_t i = 0; i < per && next < end; ++i) {
      __builtin_prefetch(base + offsets[next] * elem + byte, 0, 2);
      byte += 64;
      if (byte >= row_bytes) {
        byte = 0;
        ++next;
      }
    }
  }
  void rest() {
    while (next < end) one();
  }
};

// For G query heads g sharing a KV head: out[g * d, + V*kLanes) += sum_{t < n} p[g * stride + t] * rows[t][0,
// V*kLanes), the sums held in registers; each value row is loaded (and, from a bf16 pool, widened) once for
// the G; `queue.one()` every token.
template <int V, int G, typename T>
inline void weighted_sum(const float* p, int64_t stride, int64_t n, const T* const* rows, float* out, int64_t d,
                         LineQueue& queue) {
  vec acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) acc[g][i] = load(out + g * d + i * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    queue.one();
    vec r[V];
    for (int i = 0; i < V; ++i) r[i] = load_as_float(rows[t] + i * kLanes);
    for (int g = 0; g < G; ++g) {
      const vec pt = broadcast(p + g * stride + t);
      for (int i = 0; i < V; ++i) acc[g][i] += pt * r[i];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) store(out + g * d + i * kLanes, acc[g][i]);
}

// Vectors of a head's columns `sum_values` sums at a time for G heads: at most 16 accumulators (AVX2: 4, with
// the value rows in 12 of its 16 ymm).
template <int G>
constexpr int value_vecs() {
  return kWideRegisters ? (G <= 2 ? 4 : 2) : (G <= 2 ? 2 : 1);
}

// out[g * d, + d) += for G query heads from the first one's weights `p` (heads `stride` apart, n tokens) and
// output `out` (heads d apart), against their KV head's value rows `rows[t]` (moved along as the columns are
// done).
template <int G, typename T>
void sum_values(const float* p, int64_t stride, int64_t n, const T** rows, float* out, int64_t d,
                LineQueue& queue) {
  constexpr int V = value_vecs<G>();
  int64_t d0 = 0;
  for (; d0 + V * kLanes <= d; d0 += V * kLanes) {
    weighted_sum<V, G>(p, stride, n, rows, out + d0, d, queue);
    for (int64_t t = 0; t < n; ++t) rows[t] += V * kLanes;
  }
  for (; d0 + kLanes <= d; d0 += kLanes) {
    weighted_sum<1, G>(p, stride, n, rows, out + d0, d, queue);
    for (int64_t t = 0; t < n; ++t) rows[t] += kLanes;
  }
  for (; d0 < d; ++d0) {
    for (int g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) sum += p[g * stride + t] * to_float(rows[t][0]);
      out[g * d + d0] += sum;
    }
    for (int64_t t = 0; t < n; ++t) ++rows[t];
  }
}

#if defined(__AVX512BF16__)
// `sum_values` on bf16 pairs (a bf16 query against a bf16 pool: a bf16 model's, or `--activation-quantization
// bf16`'s; `queue.one()` every pair): out[g * d + col, + 32 C) for G query heads += sum_t w[g][t] v[t], the
// weights already bf16 (`w`: heads `stride` bf16 apart, zero past the last token), tokens 2 t2 and 2 t2 + 1
// multiplied together by one `vdpbf16ps` against their value rows interleaved (`rows[2 t2]`, `rows[2 t2 +
// 1]`; n2 pairs): half the instructions of widening each value to f32 and one FMA per weight, as the
// reference multiplies a bf16 model's rounded weights. The interleave leaves lane i of 128-bit lane L of the
// low (high) half holding column 8 L + i (8 L + 4 + i): put back in order once at the end.
template <int C, int G>
inline void weighted_sum_pairs(const uint16_t* w, int64_t stride, int64_t n2, const bf16_t* const* rows,
                               int64_t col, float* out, int64_t d, LineQueue& queue) {
  vec acc[G][C][2] = {};
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w);
  for (int64_t t2 = 0; t2 < n2; ++t2) {
    queue.one();
    __m512i lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(rows[2 * t2] + col + 32 * c);
      const __m512i b = _mm512_loadu_si512(rows[2 * t2 + 1] + col + 32 * c);
      lo[c] = _mm512_unpacklo_epi16(a, b);
      hi[c] = _mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(int32_t(wp[g * stride / 2 + t2]));
      for (int c = 0; c < C; ++c) {
        acc[g][c][0] = (vec)_mm512_dpbf16_ps((__m512)acc[g][c][0], wv, (__m512bh)lo[c]);
        acc[g][c][1] = (vec)_mm512_dpbf16_ps((__m512)acc[g][c][1], wv, (__m512bh)hi[c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      const vec l = acc[g][c][0], h = acc[g][c][1];
      float* o = out + g * d + col + 32 * c;
      store(o, load(o) + XLASERVE_SHUFFLE2(l, h, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23));
      store(o + kLanes,
            load(o + kLanes) + XLASERVE_SHUFFLE2(l, h, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31));
    }
}

// All columns of G query heads (`weighted_sum_pairs`), 64 at a time, then 32; d a multiple of 32.
template <int G>
void sum_value_pairs(const uint16_t* w, int64_t stride, int64_t n2, const bf16_t* const* rows, float* out,
                     int64_t d, LineQueue& queue) {
  int64_t col = 0;
  for (; col + 64 <= d; col += 64) weighted_sum_pairs<2, G>(w, stride, n2, rows, col, out, d, queue);
  if (col < d) weighted_sum_pairs<1, G>(w, stride, n2, rows, col, out, d, queue);
}
#endif

#if defined(XLASERVE_SPLIT_VEC)
// AVX2 (16 ymm registers): the 16-lane forms above hold 16 accumulators of two halves each (`dots`: 32 ymm),
// so GCC kept them on the stack, a load and a store around every FMA. These work on 8 lanes, in register tiles
// that fit, and read a bf16 pool's keys in place (widened in a register: no scratch block).

// 8 consecutive elements as floats.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Lane i: the sum of a[i]'s 8 lanes.
inline __m128 hsum4x8(const __m256 (&a)[4]) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Lane i of out[g]: dot(q + g * d, keys[i])[0, d) for G query heads (d apart) and 4 key rows; d a multiple of 8.
// 4 G accumulators (12 of the 16 registers at G = 3); each key vector is widened once for the G heads.
template <int G, typename T>
inline void dots4(const float* q, const T* const (&keys)[4], int64_t d, __m128 (&out)[G]) {
  __m256 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 8)
    for (int i = 0; i < 4; ++i) {
      const __m256 k = load8(keys[i] + j);
      for (int g = 0; g < G; ++g) acc[g][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + j), k, acc[g][i]);
    }
  for (int g = 0; g < G; ++g) out[g] = hsum4x8(acc[g]);
}

// out[g * d + col, + 8 C) for G query heads += sum_{t < n} p[g * stride + t] * (rows[t] + row_off)[col, + 8 C):
// G C accumulators, each value vector widened once for the G heads; a line of `queue` every other token.
template <int C, int G, typename T>
inline void weighted_sum8(const float* p, int64_t stride, int64_t n, const T* const* rows, int64_t row_off,
                          int64_t col, float* out, int64_t d, LineQueue& queue) {
  __m256 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm256_loadu_ps(out + g * d + col + 8 * c);
  for (int64_t t = 0; t < n; ++t) {
    if (t % 2 == 0) queue.one();
    __m256 w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm256_broadcast_ss(p + g * stride + t);
    for (int c = 0; c < C; ++c) {
      const __m256 r = load8(rows[t] + row_off + col + 8 * c);
      for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], r, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + g * d + col + 8 * c, acc[g][c]);
}

// `sum_values` on 8 lanes for G query heads (weights `p`, heads `stride` apart), adding into `out`: column stretches
// of 32 (G <= 2) or 16 (G = 3) in registers; d a multiple of 8.
template <int G, typename T>
void sum_values8(const float* p, int64_t stride, int64_t n, const T* const* rows, int64_t row_off, float* out,
                 int64_t d, LineQueue& queue) {
  constexpr int C = G <= 2 ? 4 : 2;
  int64_t col = 0;
  for (; col + 8 * C <= d; col += 8 * C) weighted_sum8<C, G>(p, stride, n, rows, row_off, col, out, d, queue);
  for (; col < d; col += 8) weighted_sum8<1, G>(p, stride, n, rows, row_off, col, out, d, queue);
}
#endif

// fn(h, std::integral_constant<int, G>) for each run of G <= MaxRun (3 or 4) consecutive query heads h .. h + G - 1
// of one KV head (`group` query heads a KV head), the register tiles' heads.
template <int MaxRun = 4, typename Fn>
inline void by_head_runs(int64_t nh, int64_t group, Fn fn) {
  static_assert(MaxRun == 3 || MaxRun == 4);
  for (int64_t h = 0; h < nh;) {
    const int64_t kv_end = (h / group + 1) * group;  // the first head of the next KV head
    const int heads = int(std::min<int64_t>(MaxRun, kv_end - h));
    switch (heads) {
      case 1: fn(h, std::integral_constant<int, 1>{}); break;
      case 2: fn(h, std::integral_constant<int, 2>{}); break;
      case 3: fn(h, std::integral_constant<int, 3>{}); break;
      default:
        if constexpr (MaxRun == 4) fn(h, std::integral_constant<int, 4>{});
        break;
    }
    h += heads;
  }
}

struct Scratch {
  std::vector<float> scores;
  std::vector<float> keys;        // a bf16 pool's block of kLanes tokens' key rows, widened once; or, shared
                                  // spans (`transposed`), one KV head's keys of kLanes tokens transposed
  std::vector<uint16_t> query;    // a bf16 query's heads as bf16 (`dots_bf16`)
  std::vector<uint16_t> weights;  // the softmax weights as bf16, heads a multiple of 32 apart (`sum_value_pairs`)
  std::vector<const void*> rows;  // of the pool's element type
  std::vector<float> stats;       // `attend_span`: each head's running maximum and sum
  std::vector<int64_t> offsets;
};

// One part of a (sequence, KV heads) chunk split over its tokens (`run`): its query heads' softmax over the
// part's tokens, not normalized, for the caller to merge.
struct Partial {
  float* out;  // [nh, d]: sum_t exp(s_t - max) v_t
  float* max;  // [nh]: the largest score (-inf: no token)
  float* sum;  // [nh]: sum_t exp(s_t - max)
};

// One chunk of work: `nh` query heads (`q`, d apart) against tokens [first, first + n) of one sequence's page
// table, reading the keys and values of KV heads j0 .. j1-1; query head h belongs to KV head j0 + h / group.
// Into `out` ([nh, d], normalized), or, with `partial`, that softmax unnormalized for the caller to merge.
struct Span {
  const float* q;
  int64_t nh, group, j0, j1;
  const int32_t* page_row;
  int64_t first, n;
  float* out;
  const Partial* partial;
};

template <typename T>
void attend_span(const Attention<T>& a, const Span& span, Scratch& scratch);

// Tokens [lo, hi) of part `part` of `parts` stretches of n tokens, whole vectors of tokens a part (the last
// shorter; empty past the end).
inline std::pair<int64_t, int64_t> part_range(int64_t n, int64_t part, int64_t parts) {
  const int64_t per = ((n + parts - 1) / parts + kLanes - 1) / kLanes * kLanes;
  const int64_t lo = std::min(n, part * per);
  return {lo, std::min(n, lo + per)};
}

// Query heads of sequence b whose KV heads are j0 .. j1-1 (group = heads / kv_heads query heads each)
// against their keys and values. Keys are visited in order, each token's rows of every KV head in the
// range read together (one contiguous run per token). `scratch`: the worker's buffers. With `partial`,
// only part `part` of `parts` stretches of the visible tokens, into `partial`.
template <typename T>
void attend(const Attention<T>& a, int64_t b, int64_t j0, int64_t j1, Scratch& scratch, int64_t part = 0,
            int64_t parts = 1, const Partial* partial = nullptr) {
  const int64_t group = a.heads / a.kv_heads, d = a.d;
  const int64_t kv_len = a.pages_per_seq * a.page_size;
  const int64_t last = std::min<int64_t>(a.positions[b], kv_len - 1);
  int64_t first = a.window > 0 ? std::max<int64_t>(0, a.positions[b] - a.window + 1) : 0;
  int64_t n = std::max<int64_t>(0, last - first + 1);  // 0: no visible key (a padding row): zeros
  if (parts > 1) {
    const auto [lo, hi] = part_range(n, part, parts);
    first += lo;
    n = hi - lo;
  }
  const int64_t off = (b * a.heads + j0 * group) * d;
  attend_span(a, Span{a.q + off, (j1 - j0) * group, group, j0, j1, a.pages + b * a.pages_per_seq, first, n,
                      partial ? partial->out : a.out + off, partial}, scratch);
}

// Tokens a block of `attend_span`: SmolLM2's 3 KV heads of 64 in bf16, 96 KB of keys and values.
constexpr int64_t kBlockTokens = 128;

// Query heads a KV head from which a span's keys are transposed and scored as a matrix product (common.h
// `score_transposed`): `python -m bench.decode_attention --cases gsp,spec,gsp8`, alternated twice (AMD Zen
// 5): 16 rows sharing 1,024 tokens (48 heads a KV head) 6.8-7.1 -> 6.5-6.6 ms, 8 verify rows (24) 1.70-1.76
// -> 1.53-1.56; from 4 heads (16 rows in pairs: 6 a KV head) 9.4-9.9 -> 11.0-11.6, so not there.
constexpr int64_t kTransposedHeads = 8;

// Calls of `LineQueue::one` that summing one block's values makes (`attend_span`): a call per token (per pair
// of tokens on bf16 pairs) and vector pass over the head dimension, for each run of heads.
inline int64_t value_visits(int64_t nh, int64_t group, int64_t d, int64_t bn, bool pairs, bool tiles8) {
  int64_t visits = 0;
#if defined(XLASERVE_SPLIT_VEC)
  if (tiles8) {
    by_head_runs<3>(nh, group, [&](int64_t, auto heads) {
      constexpr int C = decltype(heads)::value <= 2 ? 4 : 2;
      visits += (d / (8 * C) + d % (8 * C) / 8) * ((bn + 1) / 2);
    });
    return visits;
  }
#endif
  by_head_runs(nh, group, [&](int64_t, auto heads) {
    constexpr int V = value_vecs<decltype(heads)::value>();
    visits += pairs ? (d + 63) / 64 * ((bn + 1) / 2) : (d / (V * kLanes) + d % (V * kLanes) / kLanes) * bn;
  });
  return visits;
}

// The query heads of a span against its tokens, in blocks of kBlockTokens: each block's keys scored, then
// its values summed, before the next block's (an online softmax: a head's sums rescaled when a block raises
// its maximum), so that no pass over the keys waits on memory while the values are summed:
// - Pages come from anywhere in the pool: within a block, each token's values are prefetched as its keys are
//   scored. A row's own span prefetches the first block's keys kPrefetchTokens ahead as they are scored, and
//   every later block's a line at a time while the block before it sums its values (`LineQueue`), so that
//   both passes keep the memory busy; a span of several rows' heads on one KV head (`run_shared`) prefetches
//   its keys ahead as they are scored throughout (the queue measured slower there on AVX2: 30 layers of 16 x
//   1,350 tokens in groups of 4 rows, 20.4-22.2 -> 22.8-29.7 ms min).
// - Prefetches are `prefetcht1` (locality 2; into L2): `prefetcht0` (the default) held one of the core's few
//   L1 miss buffers per line until it came, and the prefetches themselves stalled (19% of the kernel's samples
//   in a model's step sat on them). 16 sequences x 1,300 tokens, 30 layers' bf16 pools from DRAM, alternated
//   (AMD Zen 4): 39.6-39.8 -> 26.8-29.2 ms with bf16 queries, 45.9 -> 32.1 with f32 (t2: 31-32 ms; nta and t0
//   at 24 tokens ahead: 38-41 ms).
// Measured: AMD Zen 3 (AVX2, 2 x 512 KB of L2), where two passes over the whole span (every key, then every
// value) read the values twice from DRAM (a sequence of 1,152 tokens holds 884 KB of bf16 keys and values):
// rows' own spans, 30 layers of 16 x 1,350 tokens, medians 33.7-37.7 -> 29.6-37.0 ms over 5 alternations; a
// batch-16 step at 1,152 tokens (`bench.one_batch`, int8 flags) 95.7 / 71.6 -> 73.3 / 62.6 ms over 2. AMD Zen
// 5 (AVX-512, 2 x 1 MB of L2), where the two passes' values stayed in L2 but the memory sat idle while they
// were summed (the value loads had 28% of the kernel's samples), with the prefetches of `score_vectors`
// spread: 30 layers' bf16 pools, f32 queries, best of 15 (`python -m bench.decode_attention`): 32 rows
// x 640 tokens 23.6-24.5 -> 14.3-15.9 ms, one row of 2,048 1.75-2.11 -> 1.07-1.12, 16 rows in 8 pairs sharing
// 1,024 tokens + 192 each 16.5 -> 9.6-9.7, 16 rows sharing 1,024 + 160 each 8.8-9.1 -> 7.1-7.5; f32 pools 34.2 ->
// 30.1, 3.39 -> 2.56, 21.8 -> 19.0. The same source built for AVX2 (-march=znver3), one run each against the
// AVX2 blocks this driver replaced: 16.8 vs 15.8 ms, 1.58 vs 1.33, 13.8 vs 14.2, 11.5 vs 11.0. A first port
// that kept the AVX-512 scoring's 16 tokens' prefetches in one burst ran no faster than the two passes:
// spread them.
template <typename T>
void attend_span(const Attention<T>& a, const Span& span, Scratch& scratch) {
  const int64_t group = span.group, d = a.d, nh = span.nh, j0 = span.j0, j1 = span.j1, n = span.n;
  const Partial* partial = span.partial;
  float* out = span.out;
  std::fill(out, out + nh * d, 0.f);
  if (partial) {
    std::fill(partial->max, partial->max + nh, -INFINITY);
    std::fill(partial->sum, partial->sum + nh, 0.f);
  }
  if (n <= 0) return;
  // Each visible token's offset in the pool (its slot's rows of KV heads j0 ..), resolved once.
  std::vector<int64_t>& offsets = scratch.offsets;
  offsets.resize(n);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = span.first + t;
    const int64_t slot = int64_t(span.page_row[p / a.page_size]) * a.page_size + p % a.page_size;
    offsets[t] = (std::clamp<int64_t>(slot, 0, a.num_slots - 1) * a.kv_heads + j0) * d;  // never outside the pool
  }
  const float* q = span.q;
  const int64_t row_bytes = (j1 - j0) * d * int64_t(sizeof(T));  // one token's rows of these KV heads
  auto prefetch = [&](const T* p) {
    for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + i, 0, 2);
  };
  for (int64_t t = 0; t < std::min<int64_t>(n, kPrefetchTokens); ++t) prefetch(a.k + offsets[t]);
  const bool queue_keys = group == a.heads / a.kv_heads;  // a row's own span, not a shared one
#if defined(XLASERVE_SPLIT_VEC)
  const bool tiles8 = d % 8 == 0;  // AVX2's 8-lane register tiles (`dots4`, `sum_values8`)
#else
  constexpr bool tiles8 = false;
#endif
  // A span of many query heads a KV head (`run_shared`'s groups of rows): each KV head's keys of kLanes tokens
  // transposed once, then scored like a matrix product (`score_transposed`), where `dots` and its bf16 forms
  // take a horizontal sum (`reduce16`) per head and kLanes tokens, and an f32 query two pair products per key
  // pair.
  const bool transposed = !tiles8 && group >= kTransposedHeads && d % kLanes == 0;
#if defined(__AVX512BF16__)
  // A bf16 pool's keys read in place, scored by pair products: against a bf16 query (the bits of an f32 that
  // holds a bf16 value are that value's, in the upper half), or an f32 query's two bf16 parts. A bf16 query's
  // softmax weights are rounded to bf16 and summed against the values in pairs (`sum_value_pairs`).
  const bool bf16_keys = std::is_same<T, bf16_t>::value && d % (2 * kLanes) == 0;
  const bool pairs = bf16_keys && a.bf16_query;
  if (bf16_keys && !transposed) {
    scratch.query.resize((a.bf16_query ? 1 : 2) * nh * d);
    for (int64_t i = 0; i < nh * d; ++i) {
      const bf16_t hi = round_to_bf16(q[i]);
      scratch.query[i] = hi;
      if (!a.bf16_query) scratch.query[nh * d + i] = round_to_bf16(q[i] - to_float(hi));
    }
  }
  if (pairs) scratch.weights.resize(nh * kBlockTokens);
#else
  constexpr bool bf16_keys = false, pairs = false;
#endif
  std::vector<float>& scores = scratch.scores;  // [nh, kBlockTokens]: a block's scores, then its weights
  scores.resize(nh * kBlockTokens);
  std::vector<float>& stats = scratch.stats;  // [2, nh]: each head's running maximum and sum
  stats.assign(2 * nh, 0.f);
  float* const top = stats.data();
  float* const sum = stats.data() + nh;
  std::fill(top, top + nh, -INFINITY);
  scratch.rows.resize(kBlockTokens + 1);
  const T** rows = reinterpret_cast<const T**>(scratch.rows.data());
  if (transposed) scratch.keys.resize(d * kLanes);
  else if (!bf16_keys && !std::is_same<T, float>::value) scratch.keys.resize(kLanes * (j1 - j0) * d);
  for (int64_t t0 = 0; t0 < n; t0 += kBlockTokens) {
    const int64_t bn = std::min(kBlockTokens, n - t0);
    const int64_t key_end = !queue_keys ? n : t0 == 0 ? bn : 0;  // keys prefetched ahead as scored, up to here
    // Tokens [prefetched, upto) of the span: their values, and keys kPrefetchTokens ahead below key_end.
    int64_t prefetched = t0;
    auto prefetch_upto = [&](int64_t upto) {
      for (; prefetched < upto; ++prefetched) {
        if (prefetched + kPrefetchTokens < key_end) prefetch(a.k + offsets[prefetched + kPrefetchTokens]);
        prefetch(a.v + offsets[prefetched]);
      }
    };
    int64_t t = 0;  // within the block
#if defined(XLASERVE_SPLIT_VEC)
    if (tiles8)
      for (; t + 4 <= bn; t += 4) {  // 4 tokens, up to 3 query heads of a KV head at a time (`dots4`)
        prefetch_upto(t0 + t + 4);
        by_head_runs<3>(nh, group, [&](int64_t h, auto heads) {
          constexpr int G = decltype(heads)::value;
          const int64_t off = (h / group) * d;
          const int64_t* o = offsets.data() + t0 + t;
          const T* const keys[4] = {a.k + o[0] + off, a.k + o[1] + off, a.k + o[2] + off, a.k + o[3] + off};
          __m128 s[G];
          dots4<G>(q + h * d, keys, d, s);
          for (int g = 0; g < G; ++g) _mm_storeu_ps(scores.data() + (h + g) * kBlockTokens + t, s[g]);
        });
      }
#endif
    // kLanes tokens at a time, a vector of scores per head; their prefetches spread over the heads (all of
    // them before the first head stalled on the core's miss buffers: 30 layers' bf16 pools, f32 queries, 32
    // rows x 640 tokens 19.2 -> 15.9 ms, one row of 2,048 1.72 -> 1.12 ms, AMD Zen 5).
    auto score_vectors = [&](auto keys_of, auto dots_of) {
      for (; t + kLanes <= bn; t += kLanes) {
        const auto keys = keys_of(t0 + t);
        for (int64_t h = 0; h < nh; ++h) {
          prefetch_upto(t0 + t + (h + 1) * kLanes / nh);
          store(scores.data() + h * kBlockTokens + t, dots_of(h, keys));
        }
        prefetch_upto(t0 + t + kLanes);
      }
    };
    if (transposed)
      for (; t + kLanes <= bn; t += kLanes) {
        float* kt = scratch.keys.data();
        for (int64_t j = 0; j < j1 - j0; ++j) {
          transpose_keys(a.k + j * d, offsets.data() + t0 + t, kLanes, d, kt, kLanes);
          auto score = [&](int64_t h, auto rows) {
            score_transposed<decltype(rows)::value, 1>(q + h * d, kt, kLanes, d,
                                                       scores.data() + h * kBlockTokens + t, kBlockTokens);
          };
          const int64_t h1 = (j + 1) * group;
          int64_t h = j * group;
          for (; h + 8 <= h1; h += 8) score(h, std::integral_constant<int, 8>{});
          for (; h + 4 <= h1; h += 4) score(h, std::integral_constant<int, 4>{});
          for (; h < h1; ++h) score(h, std::integral_constant<int, 1>{});
          prefetch_upto(t0 + t + (j + 1) * kLanes / (j1 - j0));
        }
      }
#if defined(__AVX512BF16__)
    if (bf16_keys && !transposed) {
      const uint32_t* qp = reinterpret_cast<const uint32_t*>(scratch.query.data());
      score_vectors(
          [&](int64_t from) {
            std::array<const bf16_t*, kLanes> keys;
            for (int i = 0; i < kLanes; ++i) keys[i] = reinterpret_cast<const bf16_t*>(a.k + offsets[from + i]);
            return keys;
          },
          [&](int64_t h, const std::array<const bf16_t*, kLanes>& keys) {
            return a.bf16_query ? dots_bf16(qp + h * d / 2, keys.data(), (h / group) * d, d)
                                : dots_bf16x2(qp + h * d / 2, qp + (nh + h) * d / 2, keys.data(), (h / group) * d, d);
          });
    }
#endif
    if (!tiles8 && !bf16_keys && !transposed && d % kLanes == 0)
      // A bf16 pool's keys are widened once per kLanes tokens into f32 rows (every query head of a group reads
      // them).
      score_vectors(
          [&](int64_t from) {
            std::array<const float*, kLanes> keys;
            for (int i = 0; i < kLanes; ++i) {
              const T* key = a.k + offsets[from + i];
              if constexpr (std::is_same<T, float>::value) {
                keys[i] = key;
              } else {
                float* wide = scratch.keys.data() + i * (j1 - j0) * d;
                for (int64_t e = 0; e < (j1 - j0) * d; e += kLanes) store(wide + e, load_as_float(key + e));
                keys[i] = wide;
              }
            }
            return keys;
          },
          [&](int64_t h, const std::array<const float*, kLanes>& keys) {
            return dots(q + h * d, keys.data(), (h / group) * d, d);
          });
    for (; t < bn; ++t) {
      prefetch_upto(t0 + t + 1);
      const T* key = a.k + offsets[t0 + t];
      for (int64_t h = 0; h < nh; ++h) scores[h * kBlockTokens + t] = dot(q + h * d, key + (h / group) * d, d);
    }
    float* const sc = scores.data();
    const int64_t* const o = offsets.data() + t0;
    for (int64_t h = 0; h < nh; ++h) {  // scaled, capped; the block's exp(s - running max), the sums rescaled
      float* sh = sc + h * kBlockTokens;
      const float scale = a.scale, cap = a.soft_cap;  // locals: the stores into `sh` may not alias them
      float m = -INFINITY;
      int64_t i = 0;
      if (cap <= 0.f) {  // a vector at a time (a scalar loop here was ~9% of the kernel's samples on AVX2)
        vec mv = splat(-INFINITY);
        for (; i + kLanes <= bn; i += kLanes) {
          const vec x = load(sh + i) * splat(scale);
          store(sh + i, x);
          mv = vmax(x, mv);
        }
        m = hmax(mv);
      }
      for (; i < bn; ++i) {
        float x = sh[i] * scale;
        if (cap > 0.f) x = cap * std::tanh(x / cap);
        sh[i] = x;
        m = std::max(m, x);
      }
      if (m > top[h]) {
        if (sum[h] > 0.f) {  // an earlier block's: rescaled to the new maximum
          const float c = std::exp(top[h] - m);
          sum[h] *= c;
          for (int64_t e = 0; e < d; ++e) out[h * d + e] *= c;
        }
        top[h] = m;
      }
      vec acc = {};
      i = 0;
      for (; i + kLanes <= bn; i += kLanes) {
        const vec e = exp_vec(load(sh + i) - splat(top[h]));
        store(sh + i, e);
        acc += e;
      }
      float block_sum = hsum(acc);
      for (; i < bn; ++i) block_sum += (sh[i] = std::exp(sh[i] - top[h]));
      sum[h] += block_sum;
    }
    // Values: up to 4 query heads of a KV head at a time (AVX2: 3), each stretch of the head dimension summed
    // in registers over the block's tokens (a value row read once for all of them), the next block's keys
    // prefetched a line at a time as they go.
    const int64_t next = t0 + bn;
    const int64_t next_end = queue_keys ? std::min(n, next + kBlockTokens) : next;
    LineQueue queue{reinterpret_cast<const char*>(a.k), offsets.data(), int64_t(sizeof(T)), row_bytes, next,
                    next_end};
    queue.pace((next_end - next) * ((row_bytes + 63) / 64), value_visits(nh, group, d, bn, pairs, tiles8));
#if defined(XLASERVE_SPLIT_VEC)
    if (tiles8) {
      for (int64_t i = 0; i < bn; ++i) rows[i] = a.v + o[i];
      by_head_runs<3>(nh, group, [&](int64_t h, auto heads) {
        sum_values8<decltype(heads)::value>(sc + h * kBlockTokens, kBlockTokens, bn, rows, (h / group) * d,
                                            out + h * d, d, queue);
      });
    }
#endif
#if defined(__AVX512BF16__)
    if (pairs) {
      // The weights rounded to bf16 (ties to even; zeros past bn up to the block's end), then summed in pairs.
      // They are the block's exp(s - running max), its sum taken before rounding.
      const int64_t n2 = (bn + 1) / 2;
      auto live = [bn](int64_t from) {  // lanes of the 16 weights from `from` that are tokens
        return __mmask16((1u << std::clamp<int64_t>(bn - from, 0, kLanes)) - 1);
      };
      for (int64_t h = 0; h < nh; ++h) {
        const float* sh = sc + h * kBlockTokens;
        uint16_t* wh = scratch.weights.data() + h * kBlockTokens;
        for (int64_t i = 0; i < kBlockTokens; i += 2 * kLanes) {
          const __m512 x0 = _mm512_maskz_loadu_ps(live(i), sh + i);
          const __m512 x1 = _mm512_maskz_loadu_ps(live(i + kLanes), sh + i + kLanes);
          _mm512_storeu_si512(wh + i, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
        }
      }
      const bf16_t** pair_rows = reinterpret_cast<const bf16_t**>(rows);
      by_head_runs(nh, group, [&](int64_t h, auto heads) {
        for (int64_t i = 0; i < bn; ++i) pair_rows[i] = reinterpret_cast<const bf16_t*>(a.v + o[i]) + (h / group) * d;
        if (bn % 2) pair_rows[bn] = pair_rows[bn - 1];  // its weight is zero
        sum_value_pairs<decltype(heads)::value>(scratch.weights.data() + h * kBlockTokens, kBlockTokens, n2,
                                                pair_rows, out + h * d, d, queue);
      });
    }
#endif
    if (!tiles8 && !pairs)
      by_head_runs(nh, group, [&](int64_t h, auto heads) {
        for (int64_t i = 0; i < bn; ++i) rows[i] = a.v + o[i] + (h / group) * d;
        sum_values<decltype(heads)::value>(sc + h * kBlockTokens, kBlockTokens, bn, rows, out + h * d, d, queue);
      });
    queue.rest();
  }
  for (int64_t h = 0; h < nh; ++h) {
    if (partial) {  // the caller normalizes the merged parts
      partial->max[h] = top[h];
      partial->sum[h] = sum[h];
      continue;
    }
    const float inv = 1.f / sum[h];
    for (int64_t e = 0; e < d; ++e) out[h * d + e] *= inv;
  }
}

// Tokens a part of a split chunk takes at least (`run`).
constexpr int64_t kMinPartTokens = 256;

// out[0, d) = the normalized merge of `count` unnormalized parts of one query head's softmax, part i's
// (its d outputs, maximum, sum) given by `part(i)`: out = sum_i e^(max_i - M) out_i / sum_i e^(max_i - M) sum_i.
struct PartView {
  const float* out;
  float max, sum;
};

template <typename Parts>
void merge_parts(float* out, int64_t d, int64_t count, Parts part) {
  float top = -INFINITY;
  for (int64_t i = 0; i < count; ++i) top = std::max(top, part(i).max);
  std::fill(out, out + d, 0.f);
  if (top == -INFINITY) return;  // no visible key: zeros
  float total = 0.f;
  for (int64_t i = 0; i < count; ++i) {
    const PartView p = part(i);
    const float w = p.max == -INFINITY ? 0.f : std::exp(p.max - top);
    total += w * p.sum;
    for (int64_t e = 0; e < d; ++e) out[e] += w * p.out[e];
  }
  const float inv = 1.f / total;
  for (int64_t e = 0; e < d; ++e) out[e] *= inv;
}

// Shared pages (`run_shared`): a group shares at least this many tokens, or its rows are attended alone.
constexpr int64_t kMinSharedTokens = 32;

// Token reads `run_shared` saved since the library was loaded (each group: its shared tokens once for every
// row but the first), per layer call; XlaserveCpuSharedAttentionTokens reports it.
std::atomic<int64_t> shared_tokens_saved{0};
std::atomic<bool> shared_pages_on{true};  // XlaserveCpuSetSharedAttention: off to compare

// Rows whose page tables begin with the same pages read the same keys and values there: requests whose
// prompts share a prefix held by the radix cache (one physical copy of its pages), the n samples of one
// prompt, and the draft rows of one request in a speculative verify step (the same pages throughout). Each
// such group's shared tokens are attended once for all its rows: the query heads of every row against each
// KV head's keys, read once (from DRAM once, where each row alone read them again), split over the tokens
// into parts like a long sequence's; each row then attends its own remaining tokens, and the parts are
// merged by their maxima and sums. The arithmetic is a row's own (the same scores, the softmax summed in
// another order). Which rows group is read off the page ids alone: two rows reading the same page read the
// same slots. Returns false (nothing done) where no group shares `kMinSharedTokens` tokens, and with a
// sliding window (whose first visible token differs per row). A group's shared part is one span over all
// its KV heads (each token's rows read together, as a row's own span reads them): one span per KV head
// streamed the same pages three times for SmolLM2, a third of each token's bytes at a time, and rows in pairs
// were slower shared than alone (30 layers of 16 x 1,152 tokens, pairs sharing 1,024, bf16 pools, AMD Zen 3:
// best of 30 23.2-26.0 -> 19.3-21.3 ms, alternated 4 times; the same from L3).
template <typename T>
bool run_shared(const Attention<T>& a, int64_t batch, std::vector<Scratch>& scratch) {
  if (a.window > 0 || batch < 2 || !shared_pages_on.load(std::memory_order_relaxed)) return false;
  const int64_t kv_len = a.pages_per_seq * a.page_size, ps = a.page_size, group = a.heads / a.kv_heads,
                d = a.d;
  auto page_row = [&](int64_t b) { return a.pages + b * a.pages_per_seq; };
  std::vector<int64_t> len(batch);  // visible tokens
  for (int64_t b = 0; b < batch; ++b) len[b] = std::max<int64_t>(0, std::min<int64_t>(a.positions[b], kv_len - 1) + 1);
  // A group: the first row not yet in one, and of the later rows with its first page the ones that save the
  // most reads: with m of them sorted by the tokens each shares with it (most first), m * (the m-th's
  // tokens) reads are saved, all m + 1 rows sharing the m-th's tokens.
  struct Group {
    int64_t shared, parts;
    std::vector<int64_t> rows;
  };
  std::vector<Group> groups;
  std::vector<int64_t> group_of(batch, -1), member_of(batch, -1);
  std::vector<std::pair<int64_t, int64_t>> candidates;  // (shared tokens, row)
  for (int64_t b = 0; b < batch; ++b) {
    if (group_of[b] >= 0 || len[b] < kMinSharedTokens) continue;
    const int32_t* pb = page_row(b);
    candidates.clear();
    for (int64_t c = b + 1; c < batch; ++c) {
      const int32_t* pc = page_row(c);
      if (group_of[c] >= 0 || len[c] < kMinSharedTokens || pc[0] != pb[0]) continue;
      const int64_t limit = std::min(len[b], len[c]);
      int64_t p = 0;  // pages in common
      while (p * ps < limit && pc[p] == pb[p]) ++p;
      candidates.emplace_back(std::min(p * ps, limit), c);
    }
    std::stable_sort(candidates.begin(), candidates.end(),
                     [](const auto& x, const auto& y) { return x.first > y.first; });
    int64_t best = 0, members = 0;
    for (int64_t i = 0; i < int64_t(candidates.size()); ++i)
      if (candidates[i].first >= kMinSharedTokens && (i + 1) * candidates[i].first > best)
        best = (i + 1) * candidates[i].first, members = i + 1;
    if (members == 0) continue;
    Group g{candidates[members - 1].first, 1, {b}};
    for (int64_t i = 0; i < members; ++i) g.rows.push_back(candidates[i].second);
    for (int64_t i = 0; i < int64_t(g.rows.size()); ++i) group_of[g.rows[i]] = int64_t(groups.size()), member_of[g.rows[i]] = i;
    groups.push_back(std::move(g));
  }
  if (groups.empty()) return false;
  int64_t saved = 0;
  for (const Group& g : groups) saved += g.shared * (int64_t(g.rows.size()) - 1);
  shared_tokens_saved.fetch_add(saved, std::memory_order_relaxed);

  // Work: each group's (KV head, part) chunks first (the largest), then the rows in no group (whole, into
  // the output), then each grouped row's own tokens (all its KV heads, a part to merge).
  const int64_t threads = Workers::get().size() + 1;
  std::vector<int64_t> shared_base(groups.size()), query_base(groups.size()), tail_base(batch, -1);
  int64_t floats = 0, queries = 0, shared_chunks = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    Group& g = groups[gi];
    // Split over the threads down to kMinSharedTokens a part: a speculative verify's group (one request's
    // rows) is the step's only one at batch 1.
    g.parts = std::clamp<int64_t>(g.shared / kMinSharedTokens, 1, threads);
    const int64_t nh = a.heads * int64_t(g.rows.size());  // every KV head's heads of every row
    shared_base[gi] = floats;
    floats += g.parts * nh * (d + 2);
    query_base[gi] = queries;
    queries += nh * d;
    shared_chunks += g.parts;
  }
  std::vector<int64_t> singles, tails;
  for (int64_t b = 0; b < batch; ++b) {
    if (group_of[b] < 0) {
      singles.push_back(b);
    } else {
      tail_base[b] = floats;
      floats += a.heads * (d + 2);
      tails.push_back(b);
    }
  }
  std::vector<float> partials(floats), gathered(queries);
  auto shared_partial = [&](int64_t gi, int64_t part) {
    const int64_t nh = a.heads * int64_t(groups[gi].rows.size());
    float* base = partials.data() + shared_base[gi] + part * nh * (d + 2);
    return Partial{base, base + nh * d, base + nh * (d + 1)};
  };
  auto tail_partial = [&](int64_t b) {
    float* base = partials.data() + tail_base[b];
    return Partial{base, base + a.heads * d, base + a.heads * (d + 1)};
  };
  // A group's query heads, KV head by KV head and row after row: [kv_heads, rows, group, d], one span's.
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const Group& g = groups[gi];
    for (int64_t j = 0; j < a.kv_heads; ++j)
      for (size_t m = 0; m < g.rows.size(); ++m)
        std::copy_n(a.q + (g.rows[m] * a.heads + j * group) * d, group * d,
                    gathered.data() + query_base[gi] + (j * int64_t(g.rows.size()) + int64_t(m)) * group * d);
  }
  std::vector<std::pair<int64_t, int64_t>> chunk_of;  // shared chunk -> (group, part)
  for (size_t gi = 0; gi < groups.size(); ++gi)
    for (int64_t c = 0; c < groups[gi].parts; ++c) chunk_of.emplace_back(int64_t(gi), c);
  const int64_t total = shared_chunks + int64_t(singles.size()) + int64_t(tails.size());
  Workers::get().parallel_for(total, [&](int64_t i, int worker) {
    if (i < shared_chunks) {
      const auto [gi, part] = chunk_of[i];
      const Group& g = groups[gi];
      const int64_t rows = int64_t(g.rows.size());
      const auto [lo, hi] = part_range(g.shared, part, g.parts);
      const Partial p = shared_partial(gi, part);
      attend_span(a, Span{gathered.data() + query_base[gi], a.heads * rows, group * rows, 0, a.kv_heads,
                          page_row(g.rows[0]), lo, hi - lo, p.out, &p}, scratch[worker]);
    } else if (i < shared_chunks + int64_t(singles.size())) {
      attend(a, singles[i - shared_chunks], 0, a.kv_heads, scratch[worker]);
    } else {
      const int64_t b = tails[i - shared_chunks - int64_t(singles.size())];
      const Partial p = tail_partial(b);
      const int64_t shared = groups[group_of[b]].shared;
      attend_span(a, Span{a.q + b * a.heads * d, a.heads, group, 0, a.kv_heads, page_row(b), shared,
                          len[b] - shared, p.out, &p}, scratch[worker]);
    }
  });
  for (int64_t b : tails) {
    const int64_t gi = group_of[b], m = member_of[b], parts = groups[gi].parts;
    const Partial tail = tail_partial(b);
    const int64_t rows = int64_t(groups[gi].rows.size());
    for (int64_t h = 0; h < a.heads; ++h) {
      const int64_t j = h / group, head = (j * rows + m) * group + h % group;  // among the group's span's heads
      merge_parts(a.out + (b * a.heads + h) * d, d, parts + 1, [&](int64_t i) {
        if (i == parts) return PartView{tail.out + h * d, tail.max[h], tail.sum[h]};
        const Partial p = shared_partial(gi, i);
        return PartView{p.out + head * d, p.max[head], p.sum[head]};
      });
    }
  }
  return true;
}

template <typename T>
void run(const Attention<T>& a, int64_t batch) {
  Workers& workers = Workers::get();
  const int64_t threads = workers.size() + 1;
  std::vector<Scratch> scratch(threads);
  if (run_shared(a, batch, scratch)) return;
  if (batch > workers.size()) {  // a chunk per sequence: its pages read as contiguous runs
    workers.parallel_for(batch, [&](int64_t b, int worker) { attend(a, b, 0, a.kv_heads, scratch[worker]); });
    return;
  }
  // Too few sequences to keep every thread busy: a chunk per (sequence, KV head). When those do not divide
  // evenly over the threads (one sequence of 3 KV heads on 2 threads: one thread took two, the step waited
  // for it), and the sequences are long, each sequence is split over its tokens into `threads` parts instead,
  // every KV head in each (a token's rows read as one contiguous run, where a part per KV head read a third
  // of each: one sequence of 3,000 tokens, 30 layers, 2 threads, 2.70 -> 2.40 ms with its KV in L3, 7.3 -> 7.0
  // from DRAM), each part's softmax kept unnormalized with its maximum and sum, and the parts merged here
  // (flash decoding).
  const int64_t chunks = batch * a.kv_heads, d = a.d;
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max<int64_t>(longest, a.positions[b] + 1);
  if (chunks % threads == 0 || longest < threads * kMinPartTokens) {
    workers.parallel_for(chunks, [&](int64_t c, int worker) {
      attend(a, c / a.kv_heads, c % a.kv_heads, c % a.kv_heads + 1, scratch[worker]);
    });
    return;
  }
  const int64_t parts = threads, stride = a.heads * (d + 2);
  std::vector<float> partials(batch * parts * stride);
  auto partial = [&](int64_t b, int64_t part) {
    float* base = partials.data() + (b * parts + part) * stride;
    return Partial{base, base + a.heads * d, base + a.heads * (d + 1)};
  };
  workers.parallel_for(batch * parts, [&](int64_t i, int worker) {
    const int64_t b = i / parts, part = i % parts;
    const Partial p = partial(b, part);
    attend(a, b, 0, a.kv_heads, scratch[worker], part, parts, &p);
  });
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < a.heads; ++h)
      merge_parts(a.out + (b * a.heads + h) * d, d, parts, [&](int64_t part) {
        const Partial p = partial(b, part);
        return PartView{p.out + h * d, p.max[h], p.sum[h]};
      });
}

ffi::Error DecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pages,
                               ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out,
                               int32_t page_size, int32_t window, float scale, float soft_cap,
                               int32_t bf16_query) {
  auto qd = q.dimensions(), kd = k_pool.dimensions(), pd = pages.dimensions(), vd = v_pool.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return ffi::Error::InvalidArgument("xlaserve_cpu_decode_attention: bad ranks or K/V shapes");
  const ffi::DataType type = k_pool.element_type();
  if ((type != ffi::DataType::F32 && type != ffi::DataType::BF16) || v_pool.element_type() != type)
    return ffi::Error::InvalidArgument("xlaserve_cpu_decode_attention: the pools must both be f32 or bf16");
  const int64_t batch = qd[0], heads = qd[1], d = qd[2];
  const int64_t num_layers = kd[0], num_slots = kd[1], kv_heads = kd[2];
  if (kd[3] != d || heads % kv_heads != 0 || pd[0] != batch || positions.element_count() != batch ||
      page_size < 1)
    return ffi::Error::InvalidArgument("xlaserve_cpu_decode_attention: shapes do not agree");
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, num_layers - 1);
  const int64_t layer_size = num_slots * kv_heads * d;
  auto problem = [&](auto* k, auto* v) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
    return Attention<T>{q.typed_data(), k + l * layer_size, v + l * layer_size, pages.typed_data(),
                        positions.typed_data(), out->typed_data(), heads, kv_heads, d, num_slots, pd[1],
                        page_size, window, scale, soft_cap, bf16_query != 0};
  };
  if (type == ffi::DataType::F32)
    run(problem(static_cast<const float*>(k_pool.untyped_data()), static_cast<const float*>(v_pool.untyped_data())),
        batch);
  else
    run(problem(static_cast<const bf16_t*>(k_pool.untyped_data()),
                static_cast<const bf16_t*>(v_pool.untyped_data())),
        batch);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

// Decode attention's key token reads saved by shared pages (`run_shared`) since the library was loaded.
extern "C" int64_t XlaserveCpuSharedAttentionTokens() {
  return xlaserve::shared_tokens_saved.load(std::memory_order_relaxed);
}

// Lets the decode attention read shared pages once a group (the default), or never (benchmarks compare).
extern "C" void XlaserveCpuSetSharedAttention(int on) { xlaserve::shared_pages_on.store(on != 0); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuDecodeAttention, xlaserve::DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("page_size")
                                  .Attr<int32_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("bf16_query"));
