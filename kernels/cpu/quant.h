// Shared by the kernels on grouped 4- and 8-bit weights (qmatmul.cc, qgemm.cc, and the int8-activation ones
// qmatmul_i8.cc, qgemm_i8.cc): the layout's constants, half -> float conversion, a group's unpacking and an
// activation group's rounding to int8. The layout is kernels/quant/reference.py's.
#ifndef XLASERVE_KERNELS_CPU_QUANT_H_
#define XLASERVE_KERNELS_CPU_QUANT_H_

#include <string>
#include <utility>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace xlaserve {

constexpr int64_t kGroup = 32;  // inputs per scale (kernels/quant/reference.py GROUP)

// The FFI signature of the kernels on grouped weights: x, q, scale, zero -> y f32, with the attribute `bits`;
// with `kLive` (the many-row GEMMs) the rows to compute after zero (s32 [4]: LiveRows).
template <bool kLive = false>
inline auto quantized_binding() {
  namespace ffi = xla::ffi;
  auto operands = ffi::Ffi::Bind()
                      .Arg<ffi::AnyBuffer>()
                      .Arg<ffi::AnyBuffer>()
                      .Arg<ffi::Buffer<ffi::F16>>()
                      .Arg<ffi::Buffer<ffi::F16>>();
  if constexpr (kLive)
    return std::move(operands).Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int32_t>("bits");
  else
    return std::move(operands).Ret<ffi::Buffer<ffi::F32>>().Attr<int32_t>("bits");
}

// The rows of x a GEMM computes: [r[0], r[1]) and [r[2], r[3]), a step's prefill and decode tokens (kernels/cpu
// `live_rows`); y's other rows, a bucket's padding, are zeros, their x neither read nor multiplied.
struct LiveRows {
  int64_t r[4];

  // From the s32 [4] operand `l` of an m-row product; bounds out of order or past m mean every row.
  static LiveRows of(const int32_t* l, int64_t m) {
    if (0 <= l[0] && l[0] <= l[1] && l[1] <= l[2] && l[2] <= l[3] && l[3] <= m) return {{l[0], l[1], l[2], l[3]}};
    return {{0, m, m, m}};
  }
  bool contains(int64_t row) const { return (r[0] <= row && row < r[1]) || (r[2] <= row && row < r[3]); }
  int64_t count() const { return r[1] - r[0] + r[3] - r[2]; }
  // f(r0, rows) for each run of at most kTile rows of the ranges, in order.
  template <int64_t kTile, typename F>
  void for_tiles(F&& f) const {
    for (int range = 0; range < 2; ++range)
      for (int64_t r0 = r[2 * range]; r0 < r[2 * range + 1]; r0 += kTile)
        f(r0, std::min<int64_t>(kTile, r[2 * range + 1] - r0));
  }
  // Zeros y's rows outside the ranges (y [m, n]).
  void zero_others(float* y, int64_t m, int64_t n) const {
    for (int64_t row = 0; row < m; ++row)
      if (!contains(row)) std::memset(y + row * n, 0, sizeof(float) * n);
  }
};

// A product's sizes on grouped weights: x [m, k] @ W.T, W [n, k] in `groups` groups of `row_bytes` a row.
struct QShape {
  int64_t m, k, n, groups, row_bytes;
};

// Checks the operands of `target` (x [m, k], q u8 [n, k / 2] or s8 [n, k], scale f16 [n, k / 32], zero the
// same or empty for 8 bits, y f32 [m, n]) and fills `shape`; an error naming `target` when they disagree.
inline xla::ffi::Error check_quantized(const char* target, const xla::ffi::AnyBuffer& x,
                                       const xla::ffi::AnyBuffer& q, const xla::ffi::Buffer<xla::ffi::F16>& scale,
                                       const xla::ffi::Buffer<xla::ffi::F16>& zero,
                                       xla::ffi::Result<xla::ffi::Buffer<xla::ffi::F32>>& y, int32_t bits,
                                       QShape& shape) {
  namespace ffi = xla::ffi;
  auto fail = [&](const char* why) { return ffi::Error::InvalidArgument(std::string(target) + ": " + why); };
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || yd.size() != 2)
    return fail("x, q, scale and y must be 2-D");
  if (bits != 4 && bits != 8) return fail("bits must be 4 or 8");
  const int64_t m = xd[0], k = xd[1], n = qd[0];
  if (k % kGroup) return fail("k must be a multiple of 32");
  const int64_t groups = k / kGroup, row_bytes = k * bits / 8;
  if (q.element_type() != (bits == 4 ? ffi::DataType::U8 : ffi::DataType::S8))
    return fail("q must be u8 (4 bits) or s8 (8 bits)");
  if (qd[1] != row_bytes || sd[0] != n || sd[1] != groups || yd[0] != m || yd[1] != n)
    return fail("shapes do not agree");
  auto zd = zero.dimensions();
  if (bits == 4 ? zd.size() != 2 || zd[0] != n || zd[1] != groups : zero.element_count() != 0)
    return fail("zero must be [n, k / 32], or empty (8 bits)");
  shape = QShape{m, k, n, groups, row_bytes};
  return ffi::Error::Success();
}

// After check_quantized: whether the product is empty, so the kernel has nothing more to do (m or n zero;
// k zero: y zeroed).
inline bool empty_product(const QShape& shape, float* y) {
  if (shape.m == 0 || shape.n == 0) return true;
  if (shape.k == 0) {
    std::memset(y, 0, sizeof(float) * shape.m * shape.n);
    return true;
  }
  return false;
}

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

// IEEE half -> float, subnormals and infinities included (the fallback without AVX-512).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else {  // zero or subnormal: mant * 2^-24
    float f = float(mant) * (1.f / 16777216.f);
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// dst[0, count) = src[0, count) as floats, the last few by a masked load.
inline void halves_to_floats(const uint16_t* src, float* dst, int64_t count) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  for (int64_t i = 0; i < count; i += kLanes) {
    const __mmask16 live = count - i >= kLanes ? 0xffff : (1u << (count - i)) - 1;
    _mm512_mask_storeu_ps(dst + i, live, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, src + i)));
  }
#else
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < count; ++i) dst[i] = half_to_float(src[i]);
#endif
}

// A group's 32 weights' integers (nibbles 0..15, or -127..127) as two vectors of floats: elements 0-15 and
// 16-31.
template <int Bits>
inline void unpack(const uint8_t* p, vec& lo, vec& hi) {
#if defined(__AVX512F__)
  if (Bits == 4) {  // byte j: element j in the low nibble, j + 16 in the high one
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = (vec)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi = (vec)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  } else {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kLanes));
    lo = (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a));
    hi = (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
#elif defined(XLASERVE_SPLIT_VEC)
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (Bits == 4) {  // byte j: element j in the low nibble, j + 16 in the high one
    const __m256i b0 = _mm256_cvtepu8_epi32(a), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8));
    const __m256i nib = _mm256_set1_epi32(15);
    lo = {(f32x8)_mm256_cvtepi32_ps(_mm256_and_si256(b0, nib)), (f32x8)_mm256_cvtepi32_ps(_mm256_and_si256(b1, nib))};
    hi = {(f32x8)_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), (f32x8)_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kLanes));
    lo = {(f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)),
          (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)))};
    hi = {(f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
          (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
  }
#else
  if (Bits == 4) {
    u8x16 b;
    std::memcpy(&b, p, sizeof(b));
    lo = __builtin_convertvector(b & 15, vec);
    hi = __builtin_convertvector(b >> 4, vec);
  } else {
    i8x16 a, b;
    std::memcpy(&a, p, sizeof(a));
    std::memcpy(&b, p + kLanes, sizeof(b));
    lo = __builtin_convertvector(a, vec);
    hi = __builtin_convertvector(b, vec);
  }
#endif
}

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)) && defined(__AVX2__) && \
    defined(__F16C__) && defined(__FMA__)
#define XLASERVE_I8_AVX2 1  // qmatmul_i8.cc and qgemm_i8.cc in their AVX2 forms (vpmaddubsw)
#endif
#if defined(XLASERVE_I8_AVX2)
// Row x[0, k) rounded as kernels/quant/reference.py's quantize_activations (to nearest even, as jnp.round):
// q[k] in order, d[groups] each group's scale, sums[groups] d x the sum of the group's integers.
inline void round_row(const float* x, int64_t k, int8_t* q, float* d, float* sums) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < k / kGroup; ++g) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + g * kGroup + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i n[4];
    for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    // packs interleave 128-bit lanes: dwords (4 elements) come out 0, 2, 4, 6, 1, 3, 5, 7; put back in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kGroup), _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    d[g] = amax / 127.f;
    sums[g] = d[g] * float(_mm_cvtsi128_si32(t));
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define XLASERVE_I8 1  // the int8-activation kernels are built (their products by AVX512-VNNI's vpdpbusd)

// x[0, 32) rounded to int8 as kernels/quant/reference.py's quantize_activations: qlo, qhi (elements 0-15,
// 16-31 as int32) = round(x * 127 / max|x|), rounded to nearest even as jnp.round; d = max|x| / 127 (a group
// of zeros: all zero).
inline void quantize_group(const float* x, __m512i& qlo, __m512i& qhi, float& d) {
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + kLanes);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  d = amax / 127.f;
  // |x * inv| <= 127 (the maximum may round to 127 exactly)
  qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
  qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
}
#endif

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_QUANT_H_
