// Shared by the kernels on grouped 4- and 8-bit weights (qmatmul.cc, qgemm.cc): the layout's constants,
// half -> float conversion and a group's unpacking. The layout is kernels/quant/reference.py's.
#ifndef XLASERVE_KERNELS_CPU_QUANT_H_
#define XLASERVE_KERNELS_CPU_QUANT_H_

#include "common.h"

namespace xlaserve {

constexpr int64_t kGroup = 32;  // inputs per scale (kernels/quant/reference.py GROUP)

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
  for (int64_t i = 0; i < count; ++i) dst[i] = half_to_float(src[i]);
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

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_QUANT_H_
