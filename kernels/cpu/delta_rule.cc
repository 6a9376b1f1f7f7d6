// xlaserve CPU gated delta rule decode step (Gated DeltaNet, Qwen3-Next's linear attention; and Kimi Delta
// Attention, KDA: Kimi-Linear's and Ling 3's), in place on the state pool: for every decode row and value
// head, one recurrence step on pool[layer, slot, head] and the head's output.
//
// Why: through XLA, a layer's states go pool -> gathered rows -> updated rows -> scatter back into the pool:
// several passes over states of Dk x Dv floats a head (64 KB at 128 x 128), most of the non-matmul time of a
// decode step. Here each state is read from where it lives and written back once. Math as
// kernels/delta_rule/reference.py:gated_delta_decode, per row and head with state S [Dk, Dv]:
//   S' = exp(g) S;  delta = beta (v - k^T S');  S_new = S' + k (outer) delta;  o = scale q^T S_new
// KDA (reference.py:kda_decode) is the same with a decay per key channel, S' = diag(exp(g)) S: g [D, H, Dk]
// instead of [D, H] selects it. One loop serves both (a template flag: the per-head form keeps its one
// multiply of k^T S by the decay and its decay in a register).
// Column j of S_new depends on column j of S alone (delta[j] = beta (v[j] - sum_i k[i] exp(g[i]) S[i, j])),
// so the state is processed a block of columns at a time: a pass down the block for k^T S' (accumulated in
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

// One row and head's step: its q, k, v, the write strength and the output scale, and its decay, one per head
// (Gated DeltaNet: `decay`) or one per key channel, i.e. per state row (KDA: `decays[i]`, and `k_read` k's
// channels times theirs, the key the old state is read with: k S' = (k exp(g)) S).
struct Step {
  const float *q, *k, *v;
  const float* k_read;  // per channel: k[i] decays[i]; per head: k (the decay applied to k S once)
  const float* decays;  // per channel: exp(g[i]) [Dk]; per head: unused
  float decay;          // per head: exp(g); per channel: unused
  float beta, scale;
};

// One step on the columns [j0, j0 + NV * kLanes) of a head's state (src -> dst, [dk, dv] row-major): the
// output's columns to out[j0 ...]. kPerChannel: a decay per state row (KDA), else one for the head.
template <int NV, bool kPerChannel>
inline void DeltaColumns(const float* src, float* dst, int64_t dk, int64_t dv, int64_t j0, const Step& s,
                         float* out) {
  vec mem[NV];
  for (int u = 0; u < NV; ++u) mem[u] = vec{};
  for (int64_t i = 0; i < dk; ++i) {
    const vec ki = splat(s.k_read[i]);
    const float* in = src + i * dv + j0;
    for (int u = 0; u < NV; ++u) mem[u] += ki * load(in + u * kLanes);
  }
  const vec dec = splat(s.decay), bv = splat(s.beta);
  vec delta[NV], acc[NV];
  for (int u = 0; u < NV; ++u) {
    const vec read = kPerChannel ? mem[u] : dec * mem[u];
    delta[u] = bv * (load(s.v + j0 + u * kLanes) - read);
    acc[u] = vec{};
  }
  for (int64_t i = 0; i < dk; ++i) {
    const vec ki = splat(s.k[i]), qi = splat(s.q[i]);
    const vec di = kPerChannel ? broadcast(s.decays + i) : dec;
    const float* in = src + i * dv + j0;
    float* out_row = dst + i * dv + j0;
    for (int u = 0; u < NV; ++u) {
      const vec next = di * load(in + u * kLanes) + ki * delta[u];
      store(out_row + u * kLanes, next);
      acc[u] += qi * next;
    }
  }
  const vec sv = splat(s.scale);
  for (int u = 0; u < NV; ++u) store(out + j0 + u * kLanes, sv * acc[u]);
}

// The same for the scalar tail: columns [j0, dv).
template <bool kPerChannel>
inline void DeltaTail(const float* src, float* dst, int64_t dk, int64_t dv, int64_t j0, const Step& s,
                      float* out) {
  for (int64_t j = j0; j < dv; ++j) {
    float mem = 0.f;
    for (int64_t i = 0; i < dk; ++i) mem += s.k_read[i] * src[i * dv + j];
    const float delta = s.beta * (s.v[j] - (kPerChannel ? mem : s.decay * mem));
    float acc = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      const float next = (kPerChannel ? s.decays[i] : s.decay) * src[i * dv + j] + s.k[i] * delta;
      dst[i * dv + j] = next;
      acc += s.q[i] * next;
    }
    out[j] = s.scale * acc;
  }
}

// KDA's decays of a row and head, exp(g[i]), and the key its old state is read with, k[i] exp(g[i]).
inline void ChannelDecays(const float* g, const float* k, int64_t dk, float* decays, float* k_read) {
  int64_t i = 0;
  for (; i + kLanes <= dk; i += kLanes) {
    const vec d = exp_vec(load(g + i));
    store(decays + i, d);
    store(k_read + i, d * load(k + i));
  }
  for (; i < dk; ++i) {
    decays[i] = std::exp(g[i]);
    k_read[i] = decays[i] * k[i];
  }
}

// A head's whole state: blocks of 4 vectors of columns, then single vectors, then the scalar tail.
template <bool kPerChannel>
inline void DeltaHead(const float* src, float* dst, int64_t dk, int64_t dv, const Step& s, float* out) {
  constexpr int64_t kBlock = 4 * kLanes;  // columns a block: 8 accumulators, the block's Dk rows in L1/L2
  const int64_t nb = dv / kBlock * kBlock, nv = dv / kLanes * kLanes;
  int64_t j = 0;
  for (; j < nb; j += kBlock) DeltaColumns<4, kPerChannel>(src, dst, dk, dv, j, s, out);
  for (; j < nv; j += kLanes) DeltaColumns<1, kPerChannel>(src, dst, dk, dv, j, s, out);
  DeltaTail<kPerChannel>(src, dst, dk, dv, nv, s, out);
}

ffi::Error DeltaDecodeImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> pool_in,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                           ffi::Buffer<ffi::S32> write_slots, ffi::ResultBuffer<ffi::F32> o,
                           ffi::ResultBuffer<ffi::F32> pool, float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), gd = g.dimensions();
  auto bd = beta.dimensions(), sd = pool->dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || (gd.size() != 2 && gd.size() != 3) ||
      bd.size() != 2 || sd.size() != 5)
    return ffi::Error::InvalidArgument(
        "xlaserve_cpu_delta_decode: bad ranks (want q, k [D, H, Dk], v [D, H, Dv], g [D, H] or [D, H, Dk], "
        "beta [D, H], pool [L, S, H, Dk, Dv])");
  const int64_t rows = qd[0], heads = qd[1], dk = qd[2], dv = vd[2];
  const int64_t num_layers = sd[0], num_slots = sd[1];
  const bool per_channel = gd.size() == 3;  // KDA's decays, one per key channel
  if (kd[0] != rows || kd[1] != heads || kd[2] != dk || vd[0] != rows || vd[1] != heads || gd[0] != rows ||
      gd[1] != heads || (per_channel && gd[2] != dk) || bd[0] != rows || bd[1] != heads)
    return ffi::Error::InvalidArgument(
        "xlaserve_cpu_delta_decode: q, k, v, g and beta do not agree on rows and heads (or q, k, g on Dk)");
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
  const int32_t *rd = slots.typed_data(), *wr = write_slots.typed_data();
  std::vector<int64_t> chain_starts;  // first row of each chain, then `rows`
  for (int64_t r = 0; r < rows; ++r)
    if (r == 0 || rd[r] <= 0 || rd[r] != wr[r - 1]) chain_starts.push_back(r);
  chain_starts.push_back(rows);
  const int64_t chains = static_cast<int64_t>(chain_starts.size()) - 1;
  // Per worker, KDA's decays and decayed key of the row and head it is on ([2, Dk]).
  std::vector<float> scratch(per_channel ? (Workers::get().size() + 1) * 2 * dk : 0);
  Workers::get().parallel_for(chains * heads, [&](int64_t chunk, int worker) {
    const int64_t h = chunk % heads;
    for (int64_t r = chain_starts[chunk / heads]; r < chain_starts[chunk / heads + 1]; ++r) {
      const int64_t src_slot = std::clamp<int64_t>(rd[r], 0, num_slots - 1);
      const int64_t dst_slot = std::clamp<int64_t>(wr[r], 0, num_slots - 1);
      const float* src = states + (src_slot * heads + h) * state;
      float* dst = states + (dst_slot * heads + h) * state;
      const int64_t rh = r * heads + h;
      Step s{qs + rh * dk, ks + rh * dk, vs + rh * dv, ks + rh * dk, nullptr, 1.f, betas[rh], scale};
      float* out = os + rh * dv;
      if (!per_channel) {
        s.decay = std::exp(gs[rh]);
        DeltaHead<false>(src, dst, dk, dv, s, out);
        continue;
      }
      float* decays = scratch.data() + worker * 2 * dk;
      ChannelDecays(gs + rh * dk, s.k, dk, decays, decays + dk);
      s.decays = decays;
      s.k_read = decays + dk;
      DeltaHead<true>(src, dst, dk, dv, s, out);
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
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g: [D, H], or [D, H, Dk] (KDA)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool_in
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots (read)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // write_slots
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // pool, aliased to pool_in
                                  .Attr<float>("scale"));
