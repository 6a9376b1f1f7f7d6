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
// keys and values widened to f32 as they are read, half the bytes).
//
// Measured (SmolLM2 shapes: 32 sequences of 141 tokens, 9 query and 3 KV heads of 64; 30 layers' pools,
// so read from DRAM): 0.34-0.41 ms per layer, 7 MB of K and V at 17-20 GB/s against ~30 for a plain
// stream; with the KV in L2 the same work takes 0.13-0.15 ms, so it is bound by memory. A single pass
// with an online softmax (K and V of a token read together, as flash decoding) measured slower from
// DRAM, 0.42-0.44 ms, and changing the prefetch distance (2-64 tokens) or hint did not move either.

#include <cmath>
#include <type_traits>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

constexpr int64_t kPrefetchTokens = 8;  // keys prefetched this many tokens ahead

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
#endif

// Lane i: the sum of acc[i]'s lanes.
inline vec reduce16(const vec (&acc)[kLanes]) {
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

// For G query heads g sharing a KV head: out[g * d, + V*kLanes) = sum_t p[g * n + t] * rows[t][0, V*kLanes),
// the sums held in registers; each value row is loaded (and, from a bf16 pool, widened) once for the G.
template <int V, int G, typename T>
inline void weighted_sum(const float* p, int64_t n, const T* const* rows, float* out, int64_t d) {
  vec acc[G][V] = {};
  for (int64_t t = 0; t < n; ++t) {
    vec r[V];
    for (int i = 0; i < V; ++i) r[i] = load_as_float(rows[t] + i * kLanes);
    for (int g = 0; g < G; ++g) {
      const vec pt = broadcast(p + g * n + t);
      for (int i = 0; i < V; ++i) acc[g][i] += pt * r[i];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) store(out + g * d + i * kLanes, acc[g][i]);
}

// out[g * d, + d) for G query heads from the first one's weights `p` (heads n apart) and output `out`
// (heads d apart), against their KV head's value rows `rows[t]` (moved along as the columns are done).
template <int G, typename T>
void sum_values(const float* p, int64_t n, const T** rows, float* out, int64_t d) {
  constexpr int V = G <= 2 ? 4 : 2;  // at most 16 accumulators
  int64_t d0 = 0;
  for (; d0 + V * kLanes <= d; d0 += V * kLanes) {
    weighted_sum<V, G>(p, n, rows, out + d0, d);
    for (int64_t t = 0; t < n; ++t) rows[t] += V * kLanes;
  }
  for (; d0 + kLanes <= d; d0 += kLanes) {
    weighted_sum<1, G>(p, n, rows, out + d0, d);
    for (int64_t t = 0; t < n; ++t) rows[t] += kLanes;
  }
  for (; d0 < d; ++d0) {
    for (int g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) sum += p[g * n + t] * to_float(rows[t][0]);
      out[g * d + d0] = sum;
    }
    for (int64_t t = 0; t < n; ++t) ++rows[t];
  }
}

struct Scratch {
  std::vector<float> scores;
  std::vector<float> keys;        // a bf16 pool's block of kLanes tokens' key rows, widened once
  std::vector<uint16_t> query;    // a bf16 query's heads as bf16 (`dots_bf16`)
  std::vector<const void*> rows;  // of the pool's element type
  std::vector<int64_t> offsets;
};

// One part of a (sequence, KV heads) chunk split over its tokens (`run`): its query heads' softmax over the
// part's tokens, not normalized, for the caller to merge.
struct Partial {
  float* out;  // [nh, d]: sum_t exp(s_t - max) v_t
  float* max;  // [nh]: the largest score (-inf: no token)
  float* sum;  // [nh]: sum_t exp(s_t - max)
};

// Query heads of sequence b whose KV heads are j0 .. j1-1 (group = heads / kv_heads query heads each)
// against their keys and values. Keys are visited in order, each token's rows of every KV head in the
// range read together (one contiguous run per token). `scratch`: the worker's buffers. With `partial`,
// only part `part` of `parts` stretches of the visible tokens, into `partial`.
template <typename T>
void attend(const Attention<T>& a, int64_t b, int64_t j0, int64_t j1, Scratch& scratch, int64_t part = 0,
            int64_t parts = 1, const Partial* partial = nullptr) {
  const int64_t group = a.heads / a.kv_heads, d = a.d;
  const int64_t nh = (j1 - j0) * group;  // query heads in this chunk
  float* out = partial ? partial->out : a.out + (b * a.heads + j0 * group) * d;
  std::fill(out, out + nh * d, 0.f);
  if (partial) {
    std::fill(partial->max, partial->max + nh, -INFINITY);
    std::fill(partial->sum, partial->sum + nh, 0.f);
  }
  const int64_t kv_len = a.pages_per_seq * a.page_size;
  const int64_t last = std::min<int64_t>(a.positions[b], kv_len - 1);
  int64_t first = a.window > 0 ? std::max<int64_t>(0, a.positions[b] - a.window + 1) : 0;
  if (last < first) return;  // no visible key (a padding row): zeros
  int64_t n = last - first + 1;
  if (parts > 1) {  // whole vectors of tokens a part
    const int64_t per = ((n + parts - 1) / parts + kLanes - 1) / kLanes * kLanes;
    const int64_t lo = std::min(n, part * per), hi = std::min(n, lo + per);
    first += lo;
    n = hi - lo;
    if (n == 0) return;
  }
  std::vector<float>& scores = scratch.scores;
  scores.resize(nh * n);
  // Each visible token's offset in the pool (its slot's rows of KV heads j0 ..), resolved once.
  std::vector<int64_t>& offsets = scratch.offsets;
  offsets.resize(n);
  const int32_t* page_row = a.pages + b * a.pages_per_seq;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = first + t;
    const int64_t slot = int64_t(page_row[p / a.page_size]) * a.page_size + p % a.page_size;
    offsets[t] = (std::clamp<int64_t>(slot, 0, a.num_slots - 1) * a.kv_heads + j0) * d;  // never outside the pool
  }
  const float* q = a.q + (b * a.heads + j0 * group) * d;
  const int64_t row_bytes = (j1 - j0) * d * int64_t(sizeof(T));  // one token's rows of these KV heads
  auto prefetch = [&](const T* p) {
    for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + i);
  };
  // Pages come from anywhere in the pool: prefetch keys kPrefetchTokens ahead, and each token's values
  // while its keys are scored, so both arrive while the previous ones are computed on.
  for (int64_t t = 0; t < std::min<int64_t>(n, kPrefetchTokens); ++t) prefetch(a.k + offsets[t]);
  int64_t t = 0;
#if defined(__AVX512BF16__)
  if (std::is_same<T, bf16_t>::value && a.bf16_query && d % (2 * kLanes) == 0) {
    // A bf16 query against a bf16 pool: the keys read in place, scored by pair products (the bits of an f32
    // that holds a bf16 value are that value's, in the upper half).
    scratch.query.resize(nh * d);
    for (int64_t i = 0; i < nh * d; ++i) {
      uint32_t bits;
      std::memcpy(&bits, q + i, sizeof(bits));
      scratch.query[i] = uint16_t(bits >> 16);
    }
    const uint32_t* qp = reinterpret_cast<const uint32_t*>(scratch.query.data());
    const bf16_t* keys[kLanes];
    for (; t + kLanes <= n; t += kLanes) {
      for (int i = 0; i < kLanes; ++i) {
        if (t + i + kPrefetchTokens < n) prefetch(a.k + offsets[t + i + kPrefetchTokens]);
        prefetch(a.v + offsets[t + i]);
        keys[i] = reinterpret_cast<const bf16_t*>(a.k + offsets[t + i]);
      }
      for (int64_t h = 0; h < nh; ++h) {
        vec s = dots_bf16(qp + h * d / 2, keys, (h / group) * d, d) * splat(a.scale);
        if (a.soft_cap > 0.f)
          for (int i = 0; i < kLanes; ++i) s[i] = a.soft_cap * std::tanh(s[i] / a.soft_cap);
        store(scores.data() + h * n + t, s);
      }
    }
  }
#endif
  if (d % kLanes == 0) {  // whole blocks of kLanes tokens: a vector of scores per head at a time
    // A bf16 pool's keys are widened once per block into f32 rows (every query head of a group reads them).
    const int64_t row = (j1 - j0) * d;
    if (!std::is_same<T, float>::value) scratch.keys.resize(kLanes * row);
    const float* keys[kLanes];
    for (; t + kLanes <= n; t += kLanes) {
      for (int i = 0; i < kLanes; ++i) {
        if (t + i + kPrefetchTokens < n) prefetch(a.k + offsets[t + i + kPrefetchTokens]);
        prefetch(a.v + offsets[t + i]);
        const T* key = a.k + offsets[t + i];
        if constexpr (std::is_same<T, float>::value) {
          keys[i] = key;
        } else {
          float* wide = scratch.keys.data() + i * row;
          for (int64_t e = 0; e < row; e += kLanes) store(wide + e, load_as_float(key + e));
          keys[i] = wide;
        }
      }
      for (int64_t h = 0; h < nh; ++h) {
        vec s = dots(q + h * d, keys, (h / group) * d, d) * splat(a.scale);
        if (a.soft_cap > 0.f)
          for (int i = 0; i < kLanes; ++i) s[i] = a.soft_cap * std::tanh(s[i] / a.soft_cap);
        store(scores.data() + h * n + t, s);
      }
    }
  }
  for (; t < n; ++t) {
    if (t + kPrefetchTokens < n) prefetch(a.k + offsets[t + kPrefetchTokens]);
    prefetch(a.v + offsets[t]);
    const T* keys = a.k + offsets[t];
    for (int64_t h = 0; h < nh; ++h) {
      float s = dot(q + h * d, keys + (h / group) * d, d) * a.scale;
      if (a.soft_cap > 0.f) s = a.soft_cap * std::tanh(s / a.soft_cap);
      scores[h * n + t] = s;
    }
  }
  const int64_t nv = n / kLanes * kLanes;
  for (int64_t h = 0; h < nh; ++h) {
    float* sh = scores.data() + h * n;
    float m = -INFINITY;  // the largest score: a vector of maxima, then the tail (a scalar chain ran 10% of it)
    {
      vec mv = splat(-INFINITY);
      int64_t t = 0;
      for (; t + kLanes <= n; t += kLanes) {
        const vec x = load(sh + t);
        mv = x > mv ? x : mv;
      }
      for (int i = 0; i < kLanes; ++i) m = std::max(m, mv[i]);
      for (; t < n; ++t) m = std::max(m, sh[t]);
    }
    vec sum_v = {};
    for (int64_t t = 0; t < nv; t += kLanes) {
      const vec e = exp_vec(load(sh + t) - splat(m));
      store(sh + t, e);
      sum_v += e;
    }
    float sum = hsum(sum_v);
    for (int64_t t = nv; t < n; ++t) sum += (sh[t] = std::exp(sh[t] - m));
    if (partial) {  // the caller normalizes the merged parts
      partial->max[h] = m;
      partial->sum[h] = sum;
      continue;
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; ++t) sh[t] *= inv;
  }
  // Values: up to 4 query heads of a KV head at a time, each kLanes-wide stretch of the head dimension
  // summed in registers over the tokens (a value row read once for all of them); row pointers resolved once
  // per pass.
  scratch.rows.resize(n);
  const T** rows = reinterpret_cast<const T**>(scratch.rows.data());
  for (int64_t h = 0; h < nh;) {
    const int64_t kv_end = (h / group + 1) * group;  // the first head of the next KV head
    const int heads = int(std::min<int64_t>(4, kv_end - h));
    for (int64_t t = 0; t < n; ++t) rows[t] = a.v + offsets[t] + (h / group) * d;
    const float* ph = scores.data() + h * n;
    switch (heads) {
      case 1: sum_values<1>(ph, n, rows, out + h * d, d); break;
      case 2: sum_values<2>(ph, n, rows, out + h * d, d); break;
      case 3: sum_values<3>(ph, n, rows, out + h * d, d); break;
      default: sum_values<4>(ph, n, rows, out + h * d, d); break;
    }
    h += heads;
  }
}

// Tokens a part of a split chunk takes at least (`run`).
constexpr int64_t kMinPartTokens = 256;

template <typename T>
void run(const Attention<T>& a, int64_t batch) {
  Workers& workers = Workers::get();
  const int64_t threads = workers.size() + 1;
  std::vector<Scratch> scratch(threads);
  if (batch > workers.size()) {  // a chunk per sequence: its pages read as contiguous runs
    workers.parallel_for(batch, [&](int64_t b, int worker) { attend(a, b, 0, a.kv_heads, scratch[worker]); });
    return;
  }
  // Too few sequences to keep every thread busy: a chunk per (sequence, KV head). When those do not divide
  // evenly over the threads (one sequence of 3 KV heads on 2 threads: one thread took two, the step waited
  // for it), and the sequences are long, each chunk is split over its tokens into `threads` parts, each
  // part's softmax kept unnormalized with its maximum and sum, and the parts merged here (flash decoding).
  const int64_t chunks = batch * a.kv_heads, group = a.heads / a.kv_heads, d = a.d;
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max<int64_t>(longest, a.positions[b] + 1);
  if (chunks % threads == 0 || longest < threads * kMinPartTokens) {
    workers.parallel_for(chunks, [&](int64_t c, int worker) {
      attend(a, c / a.kv_heads, c % a.kv_heads, c % a.kv_heads + 1, scratch[worker]);
    });
    return;
  }
  const int64_t parts = threads, stride = group * (d + 2);
  std::vector<float> partials(chunks * parts * stride);
  auto partial = [&](int64_t c, int64_t part) {
    float* base = partials.data() + (c * parts + part) * stride;
    return Partial{base, base + group * d, base + group * (d + 1)};
  };
  workers.parallel_for(chunks * parts, [&](int64_t i, int worker) {
    const int64_t c = i / parts, part = i % parts;
    const Partial p = partial(c, part);
    attend(a, c / a.kv_heads, c % a.kv_heads, c % a.kv_heads + 1, scratch[worker], part, parts, &p);
  });
  for (int64_t c = 0; c < chunks; ++c) {  // out = sum_p e^(max_p - M) out_p / sum_p e^(max_p - M) sum_p
    float* out = a.out + (c / a.kv_heads * a.heads + c % a.kv_heads * group) * d;
    for (int64_t g = 0; g < group; ++g) {
      float top = -INFINITY;
      for (int64_t part = 0; part < parts; ++part) top = std::max(top, partial(c, part).max[g]);
      float total = 0.f;
      std::fill(out + g * d, out + (g + 1) * d, 0.f);
      if (top == -INFINITY) continue;  // no visible key: zeros
      for (int64_t part = 0; part < parts; ++part) {
        const Partial p = partial(c, part);
        const float w = p.max[g] == -INFINITY ? 0.f : std::exp(p.max[g] - top);
        total += w * p.sum[g];
        for (int64_t e = 0; e < d; ++e) out[g * d + e] += w * p.out[g * d + e];
      }
      const float inv = 1.f / total;
      for (int64_t e = 0; e < d; ++e) out[g * d + e] *= inv;
    }
  }
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
