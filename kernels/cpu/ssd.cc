// xlaserve CPU SSD decode step, in place on the state pool: for every decode row and head, one Mamba-2
// recurrence step on pool[layer, slot] and the head's output.
//
// Why: through XLA, a layer's states go pool -> gathered rows -> updated rows -> scatter back into the
// pool (with a dummy row concatenated when the step has one row): several passes over 786 KB a layer for
// the mamba2-130m shape at batch 1, most of the non-matmul time of a decode step. Here each state is
// read once and written once, where it lives. Math as kernels/ssd/reference.py:ssd_decode:
//   decay = exp(dt * A[h]);  S' = decay * S + dt * x (outer) B;  y = S' . C   (no D skip, no gate)
// Row r reads its state from slot read[r] and writes it to slot write[r]. A row that reads the slot the row
// before writes continues that row's state (speculative draft rows, kernels/chains.py): such a chain of rows
// runs in order on one thread; chains and heads are spread over the threads.

#include <cmath>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

ffi::Error SsdDecodeImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dt, ffi::Buffer<ffi::F32> a,
                         ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> c, ffi::Buffer<ffi::F32> pool_in,
                         ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                         ffi::Buffer<ffi::S32> write_slots, ffi::ResultBuffer<ffi::F32> y,
                         ffi::ResultBuffer<ffi::F32> pool) {
  auto xd = x.dimensions(), bd = b.dimensions(), sd = pool->dimensions();
  if (xd.size() != 3 || bd.size() != 3 || sd.size() != 5)
    return ffi::Error::InvalidArgument("xlaserve_cpu_ssd_decode: bad ranks");
  const int64_t rows = xd[0], heads = xd[1], p = xd[2], groups = bd[1], n = bd[2];
  const int64_t num_layers = sd[0], num_slots = sd[1];
  if (sd[2] != heads || sd[3] != p || sd[4] != n || heads % groups != 0 || slots.element_count() != rows ||
      write_slots.element_count() != rows)
    return ffi::Error::InvalidArgument("xlaserve_cpu_ssd_decode: shapes do not agree");
  if (pool_in.typed_data() != pool->typed_data())  // aliased by the caller; should XLA not, stay correct
    std::memcpy(pool->typed_data(), pool_in.typed_data(), sizeof(float) * pool_in.element_count());
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, num_layers - 1);
  const int64_t per_group = heads / groups, state = p * n;
  float* states = pool->typed_data() + l * num_slots * heads * state;
  const float *xs = x.typed_data(), *dts = dt.typed_data(), *as = a.typed_data();
  const float *bs = b.typed_data(), *cs = c.typed_data();
  float* ys = y->typed_data();
  const int64_t nv = n / kLanes * kLanes;
  const int32_t *rd = slots.typed_data(), *wr = write_slots.typed_data();
  std::vector<int64_t> chain_starts;  // first row of each chain, then `rows`
  for (int64_t r = 0; r < rows; ++r)
    if (r == 0 || rd[r] <= 0 || rd[r] != wr[r - 1]) chain_starts.push_back(r);
  chain_starts.push_back(rows);
  const int64_t chains = static_cast<int64_t>(chain_starts.size()) - 1;
  Workers::get().parallel_for(chains * heads, [&](int64_t chunk, int) {
    const int64_t h = chunk % heads, g = h / per_group;
    for (int64_t r = chain_starts[chunk / heads]; r < chain_starts[chunk / heads + 1]; ++r) {
      const int64_t src_slot = std::clamp<int64_t>(rd[r], 0, num_slots - 1);
      const int64_t dst_slot = std::clamp<int64_t>(wr[r], 0, num_slots - 1);
      const float* src = states + (src_slot * heads + h) * state;
      float* dst = states + (dst_slot * heads + h) * state;
      const float step = dts[r * heads + h], decay = std::exp(step * as[h]);
      const float* bv = bs + (r * groups + g) * n;
      const float* cv = cs + (r * groups + g) * n;
      const float* xv = xs + (r * heads + h) * p;
      float* yv = ys + (r * heads + h) * p;
      const vec dv = splat(decay);
      for (int64_t i = 0; i < p; ++i) {
        const float* in = src + i * n;
        float* out_row = dst + i * n;
        const float u = step * xv[i];
        const vec uv = splat(u);
        vec acc = {};
        for (int64_t j = 0; j < nv; j += kLanes) {
          const vec next = dv * load(in + j) + uv * load(bv + j);
          store(out_row + j, next);
          acc += next * load(cv + j);
        }
        float out = hsum(acc);
        for (int64_t j = nv; j < n; ++j) {
          const float next = decay * in[j] + u * bv[j];
          out_row[j] = next;
          out += next * cv[j];
        }
        yv[i] = out;
      }
    }
  });
  return ffi::Error::Success();
}

// Causal depthwise conv decode step in place on the conv-state pool: for row r, channel c, with
// window = [state[slot_r, c, :], x[r, c]]: u[r, c] = sum_k window[k] * w[c, k] (+ bias[c]), and the state
// becomes window[1:]. As kernels/conv1d/reference.py:causal_conv1d_decode. Row r reads slot read[r] and writes
// slot write[r] (rows run in order, so a chained row sees the state the row before it wrote).
ffi::Error ConvDecodeImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> bias,
                          ffi::Buffer<ffi::F32> pool_in, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                          ffi::Buffer<ffi::S32> write_slots, ffi::ResultBuffer<ffi::F32> u,
                          ffi::ResultBuffer<ffi::F32> pool) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = pool->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 4)
    return ffi::Error::InvalidArgument("xlaserve_cpu_conv_decode: bad ranks");
  const int64_t rows = xd[0], channels = xd[1], k = wd[1], num_layers = sd[0], num_slots = sd[1];
  if (wd[0] != channels || sd[2] != channels || sd[3] != k - 1 || k < 2 || slots.element_count() != rows ||
      write_slots.element_count() != rows ||
      (bias.element_count() != channels && bias.element_count() != 0))
    return ffi::Error::InvalidArgument("xlaserve_cpu_conv_decode: shapes do not agree");
  if (pool_in.typed_data() != pool->typed_data())
    std::memcpy(pool->typed_data(), pool_in.typed_data(), sizeof(float) * pool_in.element_count());
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, num_layers - 1);
  float* states = pool->typed_data() + l * num_slots * channels * (k - 1);
  const float *xs = x.typed_data(), *ws = w.typed_data(), *bs = bias.typed_data();
  const bool has_bias = bias.element_count() == channels;
  for (int64_t r = 0; r < rows; ++r) {  // a few KB per row: not worth a thread
    const int64_t src_slot = std::clamp<int64_t>(slots.typed_data()[r], 0, num_slots - 1);
    const int64_t dst_slot = std::clamp<int64_t>(write_slots.typed_data()[r], 0, num_slots - 1);
    const float* src = states + src_slot * channels * (k - 1);
    float* dst = states + dst_slot * channels * (k - 1);
    for (int64_t c = 0; c < channels; ++c) {
      const float* sc = src + c * (k - 1);
      float* dc = dst + c * (k - 1);
      const float* wc = ws + c * k;
      const float xc = xs[r * channels + c];
      float acc = has_bias ? bs[c] : 0.f;
      for (int64_t j = 0; j < k - 1; ++j) acc += sc[j] * wc[j];
      acc += xc * wc[k - 1];
      for (int64_t j = 0; j + 1 < k - 1; ++j) dc[j] = sc[j + 1];  // forward: safe when src == dst
      dc[k - 2] = xc;
      u->typed_data()[r * channels + c] = acc;
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuConvDecode, xlaserve::ConvDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuSsdDecode, xlaserve::SsdDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
