// Shared by the native CPU kernels (one library, kernels/cpu/*.cc): vector helpers, and the helper
// threads that split a kernel's work into chunks.
#ifndef XLASERVE_KERNELS_CPU_COMMON_H_
#define XLASERVE_KERNELS_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace xlaserve {

constexpr int kLanes = 16;
#if defined(__AVX2__) && !defined(__AVX512F__)
#define XLASERVE_SPLIT_VEC 1
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// A vector of kLanes lanes as two halves of 8, one ymm register each. GCC has no register for a 64-byte
// generic vector on a target without AVX-512: it keeps every one in memory, so each accumulator of a
// register tile costs a store and a load per use (and the halves' stores fail to forward to the wide
// loads). The kernels, written for 16 lanes, ran 3-20x slower on AVX2 than with these (AMD Zen 3:
// docs/benchmarks.md "Without AVX-512"). The operators are GCC's vector operators, half by half.
template <typename H, typename E>
struct Halves {
  H lo, hi;
  E operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
  E& operator[](int i) { return i < 8 ? lo[i] : hi[i - 8]; }  // GCC's vector subscript: an lvalue
};
#define XLASERVE_HALVES_OP(op)                                                                             \
  template <typename H, typename E>                                                                          \
  inline auto operator op(Halves<H, E> a, Halves<H, E> b) {                                                  \
    typedef decltype(a.lo op b.lo) R;                                                                        \
    return Halves<R, decltype(R{}[0] + 0)>{a.lo op b.lo, a.hi op b.hi};                                      \
  }                                                                                                          \
  template <typename H, typename E>                                                                          \
  inline Halves<H, E> operator op(Halves<H, E> a, E b) {                                                     \
    return {a.lo op b, a.hi op b};                                                                           \
  }                                                                                                          \
  template <typename H, typename E>                                                                          \
  inline Halves<H, E> operator op(E a, Halves<H, E> b) {                                                     \
    return {a op b.lo, a op b.hi};                                                                           \
  }
XLASERVE_HALVES_OP(+)
XLASERVE_HALVES_OP(-)
XLASERVE_HALVES_OP(*)
XLASERVE_HALVES_OP(/)
XLASERVE_HALVES_OP(&)
XLASERVE_HALVES_OP(|)
XLASERVE_HALVES_OP(^)
XLASERVE_HALVES_OP(<)
XLASERVE_HALVES_OP(>)
XLASERVE_HALVES_OP(<=)
XLASERVE_HALVES_OP(>=)
XLASERVE_HALVES_OP(==)
XLASERVE_HALVES_OP(!=)
#undef XLASERVE_HALVES_OP
#define XLASERVE_HALVES_ASSIGN(op)                                                                     \
  template <typename H, typename E>                                                                      \
  inline Halves<H, E>& operator op##=(Halves<H, E>& a, Halves<H, E> b) {                                 \
    a.lo op## = b.lo;                                                                                    \
    a.hi op## = b.hi;                                                                                    \
    return a;                                                                                            \
  }                                                                                                      \
  template <typename H, typename E>                                                                      \
  inline Halves<H, E>& operator op##=(Halves<H, E>& a, E b) {                                            \
    a.lo op## = b;                                                                                       \
    a.hi op## = b;                                                                                       \
    return a;                                                                                            \
  }
XLASERVE_HALVES_ASSIGN(+)
XLASERVE_HALVES_ASSIGN(-)
XLASERVE_HALVES_ASSIGN(*)
XLASERVE_HALVES_ASSIGN(/)
XLASERVE_HALVES_ASSIGN(&)
XLASERVE_HALVES_ASSIGN(|)
#undef XLASERVE_HALVES_ASSIGN
template <typename H, typename E>
inline Halves<H, E> operator-(Halves<H, E> a) { return {-a.lo, -a.hi}; }
template <typename H, typename E>
inline Halves<H, E> operator~(Halves<H, E> a) { return {~a.lo, ~a.hi}; }
template <typename H, typename E>
inline Halves<H, E> operator<<(Halves<H, E> a, int n) { return {a.lo << n, a.hi << n}; }
template <typename H, typename E>
inline Halves<H, E> operator>>(Halves<H, E> a, int n) { return {a.lo >> n, a.hi >> n}; }

typedef Halves<f32x8, float> vec;
typedef Halves<i32x8, int32_t> ivec;
typedef Halves<u32x8, uint32_t> uvec;
// Lane by lane: a where `mask` (a comparison's result) is set, else b.
inline vec select(ivec mask, vec a, vec b) { return {mask.lo ? a.lo : b.lo, mask.hi ? a.hi : b.hi}; }
inline ivec select(ivec mask, ivec a, ivec b) { return {mask.lo ? a.lo : b.lo, mask.hi ? a.hi : b.hi}; }
inline vec to_vec(ivec v) { return {__builtin_convertvector(v.lo, f32x8), __builtin_convertvector(v.hi, f32x8)}; }
inline ivec to_ivec(vec v) { return {__builtin_convertvector(v.lo, i32x8), __builtin_convertvector(v.hi, i32x8)}; }
#else
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t uvec __attribute__((vector_size(kLanes * sizeof(uint32_t))));
inline vec select(ivec mask, vec a, vec b) { return mask ? a : b; }
inline ivec select(ivec mask, ivec a, ivec b) { return mask ? a : b; }
inline vec to_vec(ivec v) { return __builtin_convertvector(v, vec); }
inline ivec to_ivec(vec v) { return __builtin_convertvector(v, ivec); }
#endif
// How many `vec`s the register file holds: 32 with AVX-512 (one zmm each); 8 with AVX2 (16 ymm, two halves
// each); 4 otherwise (16 xmm). Register tiles are sized from it: a tile written for AVX-512's 32 (24
// accumulators) spills on AVX2.
#if defined(__AVX512F__)
constexpr int kVecRegisters = 32;
#elif defined(__AVX__)
constexpr int kVecRegisters = 8;
#else
constexpr int kVecRegisters = 4;
#endif
constexpr bool kWideRegisters = kVecRegisters >= 32;

#if defined(XLASERVE_SPLIT_VEC)  // half by half: a 64-byte memcpy into the pair went through the stack
inline vec load(const float* p) { return {(f32x8)_mm256_loadu_ps(p), (f32x8)_mm256_loadu_ps(p + 8)}; }
inline void store(float* p, vec v) {
  _mm256_storeu_ps(p, (__m256)v.lo);
  _mm256_storeu_ps(p + 8, (__m256)v.hi);
}
inline vec splat(float a) {
  const f32x8 h = (f32x8)_mm256_set1_ps(a);
  return {h, h};
}
#else
inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(vec)); }
inline vec splat(float a) { return vec{} + a; }
#endif
// Keeps a vector in a register where one load feeds several FMAs: GCC otherwise folds the load into each of
// them as a memory operand (free on Intel; on Zen 4 a 512-bit load takes both load ports, so the loads, not
// the FMAs, bound the loop). qmatmul.cc's 4-row tile: 4.9 -> 3.7 ns a group on one core; prefill
// attention's score loop: 44.1 -> 42.3 ms for 16 x 128 tokens after 1,024 (average of three alternations).
// Taken and returned by value: through a reference into an array of vectors (the earlier form) GCC kept the
// array on the stack and stored every vector there each time round the loop (4 dead 64-byte stores per
// element in prefill attention's `score_rows`, ~6% of its samples each). 16 x 128 tokens after 1,024, 8
// layers, f32 queries, alternated twice on AMD Zen 5 (/tmp script, as bench.kernels' prefill case over 8
// layers): bf16 pools 176.6-185.9 -> 164.5-166.4 ms, f32 pools 181.4-198.0 -> 160.9-163.2; qmatmul.cc's tile
// (no such stores there) unchanged.
inline vec in_register(vec v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#endif
  return v;
}
// splat(*p) as one load-port broadcast: GCC turns splat(*p) into a scalar load plus a register
// broadcast, which on AVX-512 competes with the FMAs for their port (a GEMM tile ran 70 -> 76% of peak).
inline vec broadcast(const float* p) {
#if defined(__AVX512F__)
  return (vec)_mm512_set1_ps(*p);
#else
  return splat(*p);
#endif
}
// A KV pool's element: f32, or bf16 as its 16 bits (a bf16 pool under an f32 model: the upper half of an
// f32's bits, so widening is a shift).
typedef uint16_t bf16_t;
inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
// kLanes consecutive elements as floats.
inline vec load_as_float(const float* p) { return load(p); }
inline vec load_as_float(const bf16_t* p) {
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (vec)_mm512_slli_epi32(wide, 16);
#elif defined(XLASERVE_SPLIT_VEC)
  const __m128i* h = reinterpret_cast<const __m128i*>(p);
  return {(f32x8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h)), 16),
          (f32x8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h + 1)), 16)};
#else
  typedef uint16_t u16vec __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  u16vec h;
  std::memcpy(&h, p, sizeof(h));
  const uvec wide = __builtin_convertvector(h, uvec) << 16;
  vec v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
#endif
}
// *p widened to float in every lane (a load-port broadcast for floats, see `broadcast`).
inline vec broadcast_as_float(const float* p) { return broadcast(p); }
inline vec broadcast_as_float(const bf16_t* p) { return splat(to_float(*p)); }

// XLASERVE_SHUFFLE2(a, b, i_0, ..., i_15): lane j of the result is lane i_j of a (i_j < kLanes) or lane
// i_j - kLanes of b; the indices are constants.
#if defined(XLASERVE_SPLIT_VEC)
// Two halves: through memory (the indices are constants, and the compiler resolves most of it).
inline vec shuffle2(vec a, vec b, const int (&index)[kLanes]) {
  float both[2 * kLanes], out[kLanes];
  std::memcpy(both, &a, sizeof(vec));
  std::memcpy(both + kLanes, &b, sizeof(vec));
  for (int i = 0; i < kLanes; ++i) out[i] = both[index[i]];
  vec v;
  std::memcpy(&v, out, sizeof(vec));
  return v;
}
#define XLASERVE_SHUFFLE2(a, b, ...) ::xlaserve::shuffle2(a, b, {__VA_ARGS__})
#elif defined(__clang__)
#define XLASERVE_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define XLASERVE_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, ::xlaserve::ivec{__VA_ARGS__})
#endif

#if defined(XLASERVE_SPLIT_VEC)
// 8 x 8 floats transposed: r[j] holding element j of every input (lane i).
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}

// Lane i: the sum of t[i]'s 8 lanes.
inline __m256 hsum8x8(const __m256 (&t)[8]) {
  const __m256 h01 = _mm256_hadd_ps(t[0], t[1]), h23 = _mm256_hadd_ps(t[2], t[3]);
  const __m256 h45 = _mm256_hadd_ps(t[4], t[5]), h67 = _mm256_hadd_ps(t[6], t[7]);
  const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);  // 128-bit halves' partial sums
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

// 16 vectors r[i] -> r[j] holding element j of every input vector (lane i), as 32-bit lanes.
inline void transpose16(vec r[kLanes]) {
#if defined(__AVX512F__)
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // lane L: rows 2i, 2i+1 interleaved at columns 4L, 4L+1 / 4L+2, 4L+3
    t[2 * i] = _mm512_unpacklo_ps((__m512)r[2 * i], (__m512)r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps((__m512)r[2 * i], (__m512)r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], 128-bit lane L: column 4L + j of rows 4i .. 4i + 3
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {  // gather the 128-bit lanes of column 4L + j from u[j], u[4 + j], ...
    const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), w0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xdd);
    const __m512 v1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xdd);
    r[j] = (vec)_mm512_shuffle_f32x4(v0, v1, 0x88);
    r[8 + j] = (vec)_mm512_shuffle_f32x4(v0, v1, 0xdd);
    r[4 + j] = (vec)_mm512_shuffle_f32x4(w0, w1, 0x88);
    r[12 + j] = (vec)_mm512_shuffle_f32x4(w0, w1, 0xdd);
  }
#elif defined(XLASERVE_SPLIT_VEC)  // four 8 x 8 blocks of halves, each transposed
  __m256 blocks[4][8];  // rows 0-7 low halves, rows 0-7 high, rows 8-15 low, rows 8-15 high
  for (int i = 0; i < 8; ++i) {
    blocks[0][i] = (__m256)r[i].lo;
    blocks[1][i] = (__m256)r[i].hi;
    blocks[2][i] = (__m256)r[8 + i].lo;
    blocks[3][i] = (__m256)r[8 + i].hi;
  }
  for (auto& block : blocks) transpose8(block);
  for (int j = 0; j < 8; ++j) {
    r[j] = {(f32x8)blocks[0][j], (f32x8)blocks[2][j]};
    r[8 + j] = {(f32x8)blocks[1][j], (f32x8)blocks[3][j]};
  }
#else
  float a[kLanes][kLanes];
  for (int i = 0; i < kLanes; ++i) store(a[i], r[i]);
  for (int j = 0; j < kLanes; ++j)
    for (int i = 0; i < kLanes; ++i) r[j][i] = a[i][j];
#endif
}

// The attention kernels' transposed key tiles (prefill_attention.cc `attend_block`, attention.cc's shared
// spans): keys scored against several query rows as a matrix product, one broadcast of a row's element and one
// FMA per element, row and vector of tokens, no horizontal sums.

// out[e * ld + i] = key i's element e (widened to f32) for i < kLanes and e < d: kLanes keys at base +
// offsets[i], zeros from i = count on; 16 x 16 transposed in registers at a time (where element by element
// took a load, a conversion and a strided store per element). d a multiple of kLanes.
template <typename T>
inline void transpose_keys(const T* base, const int64_t* offsets, int64_t count, int64_t d, float* out,
                           int64_t ld) {
  for (int64_t e0 = 0; e0 < d; e0 += kLanes) {
    vec r[kLanes];
    for (int i = 0; i < kLanes; ++i) r[i] = i < count ? load_as_float(base + offsets[i] + e0) : vec{};
    transpose16(r);
    for (int i = 0; i < kLanes; ++i) store(out + (e0 + i) * ld, r[i]);
  }
}

// out[r * out_ld + c * kLanes, + kLanes) = q[r] . keys[:, c * kLanes, + kLanes) for NR query rows (d apart) and
// CV vectors of tokens, keys transposed ([d, keys_ld], as `transpose_keys` lays them out).
template <int NR, int CV>
inline void score_transposed(const float* q, const float* keys, int64_t keys_ld, int64_t d, float* out,
                             int64_t out_ld) {
  vec acc[NR][CV] = {};
  for (int64_t e = 0; e < d; ++e) {
    vec kv[CV];
    for (int c = 0; c < CV; ++c) kv[c] = in_register(load(keys + e * keys_ld + c * kLanes));
    for (int r = 0; r < NR; ++r) {
      const vec qb = broadcast(q + r * d + e);
      for (int c = 0; c < CV; ++c) acc[r][c] += qb * kv[c];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < CV; ++c) store(out + r * out_ld + c * kLanes, acc[r][c]);
}

#if defined(XLASERVE_SPLIT_VEC)
// The sum of an 8-lane vector's lanes.
inline float hsum8(__m256 h) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif

inline float hsum(vec v) {  // a tree of halves: a chain of 16 dependent adds cost as much as the dot
#if defined(XLASERVE_SPLIT_VEC)
  return hsum8((__m256)(v.lo + v.hi));
#else
  static_assert(kLanes == 16, "the shuffles below are written for 16 lanes");
  v += XLASERVE_SHUFFLE2(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += XLASERVE_SHUFFLE2(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += XLASERVE_SHUFFLE2(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  v += XLASERVE_SHUFFLE2(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
  return v[0];
#endif
}

inline vec vmax(vec a, vec b) { return select(a > b, a, b); }

inline float hmax(vec v) {  // the largest lane, by a tree of halves as `hsum`
#if defined(XLASERVE_SPLIT_VEC)
  __m256 h = _mm256_max_ps((__m256)v.lo, (__m256)v.hi);
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
#else
  v = vmax(v, XLASERVE_SHUFFLE2(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, XLASERVE_SHUFFLE2(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, XLASERVE_SHUFFLE2(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
  v = vmax(v, XLASERVE_SHUFFLE2(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
  return v[0];
#endif
}

// exp(x) for a vector, to a few ulp (Cephes' expf: x = n ln2 + f, |f| <= ln2/2, a degree-6 polynomial
// for exp(f), times 2^n). Inputs below -87.3 give exp(-87.3) ~ 1e-38 instead of a denormal or 0;
// softmax weights that small vanish next to the maximum's 1 anyway. With AVX-512 the clamps are a max and a
// min and the scaling one `vscalefps` (5 fewer instructions of ~22, the same results): `python -m
// bench.decode_attention --cases gsp,b32,prefill` alternated 3 times (AMD Zen 5), prefill 567-612 -> 561-565
// ms, the decode cases within the noise.
inline vec exp_vec(vec x) {
#if defined(__AVX512F__)  // a max and a min, where the selects below each take a compare and a blend (the
                          // bound first: a NaN, the second operand, passes through as it does there)
  x = (vec)_mm512_min_ps(_mm512_set1_ps(88.3f), _mm512_max_ps(_mm512_set1_ps(-87.3f), (__m512)x));
#else
  x = select(x < splat(-87.3f), splat(-87.3f), x);
  x = select(x > splat(88.3f), splat(88.3f), x);
#endif
  const vec round = splat(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vec n = (x * splat(1.44269504088896341f) + round) - round;
  const vec f = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  vec p = splat(1.9875691500e-4f);
  p = p * f + splat(1.3981999507e-3f);
  p = p * f + splat(8.3334519073e-3f);
  p = p * f + splat(4.1665795894e-2f);
  p = p * f + splat(1.6666665459e-1f);
  p = p * f + splat(5.0000001201e-1f);
  p = p * f * f + f + splat(1.f);
#if defined(__AVX512F__)  // p * 2^n in one instruction (the same product: both scale by a power of two)
  return (vec)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
  const ivec bits = (to_ivec(n) + 127) << 23;  // 2^n as a float's bits
  vec scale;
  std::memcpy(&scale, &bits, sizeof(vec));
  return p * scale;
#endif
}

// One parallel job: `run(chunk, worker)` for every chunk in [0, nchunks), chunks claimed from an atomic
// counter by the caller and the helpers alike. `worker` (0 .. Workers::size()) tells a worker's own
// scratch apart. A helper that comes late finds no chunk left and never calls `run`, so `run` may
// refer to the caller's stack: the caller returns only after every claimed chunk is done.
struct Job {
  std::function<void(int64_t chunk, int worker)> run;
  int64_t nchunks = 0;
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<int> workers{0};

  void work() {
    const int worker = workers.fetch_add(1, std::memory_order_relaxed);
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < nchunks;) {
      run(c, worker);
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

// Threads a kernel call runs on, the caller's included; 0: one per core. XlaserveCpuSetThreads (matmul.cc)
// sets it as the library is loaded (kernels/cpu/build.py), before any kernel starts the helpers.
inline std::atomic<int>& requested_threads() {
  static std::atomic<int> count{0};
  return count;
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

  // Runs `run(chunk, worker)` for every chunk in [0, nchunks) on the calling thread and every helper;
  // returns when all are done. One job at a time: a caller that finds the helpers busy works alone.
  void parallel_for(int64_t nchunks, std::function<void(int64_t, int)> run) {
    auto job = std::make_shared<Job>();
    job->run = std::move(run);
    job->nchunks = nchunks;
    if (nchunks > 1) submit(job);
    else job->work();
  }

 private:
  void submit(const std::shared_ptr<Job>& job) {
    std::unique_lock<std::mutex> busy(submit_mu_, std::try_to_lock);
    if (!busy.owns_lock() || threads_.empty()) {
      job->work();
      return;
    }
    std::atomic_store(&current_, job);
    generation_.fetch_add(1);
    // A helper going to sleep counts itself before it checks the generation (both sequentially
    // consistent), so either it sees the new generation or we see it asleep and wake it.
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lock(sleep_mu_); }
      sleep_cv_.notify_all();
    }
    job->work();
    while (job->done.load(std::memory_order_acquire) < job->nchunks) cpu_relax();
    std::atomic_store(&current_, std::shared_ptr<Job>());
  }

  Workers() {
    int total = requested_threads().load();
    if (total <= 0) total = static_cast<int>(std::thread::hardware_concurrency());
    const int count = total - 1;
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
        sleepers_.fetch_add(1);
        sleep_cv_.wait(lock, [&] { return generation_.load() != seen; });
        sleepers_.fetch_sub(1);
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
  std::atomic<int> sleepers_{0};
  std::shared_ptr<Job> current_;
};

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_COMMON_H_
