// xlaserve CPU row reductions for sampling, over f32[B, V] logits (V: the vocabulary):
//   - argmax: i32[B], the index of each row's maximum, the first one on ties; 0 for a row with a NaN
//     (kernels/sampling/reference.argmax_first);
//   - logsumexp: f32[B], log(sum(exp(x))) of each row (jax.nn.logsumexp): the sampled token's logprob
//     is its logit minus this, with no [B, V] log_softmax written out.
//
// Why: XLA:CPU runs these as several passes that each write a [B, V] temporary (x - max, the select of
// the maximum's indices, exp): about 8 ms of a 32-row SmolLM2 decode step (49152 tokens) against under
// 1 ms here, one chunk of work per row, reading the row once for argmax and twice (max, then the sum of
// exponentials; a row is 192 KB, so the second read comes from L2) for logsumexp.

#include <cmath>
#include <limits>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

inline ivec lane_ids() {
  ivec ids;
  for (int i = 0; i < kLanes; ++i) ids[i] = i;
  return ids;
}

int32_t argmax_row(const float* x, int64_t v) {
  const int64_t vv = v / kLanes * kLanes;
  float best_value = -std::numeric_limits<float>::infinity();
  int64_t best = 0;
  bool nan = false;
  if (vv > 0) {
    // Per lane: the first index of that lane's maximum (strictly greater replaces).
    vec lane_best = load(x);
    const ivec lanes = lane_ids();
    ivec lane_index = lanes;
    ivec any_nan = lane_best != lane_best;
    for (int64_t j = kLanes; j < vv; j += kLanes) {
      const vec a = load(x + j);
      const ivec greater = a > lane_best;
      lane_best = select(greater, a, lane_best);
      lane_index = select(greater, lanes + static_cast<int32_t>(j), lane_index);
      any_nan |= a != a;
    }
    best_value = lane_best[0];
    for (int i = 1; i < kLanes; ++i) best_value = std::max(best_value, lane_best[i]);
    best = v;
    for (int i = 0; i < kLanes; ++i)
      if (lane_best[i] == best_value) best = std::min<int64_t>(best, lane_index[i]);
    for (int i = 0; i < kLanes; ++i) nan |= any_nan[i] != 0;
  }
  for (int64_t j = vv; j < v; ++j) {  // the tail's indices are all larger: only a strictly greater wins
    nan |= std::isnan(x[j]);
    if (x[j] > best_value || (vv == 0 && j == 0)) {
      best_value = x[j];
      best = j;
    }
  }
  return nan ? 0 : static_cast<int32_t>(best);
}

float logsumexp_row(const float* x, int64_t v) {
  const int64_t vv = v / kLanes * kLanes;
  float peak = -std::numeric_limits<float>::infinity();
  if (vv > 0) {
    vec m = load(x);
    for (int64_t j = kLanes; j < vv; j += kLanes) {
      const vec a = load(x + j);
      m = select(a > m, a, m);
    }
    for (int i = 0; i < kLanes; ++i) peak = std::max(peak, m[i]);
  }
  for (int64_t j = vv; j < v; ++j) peak = std::max(peak, x[j]);
  if (std::isinf(peak)) return peak;  // all -inf: -inf; any +inf: +inf (as jax.nn.logsumexp)
  vec sum = {};
  const vec shift = splat(peak);
  for (int64_t j = 0; j < vv; j += kLanes) sum += exp_vec(load(x + j) - shift);
  float total = hsum(sum);
  for (int64_t j = vv; j < v; ++j) total += std::exp(x[j] - peak);
  return peak + std::log(total);  // a NaN in the row reaches the sum, and the result
}

template <ffi::DataType T, typename RowFn>
ffi::Error ByRow(const char* name, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<T> y, RowFn row) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 1 || yd[0] != xd[0])
    return ffi::Error::InvalidArgument(std::string(name) + ": x must be [B, V] and the result [B]");
  const int64_t rows = xd[0], v = xd[1];
  if (v == 0) return ffi::Error::InvalidArgument(std::string(name) + ": an empty row");
  const float* data = x.typed_data();
  auto* out = y->typed_data();
  Workers::get().parallel_for(rows, [&](int64_t r, int) { out[r] = row(data + r * v, v); });
  return ffi::Error::Success();
}

ffi::Error ArgmaxImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> y) {
  return ByRow("xlaserve_cpu_argmax", x, y, argmax_row);
}

ffi::Error LogsumexpImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  return ByRow("xlaserve_cpu_logsumexp", x, y, logsumexp_row);
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuArgmax, xlaserve::ArgmaxImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuLogsumexp, xlaserve::LogsumexpImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
