// xlaserve CPU matmul for decode-sized row counts: y f32[m, n] = x f32[m, k] @ W, W stored [k, n]
// (w_layout 0: a Linear kernel) or [n, k] (w_layout 1: a tied embedding used as the LM head).
// kernels/cpu/__init__.py sends at most MAX_NATIVE_ROWS rows (and with [n, k] weights none between
// MAX_GEMV_ROWS and MIN_NK_GEMM_ROWS): larger products (prefill) go to XLA's own dot.
//
// Why: XLA:CPU hands every dot to Eigen, which runs a matrix-vector product of a decode step's 1-7 MB
// weights on one core: about 22 GB/s here, against 30 GB/s that both cores read; and at 32 rows it
// reaches about 110 GFLOP/s of the ~310 a large square product gets, because it reads the weights
// in column panels that the hardware prefetcher cannot follow. Here the product is split over every
// core in chunks that each stream a contiguous stretch of the weights:
//   - [k, n], up to kGemvRows rows: chunks of weight rows (the k axis), each summed into its own
//     f32[m, n] partial; the caller adds the partials up in chunk order, so the result does not depend
//     on which thread took which chunk.
//   - [k, n], more rows: the same with one chunk per worker, walked in blocks of kBlockK rows; a block
//     (contiguous in memory) is multiplied tile by tile, kTileRows rows of x by kTileVecs vectors of
//     columns held in registers, so each weight is loaded once per tile of rows from L1. The next
//     block, if small, is prefetched into L2 while one is computed.
//   - [n, k], up to kGemvRows rows: chunks of weight rows (output columns); tiles of up to kMaxTileRows
//     x rows by 4 weight rows, reduced along k at the end.
//   - [n, k], more rows (kernels/cpu/__init__.py sends 17+): x transposed once, then chunks of weight
//     rows, each weight broadcast against vectors of x's rows (nk_gemm_tile). At 32 rows of the SmolLM2
//     LM head: 6.2-6.7 ms standalone against XLA's 8.6-9.3; 9 ms in a decode step against 15-16.
// Workers claim chunks from an atomic counter, so the caller finishes the job alone if the helpers are
// busy, and a helper that comes late finds no work.
// Portable C++: GCC/Clang vector extensions, compiled for the host's vector width at first use.

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

// Chunks per worker of the matrix-vector products. [k, n]: one (each worker streams one contiguous stretch;
// a batch-1 decode step measured 20.2-20.4 ms against 20.8-20.9 with 2, 20.4-21.0 with 4 and 22.0-22.3
// with 12 chunks per worker). [n, k] (the LM head): 4, about 0.15 ms per step faster than 1.
constexpr int kKnChunksPerWorker = 1;
constexpr int kNkChunksPerWorker = 4;
constexpr int kMaxTileRows = 4;  // rows of x per register tile, [n, k] layout
constexpr int kGemvRows = 4;     // [k, n] with more rows than this: the register-tiled GEMM
// GEMM register tile: kTileRows x kTileVecs vectors, 24 accumulators with AVX-512; AVX2: 6 (12 ymm), with
// the tile's weights (2 ymm) and a broadcast beside them.
constexpr int kTileRows = kWideRegisters ? 8 : 6;
constexpr int kTileVecs = kWideRegisters ? 3 : 1;
constexpr int kBlockK = 32;      // weight rows per GEMM block (measured: 16 and 64 slower)
constexpr int kMaxGemmRows = 64; // [n, k] GEMM: at most 4 vectors of rows of x
// The next GEMM block is prefetched only when it is this small. Larger ones (SmolLM2's gate|up, 32 rows
// of 3072 columns: 384 KB) measured faster without: a decode step at 32 rows 70-74 -> 67-69 ms. Prefetching
// every next block front to back instead (a slice per column tile) measured slower still: 65 -> 71-76 ms.
constexpr int64_t kMaxPrefetchBlockBytes = 256 << 10;

template <typename T>  // the weights' element: float, or bf16_t (a bfloat16 model's, widened as read)
struct Problem {
  const float* x;  // [m, k]
  const T* w;      // [k, n] or [n, k]
  float* y;        // [m, n]
  int64_t m, k, n;
};

// ---- [k, n]: y_partial[r, :] += sum_{kk in [k0, k1)} x[r, kk] * w[kk, :]
template <typename T>
void kn_rows_chunk(const Problem<T>& p, int64_t k0, int64_t k1, float* part) {
  const int64_t n = p.n, nv = n / kLanes * kLanes;
  for (int64_t kk = k0; kk < k1; kk += 4) {
    const int64_t rows = std::min<int64_t>(4, k1 - kk);
    const T* w0 = p.w + kk * n;
    for (int64_t r = 0; r < p.m; ++r) {
      const float* xr = p.x + r * p.k + kk;
      float* yr = part + r * n;
      if (rows == 4) {
        const vec a0 = splat(xr[0]), a1 = splat(xr[1]), a2 = splat(xr[2]), a3 = splat(xr[3]);
        for (int64_t j = 0; j < nv; j += kLanes) {
          vec acc = load(yr + j);
          acc += a0 * load_as_float(w0 + j) + a1 * load_as_float(w0 + n + j);
          acc += a2 * load_as_float(w0 + 2 * n + j) + a3 * load_as_float(w0 + 3 * n + j);
          store(yr + j, acc);
        }
        for (int64_t j = nv; j < n; ++j)
          yr[j] += xr[0] * to_float(w0[j]) + xr[1] * to_float(w0[n + j]) + xr[2] * to_float(w0[2 * n + j]) +
                   xr[3] * to_float(w0[3 * n + j]);
      } else {
        for (int64_t q = 0; q < rows; ++q) {
          const vec a = splat(xr[q]);
          const T* wq = w0 + q * n;
          for (int64_t j = 0; j < nv; j += kLanes) store(yr + j, load(yr + j) + a * load_as_float(wq + j));
          for (int64_t j = nv; j < n; ++j) yr[j] += xr[q] * to_float(wq[j]);
        }
      }
    }
  }
}

// ---- [k, n], GEMM: part[r, :] = sum_{kk in [k0, k1)} x[r, kk] * w[kk, :] over blocks of kBlockK rows.
// One register tile: R rows of x from r0 by V vectors of columns from j0, over weight rows [k0, k1);
// starts from zero (`first`) or from the partial. `prefetch`: the same columns kBlockK rows on, into L2.
template <int R, int V, typename T>
inline void gemm_tile(const Problem<T>& p, int64_t r0, int64_t j0, int64_t k0, int64_t k1, float* part, bool first,
                      bool prefetch) {
  vec acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) acc[i][j] = first ? vec{} : load(part + (r0 + i) * p.n + j0 + j * kLanes);
  const float* x0 = p.x + r0 * p.k;
  for (int64_t kk = k0; kk < k1; ++kk) {
    const T* wr = p.w + kk * p.n + j0;
    if (prefetch)
      for (int j = 0; j < V; ++j) __builtin_prefetch(wr + kBlockK * p.n + j * kLanes, 0, 2);
    vec b[V];
    for (int j = 0; j < V; ++j) b[j] = load_as_float(wr + j * kLanes);
    for (int i = 0; i < R; ++i) {
      const vec a = broadcast(x0 + i * p.k + kk);
      for (int j = 0; j < V; ++j) acc[i][j] += a * b[j];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) store(part + (r0 + i) * p.n + j0 + j * kLanes, acc[i][j]);
}

template <int V, typename T>
void gemm_tile_rows(const Problem<T>& p, int64_t r0, int64_t rows, int64_t j0, int64_t k0, int64_t k1, float* part,
                    bool first, bool prefetch) {
  switch (rows) {
    case 1: return gemm_tile<1, V, T>(p, r0, j0, k0, k1, part, first, prefetch);
    case 2: return gemm_tile<2, V, T>(p, r0, j0, k0, k1, part, first, prefetch);
    case 3: return gemm_tile<3, V, T>(p, r0, j0, k0, k1, part, first, prefetch);
    case 4: return gemm_tile<4, V, T>(p, r0, j0, k0, k1, part, first, prefetch);
    case 5: return gemm_tile<5, V, T>(p, r0, j0, k0, k1, part, first, prefetch);
    case 6: return gemm_tile<std::min(6, kTileRows), V, T>(p, r0, j0, k0, k1, part, first, prefetch);
    case 7: return gemm_tile<std::min(7, kTileRows), V, T>(p, r0, j0, k0, k1, part, first, prefetch);
    default: return gemm_tile<kTileRows, V, T>(p, r0, j0, k0, k1, part, first, prefetch);
  }
}

template <typename T>
void kn_gemm_chunk(const Problem<T>& p, int64_t k0, int64_t k1, float* part) {
  const int64_t n = p.n, nv = n / kLanes * kLanes;
  const bool prefetch_blocks = kBlockK * n * int64_t(sizeof(T)) <= kMaxPrefetchBlockBytes;
  for (int64_t kb = k0; kb < k1; kb += kBlockK) {
    const int64_t ke = std::min<int64_t>(k1, kb + kBlockK);
    const bool start = kb == k0, next = ke + kBlockK <= k1;
    for (int64_t j0 = 0; j0 < nv;) {
      const int64_t vecs = std::min<int64_t>(kTileVecs, (nv - j0) / kLanes);
      static_assert(kTileVecs <= 3, "tiles of 1-3 vectors below");
      for (int64_t r0 = 0; r0 < p.m; r0 += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, p.m - r0);
        const bool prefetch = next && r0 == 0 && prefetch_blocks;
        if (vecs == 3) gemm_tile_rows<3>(p, r0, rows, j0, kb, ke, part, start, prefetch);
        else if (vecs == 2) gemm_tile_rows<2>(p, r0, rows, j0, kb, ke, part, start, prefetch);
        else gemm_tile_rows<1>(p, r0, rows, j0, kb, ke, part, start, prefetch);
      }
      j0 += vecs * kLanes;
    }
    for (int64_t r = 0; r < p.m; ++r)  // the last n % kLanes columns
      for (int64_t j = nv; j < n; ++j) {
        float s = start ? 0.f : part[r * n + j];
        for (int64_t kk = kb; kk < ke; ++kk) s += p.x[r * p.k + kk] * to_float(p.w[kk * n + j]);
        part[r * n + j] = s;
      }
  }
}

// ---- [n, k]: y[r, c] = dot(x[r, :], w[c, :]) for R rows from r0 and C weight rows from c0.
template <int R, int C, typename T>
void nk_tile(const Problem<T>& p, int64_t r0, int64_t c0) {
  vec acc[R][C] = {};
  const int64_t kv = p.k / kLanes * kLanes;
  const float* x0 = p.x + r0 * p.k;
  const T* w0 = p.w + c0 * p.k;
  for (int64_t kk = 0; kk < kv; kk += kLanes) {
    vec wv[C];
    for (int c = 0; c < C; ++c) {
      __builtin_prefetch(w0 + (c + 4) * p.k + kk);  // the next tile's rows (measured 26 -> 28 GB/s)
      wv[c] = load_as_float(w0 + c * p.k + kk);
    }
    for (int r = 0; r < R; ++r) {
      const vec a = load(x0 + r * p.k + kk);
      for (int c = 0; c < C; ++c) acc[r][c] += a * wv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t kk = kv; kk < p.k; ++kk) s += x0[r * p.k + kk] * to_float(w0[c * p.k + kk]);
      p.y[(r0 + r) * p.n + c0 + c] = s;
    }
}

template <int C, typename T>
void nk_tile_rows(const Problem<T>& p, int64_t r0, int64_t rows, int64_t c0) {
  switch (rows) {
    case 1: return nk_tile<1, C, T>(p, r0, c0);
    case 2: return nk_tile<2, C, T>(p, r0, c0);
    case 3: return nk_tile<3, C, T>(p, r0, c0);
    case 4: return nk_tile<4, C, T>(p, r0, c0);
    case 5: return nk_tile<5, C, T>(p, r0, c0);
    default: return nk_tile<6, C, T>(p, r0, c0);
  }
}

template <typename T>
void nk_chunk(const Problem<T>& p, int64_t chunk, int64_t rows_per_chunk) {
  const int64_t c1 = std::min<int64_t>(p.n, (chunk + 1) * rows_per_chunk);
  for (int64_t c0 = chunk * rows_per_chunk; c0 < c1; c0 += 4) {
    const int64_t cols = std::min<int64_t>(4, c1 - c0);
    for (int64_t r0 = 0; r0 < p.m; r0 += kMaxTileRows) {
      const int64_t rows = std::min<int64_t>(kMaxTileRows, p.m - r0);
      switch (cols) {
        case 1: nk_tile_rows<1>(p, r0, rows, c0); break;
        case 2: nk_tile_rows<2>(p, r0, rows, c0); break;
        case 3: nk_tile_rows<3>(p, r0, rows, c0); break;
        default: nk_tile_rows<4>(p, r0, rows, c0); break;
      }
    }
  }
}

// ---- [n, k], GEMM: y[r, c] = sum_kk xt[kk, r] * w[c, kk], with x transposed into xt [k, mp] (its rows
// padded with zeros to mp, a whole number of vectors). A register tile is C weight rows (output columns)
// from c0 by the V vectors of rows of x: each weight is broadcast once for V * kLanes rows, and the C
// weight rows, contiguous in memory, are read front to back; the next tile's are prefetched into L2.
template <int C, int V, typename T>
void nk_gemm_tile(const Problem<T>& p, const float* xt, int64_t c0, bool prefetch) {
  constexpr int64_t mp = V * kLanes;
  vec acc[C][V] = {};
  const T* w0 = p.w + c0 * p.k;
  for (int64_t k0 = 0; k0 < p.k; k0 += kLanes) {  // a cache line of each weight row at a time
    if (prefetch)
      for (int c = 0; c < C; ++c) __builtin_prefetch(w0 + (C + c) * p.k + k0, 0, 2);
    const int64_t k1 = std::min<int64_t>(p.k, k0 + kLanes);
    for (int64_t kk = k0; kk < k1; ++kk) {
      vec xv[V];
      for (int v = 0; v < V; ++v) xv[v] = load(xt + kk * mp + v * kLanes);
      for (int c = 0; c < C; ++c) {
        const vec a = broadcast_as_float(w0 + c * p.k + kk);
        for (int v = 0; v < V; ++v) acc[c][v] += a * xv[v];
      }
    }
  }
  float out[C][mp];
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < V; ++v) store(out[c] + v * kLanes, acc[c][v]);
  for (int64_t r = 0; r < p.m; ++r)
    for (int c = 0; c < C; ++c) p.y[r * p.n + c0 + c] = out[c][r];
}

// Columns [c_begin, c_end) of y: tiles of C columns (24 accumulators; AVX2: 4), then single columns.
template <int V, typename T>
void nk_gemm_columns(const Problem<T>& p, const float* xt, int64_t c_begin, int64_t c_end) {
  constexpr int C = std::max(1, (kWideRegisters ? 24 : 4) / V);
  int64_t c0 = c_begin;
  for (; c0 + C <= c_end; c0 += C) nk_gemm_tile<C, V, T>(p, xt, c0, c0 + 2 * C <= c_end);
  for (; c0 < c_end; ++c0) nk_gemm_tile<1, V, T>(p, xt, c0, false);
}

template <typename T>
void nk_gemm_chunk(const Problem<T>& p, const float* xt, int64_t c_begin, int64_t c_end) {
  switch ((p.m + kLanes - 1) / kLanes) {
    case 1:  // one vector of rows would be a broadcast per FMA: measured slower than padding to two
    case 2: return nk_gemm_columns<2, T>(p, xt, c_begin, c_end);
    case 3: return nk_gemm_columns<3, T>(p, xt, c_begin, c_end);
    default: return nk_gemm_columns<4, T>(p, xt, c_begin, c_end);
  }
}

template <typename T>
void matmul(const Problem<T>& p, int32_t w_layout) {
  const int64_t m = p.m, k = p.k, n = p.n;
  Workers& workers = Workers::get();
  const int64_t threads = workers.size() + 1;
  // Chunks of whole groups of 4 weight rows, claimed dynamically (a late worker takes fewer). More chunks
  // cost more in shared counters, partials and restarted streams than they balance.
  const int64_t rows = w_layout == 1 ? n : k;
  const int64_t per_worker = w_layout == 1 ? kNkChunksPerWorker : kKnChunksPerWorker;
  const int64_t per_chunk = std::max<int64_t>(
      16, ((rows + per_worker * threads - 1) / (per_worker * threads) + 3) / 4 * 4);
  const bool gemm = m > kGemvRows;
  if (w_layout == 1 && gemm) {
    // x transposed once, by the caller, into its scratch: [k, m rounded up to whole vectors].
    const int64_t mp = std::max<int64_t>(2, (m + kLanes - 1) / kLanes) * kLanes;
    thread_local std::vector<float> xt_scratch;
    xt_scratch.assign(k * mp, 0.f);
    float* const xt = xt_scratch.data();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t kk = 0; kk < k; ++kk) xt[kk * mp + r] = p.x[r * k + kk];
    // Chunks of whole 24-column groups (a whole number of tiles for every V).
    const int64_t worker_cols = (n + kNkChunksPerWorker * threads - 1) / (kNkChunksPerWorker * threads);
    const int64_t cols = std::max<int64_t>(24, worker_cols / 24 * 24);
    const int64_t nchunks = (n + cols - 1) / cols;
    workers.parallel_for(nchunks, [&](int64_t c, int) {
      nk_gemm_chunk(p, xt, c * cols, std::min(n, (c + 1) * cols));
    });
    return;
  }
  if (w_layout == 1) {
    const int64_t nchunks = (rows + per_chunk - 1) / per_chunk;
    workers.parallel_for(nchunks, [&](int64_t c, int) { nk_chunk(p, c, per_chunk); });
    return;
  }
  // The GEMM: one chunk per worker (measured as fast as two), whole blocks of kBlockK weight rows.
  const int64_t gemm_chunk = std::max<int64_t>(kBlockK, (k + threads - 1) / threads + kBlockK - 1) / kBlockK * kBlockK;
  const int64_t chunk_rows = gemm ? gemm_chunk : per_chunk;
  const int64_t nchunks = (k + chunk_rows - 1) / chunk_rows;
  // Each chunk sums into its own partial: the first into y, the others into the caller's scratch (kept
  // between calls: a fresh 100 KB+ vector per call costs page faults). Adding them up in chunk order
  // makes the result independent of which thread took which chunk: same input, same bits.
  thread_local std::vector<float> scratch;
  if (scratch.size() < size_t((nchunks - 1) * m * n)) scratch.resize((nchunks - 1) * m * n);
  // A pointer, not the name: inside the lambda `scratch` would be the helper thread's own (empty) one.
  float* const out = p.y;
  float* const rest = scratch.data();
  auto partial = [&](int64_t c) { return c == 0 ? out : rest + (c - 1) * m * n; };
  workers.parallel_for(nchunks, [&](int64_t c, int) {
    const int64_t k0 = c * chunk_rows, k1 = std::min(k, (c + 1) * chunk_rows);
    if (gemm) {
      kn_gemm_chunk(p, k0, k1, partial(c));
    } else {
      std::fill(partial(c), partial(c) + m * n, 0.f);
      kn_rows_chunk(p, k0, k1, partial(c));
    }
  });
  for (int64_t c = 1; c < nchunks; ++c) {
    const float* part = partial(c);
    for (int64_t i = 0; i < m * n; ++i) out[i] += part[i];
  }
}

ffi::Error MatmulImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                      int32_t w_layout) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("xlaserve_cpu_matmul: x, w and y must be 2-D");
  if (w.element_type() != ffi::DataType::F32 && w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("xlaserve_cpu_matmul: w must be f32 or bf16");
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = w_layout == 0 ? wd[1] : wd[0];
  if ((w_layout == 0 ? wd[0] : wd[1]) != k || yd[0] != m || yd[1] != n)
    return ffi::Error::InvalidArgument("xlaserve_cpu_matmul: shapes do not agree");
  if (w_layout == 1 && m > kGemvRows && m > kMaxGemmRows)
    return ffi::Error::InvalidArgument("xlaserve_cpu_matmul: too many rows");
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::memset(y->typed_data(), 0, sizeof(float) * m * n);
    return ffi::Error::Success();
  }
  if (w.element_type() == ffi::DataType::F32)
    matmul(Problem<float>{x.typed_data(), static_cast<const float*>(w.untyped_data()), y->typed_data(), m, k, n},
           w_layout);
  else
    matmul(Problem<bf16_t>{x.typed_data(), static_cast<const bf16_t*>(w.untyped_data()), y->typed_data(), m, k,
                           n},
           w_layout);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuMatmul, xlaserve::MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("w_layout"));

// How many 16-lane vectors the register file holds as the library was built (common.h kVecRegisters): 32
// with AVX-512, 8 with AVX2; kernels/cpu/__init__.py picks some row thresholds by it.
extern "C" int XlaserveCpuVectorRegisters() { return xlaserve::kVecRegisters; }

// How many threads every kernel's calls use, the caller's included (common.h requested_threads): the
// library's loader calls it once, before any kernel runs.
extern "C" void XlaserveCpuSetThreads(int num_threads) { xlaserve::requested_threads().store(num_threads); }
