// xlaserve CPU gated delta rule decode step (Gated DeltaNet, Qwen3-Next's linear attention), in place on the
// state pool: for every decode row and value head, one recurrence step on pool[layer, slot, head] and the
// head's output.
//
// Why: through XLA, a layer's states go pool -> gathered rows -> updated rows -> scatter back into the pool:
// several passes over states of Dk x Dv floats a head (64 KB at 128 x 128), most of the non-matmul time of a
// decode step. Here each state is read from where it lives and written back once. Math as
// kernels/delta_rule/reference.py:gated_delta_decode, per row and head with state S [Dk, Dv]:
//   S' = exp(g) S;  delta = beta (v - k^T S');  S_new = S' + k (outer) delta;  o = scale q^T S_new
// Column j of S_new depends on column j of S alone (delta[j] = beta (v[j] - exp(g) sum_i k[i] S[i, j])), so
// the state is processed a block of columns at a time: a pass down the block for k^T S (accumulated in
// registers), then a second pass, while the block is still in cache, that writes S_new and accumulates q^T
// S_new. Every element is read before it is written (the second pass reads and writes the same element), so
// a row may write the slot it reads.
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

// One step on the columns [j0, j0 + NV * kLanes) of a head's state (src -> dst, [dk, dv] row-major): the
// output's columns to out[j0 ...].
template <int NV>
inline void DeltaColumns(const float* src, float* dst, int64_t dk, int64_t dv, int64_t j0, const float* kv,
                         const float* qv, const float* vv, float decay, float beta, float scale, float* out) {
  vec mem[NV];
  for (int u = 0; u < NV; ++u) mem[u] = vec{};
  for (int64_t i = 0; i < dk; ++i) {
    const vec ki = splat(kv[i]);
    const float* in = src + i * dv + j0;
    for (int u = 0; u < NV; ++u) mem[u] += ki * load(in + u * kLanes);
  }
  const vec dec = splat(decay), bv = splat(beta);
  vec delta[NV], acc[NV];
  for (int u = 0; u < NV; ++u) {
    delta[u] = bv * (load(vv + j0 + u * kLanes) - dec * mem[u]);
    acc[u] = vec{};
  }
  for (int64_t i = 0; i < dk; ++i) {
    const vec ki = splat(kv[i]), qi = splat(qv[i]);
    const float* in = src + i * dv + j0;
    float* out_row = dst + i * dv + j0;
    for (int u = 0; u < NV; ++u) {
      const vec next = dec * load(in + u * kLanes) + ki * delta[u];
      store(out_row + u * kLanes, next);
      acc[u] += qi * next;
    }
  }
  const vec sv = splat(scale);
  for (int u = 0; u < NV; ++u) store(out + j0 + u * kLanes, sv * acc[u]);
}

// The same for the scalar tail: columns [j0, dv).
inline void DeltaTail(const float* src, float* dst, int64_t dk, int64_t dv, int64_t j0, const float* kv,
                      const float* qv, const float* vv, float decay, float beta, float scale, float* out) {
  for (int64_t j = j0; j < dv; ++j) {
    float mem = 0.f;
    for (int64_t i = 0; i < dk; ++i) mem += kv[i] * src[i * dv + j];
    const float delta = beta * (vv[j] - decay * mem);
    float acc = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      const float next = decay * src[i * dv + j] + kv[i] * delta;
      dst[i * dv + j] = next;
      acc += qv[i] * next;
    }
    out[j] = scale * acc;
  }
}

ffi::Error DeltaDecodeImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> pool_in,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                           ffi::Buffer<ffi::S32> write_slots, ffi::ResultBuffer<ffi::F32> o,
                           ffi::ResultBuffer<ffi::F32> pool, float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), gd = g.dimensions();
  auto bd = beta.dimensions(), sd = pool->dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || gd.size() != 2 || bd.size() != 2 || sd.size() != 5)
    return ffi::Error::InvalidArgument(
        "xlaserve_cpu_delta_decode: bad ranks (want q, k [D, H, Dk], v [D, H, Dv], g, beta [D, H], "
        "pool [L, S, H, Dk, Dv])");
  const int64_t rows = qd[0], heads = qd[1], dk = qd[2], dv = vd[2];
  const int64_t num_layers = sd[0], num_slots = sd[1];
  if (kd[0] != rows || kd[1] != heads || kd[2] != dk || vd[0] != rows || vd[1] != heads || gd[0] != rows ||
      gd[1] != heads || bd[0] != rows || bd[1] != heads)
    return ffi::Error::InvalidArgument(
        "xlaserve_cpu_delta_decode: q, k, v, g and beta do not agree on rows and heads (or q and k on Dk)");
  if (sd[2] != heads || sd[3] != dk || sd[4] != dv || num_layers < 1 || num_slots < 1)
    return ffi::Error::InvalidArgument("xlaserve_cpu_delta_decode: the pool is not [L, S, H, Dk, Dv]");
  if (layer.element_count() < 1 || static_cast<int64_t>(slots.element_count()) != rows ||
      static_cast<int64_t>(write_slots.element_count()) != rows)
    return ffi::Error::InvalidArgument(
        "xlaserve_cpu_delta_decode: want one layer index and one read and one write slot per row");
  if (pool_in.typed_data() != pool->typed_data())  // aliased by the caller; should XLA not, stay correct
    std::memcpy(pool->typed_data(), pool_in.typed_data(), sizeof(float) * pool_in.element_count());
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, num_layers - 1);
  const int64_t state = dk * dv;
  float* states = pool->typed_data() + l * num_slots * heads * state;
  const float *qs = q.typed_data(), *ks = k.typed_data(), *vs = v.typed_data();
  const float *gs = g.typed_data(), *betas = beta.typed_data();
  float* os = o->typed_data();
  constexpr int64_t kBlock = 4 * kLanes;  // columns a block: 8 accumulators, the block's Dk rows in L1/L2
  const int64_t nb = dv / kBlock * kBlock, nv = dv / kLanes * kLanes;
  const int32_t *rd = slots.typed_data(), *wr = write_slots.typed_data();
  std::vector<int64_t> chain_starts;  // first row of each chain, then `rows`
  for (int64_t r = 0; r < rows; ++r)
    if (r == 0 || rd[r] <= 0 || rd[r] != wr[r - 1]) chain_starts.push_back(r);
  chain_starts.push_back(rows);
  const int64_t chains = static_cast<int64_t>(chain_starts.size()) - 1;
  Workers::get().parallel_for(chains * heads, [&](int64_t chunk, int) {
    const int64_t h = chunk % heads;
    for (int64_t r = chain_starts[chunk / heads]; r < chain_starts[chunk / heads + 1]; ++r) {
      const int64_t src_slot = std::clamp<int64_t>(rd[r], 0, num_slots - 1);
      const int64_t dst_slot = std::clamp<int64_t>(wr[r], 0, num_slots - 1);
      const float* src = states + (src_slot * heads + h) * state;
      float* dst = states + (dst_slot * heads + h) * state;
      const int64_t rh = r * heads + h;
      const float decay = std::exp(gs[rh]), b = betas[rh];
      const float *kv = ks + rh * dk, *qv = qs + rh * dk, *vv = vs + rh * dv;
      float* out = os + rh * dv;
      int64_t j = 0;
      for (; j < nb; j += kBlock) DeltaColumns<4>(src, dst, dk, dv, j, kv, qv, vv, decay, b, scale, out);
      for (; j < nv; j += kLanes) DeltaColumns<1>(src, dst, dk, dv, j, kv, qv, vv, decay, b, scale, out);
      DeltaTail(src, dst, dk, dv, nv, kv, qv, vv, decay, b, scale, out);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuDeltaDecode, xlaserve::DeltaDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool_in
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots (read)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // write_slots
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // pool, aliased to pool_in
                                  .Attr<float>("scale"));
