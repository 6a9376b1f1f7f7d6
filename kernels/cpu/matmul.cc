// xlaserve CPU matmul for decode-sized row counts: y f32[m, n] = x f32[m, k] @ W, W stored [k, n]
// (w_layout 0: a Linear kernel) or [n, k] (w_layout 1: a tied embedding used as the LM head). Meant for
// a few rows (kernels/cpu/__init__.py sends at most MAX_NATIVE_ROWS), where the product reads memory.
//
// Why: XLA:CPU hands every dot to Eigen, which runs a matrix-vector product of a decode step's 1-7 MB
// weights on one core: about 22 GB/s here, against 30 GB/s that both cores read. Here the product is
// split over every core in chunks that each stream a contiguous stretch of the weights:
//   - [k, n]: chunks of weight rows (the k axis); every worker sums into its own f32[m, n] partial,
//     and the caller adds the partials at the end.
//   - [n, k]: chunks of weight rows (output columns); tiles of up to kMaxTileRows x rows by 4 weight
//     rows, reduced along k at the end.
// Workers claim chunks from an atomic counter, so the caller finishes the job alone if the helpers are
// busy, and a helper that comes late finds no work.
// Portable C++: GCC/Clang vector extensions, compiled for the host's vector width at first use.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(vec)); }
inline vec splat(float a) { return vec{} + a; }
inline float hsum(vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

constexpr int kChunksPerWorker = 4;
constexpr int kMaxTileRows = 4;  // rows of x per register tile, [n, k] layout

struct Problem {
  const float* x;  // [m, k]
  const float* w;  // [k, n] or [n, k]
  float* y;        // [m, n]
  int64_t m, k, n;
};

// ---- [k, n]: y_partial[r, :] += sum_{kk in [k0, k1)} x[r, kk] * w[kk, :]
void kn_rows_chunk(const Problem& p, int64_t k0, int64_t k1, float* part) {
  const int64_t n = p.n, nv = n / kLanes * kLanes;
  for (int64_t kk = k0; kk < k1; kk += 4) {
    const int64_t rows = std::min<int64_t>(4, k1 - kk);
    const float* w0 = p.w + kk * n;
    for (int64_t r = 0; r < p.m; ++r) {
      const float* xr = p.x + r * p.k + kk;
      float* yr = part + r * n;
      if (rows == 4) {
        const vec a0 = splat(xr[0]), a1 = splat(xr[1]), a2 = splat(xr[2]), a3 = splat(xr[3]);
        for (int64_t j = 0; j < nv; j += kLanes) {
          vec acc = load(yr + j);
          acc += a0 * load(w0 + j) + a1 * load(w0 + n + j);
          acc += a2 * load(w0 + 2 * n + j) + a3 * load(w0 + 3 * n + j);
          store(yr + j, acc);
        }
        for (int64_t j = nv; j < n; ++j)
          yr[j] += xr[0] * w0[j] + xr[1] * w0[n + j] + xr[2] * w0[2 * n + j] + xr[3] * w0[3 * n + j];
      } else {
        for (int64_t q = 0; q < rows; ++q) {
          const vec a = splat(xr[q]);
          const float* wq = w0 + q * n;
          for (int64_t j = 0; j < nv; j += kLanes) store(yr + j, load(yr + j) + a * load(wq + j));
          for (int64_t j = nv; j < n; ++j) yr[j] += xr[q] * wq[j];
        }
      }
    }
  }
}

// ---- [n, k]: y[r, c] = dot(x[r, :], w[c, :]) for R rows from r0 and C weight rows from c0.
template <int R, int C>
void nk_tile(const Problem& p, int64_t r0, int64_t c0) {
  vec acc[R][C] = {};
  const int64_t kv = p.k / kLanes * kLanes;
  const float* x0 = p.x + r0 * p.k;
  const float* w0 = p.w + c0 * p.k;
  for (int64_t kk = 0; kk < kv; kk += kLanes) {
    vec wv[C];
    for (int c = 0; c < C; ++c) {
      __builtin_prefetch(w0 + (c + 4) * p.k + kk);  // the next tile's rows (measured 26 -> 28 GB/s)
      wv[c] = load(w0 + c * p.k + kk);
    }
    for (int r = 0; r < R; ++r) {
      const vec a = load(x0 + r * p.k + kk);
      for (int c = 0; c < C; ++c) acc[r][c] += a * wv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t kk = kv; kk < p.k; ++kk) s += x0[r * p.k + kk] * w0[c * p.k + kk];
      p.y[(r0 + r) * p.n + c0 + c] = s;
    }
}

template <int C>
void nk_tile_rows(const Problem& p, int64_t r0, int64_t rows, int64_t c0) {
  switch (rows) {
    case 1: return nk_tile<1, C>(p, r0, c0);
    case 2: return nk_tile<2, C>(p, r0, c0);
    case 3: return nk_tile<3, C>(p, r0, c0);
    case 4: return nk_tile<4, C>(p, r0, c0);
    case 5: return nk_tile<5, C>(p, r0, c0);
    default: return nk_tile<6, C>(p, r0, c0);
  }
}

void nk_chunk(const Problem& p, int64_t chunk, int64_t rows_per_chunk) {
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

// ---- parallel driver
enum class Kind { kKnRows, kNk };

struct Job {
  Problem p;
  Kind kind;
  int64_t nchunks, rows_per_chunk;  // weight rows per chunk
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<int> slots{0};
  std::vector<std::vector<float>> partials;  // kKnRows: one f32[m, n] per worker that claimed a chunk

  void work() {
    const int slot = slots.fetch_add(1, std::memory_order_relaxed);
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < nchunks;) {
      switch (kind) {
        case Kind::kKnRows: {
          std::vector<float>& part = partials[slot];
          if (part.empty()) part.assign(p.m * p.n, 0.f);
          const int64_t k0 = c * rows_per_chunk;
          kn_rows_chunk(p, k0, std::min(p.k, k0 + rows_per_chunk), part.data());
          break;
        }
        case Kind::kNk: nk_chunk(p, c, rows_per_chunk); break;
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Helper threads of our own: a decode step issues a matmul every 50-300 us, and waking a parked
// thread of XLA's pool for each one cost more than the second core saved. Ours spin briefly between
// jobs (yielding the core to anything runnable), then sleep until the next one.
class Workers {
 public:
  static Workers& get() {
    static Workers* workers = new Workers();  // never destroyed: threads outlive static destructors
    return *workers;
  }
  int size() const { return static_cast<int>(threads_.size()); }

  // Runs `job` on the calling thread and every helper; returns when all its chunks are done. One job
  // at a time: a caller that finds the helpers busy runs its job alone.
  void run(const std::shared_ptr<Job>& job) {
    std::unique_lock<std::mutex> busy(submit_mu_, std::try_to_lock);
    if (!busy.owns_lock() || threads_.empty()) {
      job->work();
      return;
    }
    std::atomic_store(&current_, job);
    {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      generation_.fetch_add(1);
    }
    sleep_cv_.notify_all();
    job->work();
    while (job->done.load(std::memory_order_acquire) < job->nchunks) cpu_relax();
    std::atomic_store(&current_, std::shared_ptr<Job>());
  }

 private:
  Workers() {
    int count = static_cast<int>(std::thread::hardware_concurrency()) - 1;
    if (const char* env = std::getenv("XLASERVE_CPU_THREADS")) count = std::atoi(env) - 1;
    for (int i = 0; i < count; ++i) threads_.emplace_back([this] { loop(); });
    for (auto& t : threads_) t.detach();
  }

  void loop() {
    uint64_t seen = generation_.load();
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        if (spins < 2000) {
          cpu_relax();
          continue;
        }
        if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(kSpinMicros)) {
          std::this_thread::yield();
          continue;
        }
        std::unique_lock<std::mutex> lock(sleep_mu_);
        sleep_cv_.wait(lock, [&] { return generation_.load() != seen; });
      }
      seen = generation_.load();
      if (std::shared_ptr<Job> job = std::atomic_load(&current_)) job->work();
    }
  }

  static constexpr int kSpinMicros = 300;
  std::vector<std::thread> threads_;
  std::mutex submit_mu_, sleep_mu_;
  std::condition_variable sleep_cv_;
  std::atomic<uint64_t> generation_{0};
  std::shared_ptr<Job> current_;
};

ffi::Error MatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y,
                      int32_t w_layout) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("xlaserve_cpu_matmul: x, w and y must be 2-D");
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = w_layout == 0 ? wd[1] : wd[0];
  if ((w_layout == 0 ? wd[0] : wd[1]) != k || yd[0] != m || yd[1] != n)
    return ffi::Error::InvalidArgument("xlaserve_cpu_matmul: shapes do not agree");
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::memset(y->typed_data(), 0, sizeof(float) * m * n);
    return ffi::Error::Success();
  }

  Workers& workers = Workers::get();
  const int64_t threads = workers.size() + 1;
  auto job = std::make_shared<Job>();
  job->p = Problem{x.typed_data(), w.typed_data(), y->typed_data(), m, k, n};
  // A few chunks per worker (claimed dynamically, so a slow worker takes fewer), whole groups of 4
  // weight rows each; more chunks would cost more in the shared counters than they balance.
  auto rows_per_chunk = [&](int64_t rows) {
    return std::max<int64_t>(16, ((rows + kChunksPerWorker * threads - 1) / (kChunksPerWorker * threads) + 3) / 4 * 4);
  };
  if (w_layout == 1) {
    job->kind = Kind::kNk;
    job->rows_per_chunk = rows_per_chunk(n);
    job->nchunks = (n + job->rows_per_chunk - 1) / job->rows_per_chunk;
  } else {
    job->kind = Kind::kKnRows;
    job->rows_per_chunk = rows_per_chunk(k);
    job->nchunks = (k + job->rows_per_chunk - 1) / job->rows_per_chunk;
  }
  job->partials.resize(threads);
  workers.run(job);

  if (job->kind == Kind::kKnRows) {
    float* out = y->typed_data();
    bool first = true;
    for (const auto& part : job->partials) {
      if (part.empty()) continue;
      if (first) std::memcpy(out, part.data(), sizeof(float) * m * n);
      else for (int64_t i = 0; i < m * n; ++i) out[i] += part[i];
      first = false;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("w_layout"));
