// One vector register's fp32 lanes as one value (GCC's and Clang's vector extensions: 16 lanes with AVX-512, 8
// with AVX2, 4 else): the kernel's update runs on them with the rule's own operators, each an IEEE operation in
// every lane. Every function here has a float twin of the same name (common.hpp, or below), so one traced update
// compiles for a block's tail as well. Included (inlined by native.assemble) into step_kernel.cpp.
#ifndef FO_LANES_HPP
#define FO_LANES_HPP
#include "common.hpp"

#if defined(FO_AVX512)
constexpr int64_t LANES = 16;
#elif defined(FO_AVX2)
constexpr int64_t LANES = 8;
#else
constexpr int64_t LANES = 4;
#endif
typedef float Lanes __attribute__((vector_size(4 * LANES)));
typedef uint32_t LaneBits __attribute__((vector_size(4 * LANES)));
typedef int32_t LaneMask __attribute__((vector_size(4 * LANES)));  // a comparison's lanes: all ones where it holds

static inline Lanes fo_lanes(const float* x) { Lanes v; std::memcpy(&v, x, sizeof v); return v; }
static inline void fo_put(float* x, Lanes v) { std::memcpy(x, &v, sizeof v); }
static inline LaneBits fo_bits(Lanes v) { return (LaneBits)v; }
static inline Lanes fo_from_bits(LaneBits u) { return (Lanes)u; }
static inline Lanes fo_select(LaneMask where, Lanes a, Lanes b) { return where ? a : b; }
static inline LaneBits fo_select(LaneMask where, LaneBits a, LaneBits b) { return where ? a : b; }

// bytes or 16-bit words widened to lanes of bits, and lanes' low bytes or words (compilers scalarise
// __builtin_convertvector between these widths, so the conversions are spelled out where the build has them;
// else one lane at a time)
template <class T>
static inline LaneBits fo_widen_each(const T* src) {
    LaneBits out;
    for (int k = 0; k < LANES; ++k) out[k] = src[k];
    return out;
}
template <class T>
static inline void fo_narrow_each(T* dst, LaneBits u) {
    for (int k = 0; k < LANES; ++k) dst[k] = (T)u[k];
}
static inline LaneBits fo_widen(const uint8_t* src) {
#if defined(FO_AVX512)
    return (LaneBits)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#elif defined(FO_AVX2)
    return (LaneBits)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
#else
    return fo_widen_each(src);
#endif
}
static inline LaneBits fo_widen(const uint16_t* src) {
#if defined(FO_AVX512)
    return (LaneBits)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
#elif defined(FO_AVX2)
    return (LaneBits)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#else
    return fo_widen_each(src);
#endif
}
// (AVX2: by saturating packs, so each lane must already fit: codes, bf16 words)
static inline void fo_narrow(uint8_t* dst, LaneBits u) {
#if defined(FO_AVX512)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8((__m512i)u));
#elif defined(FO_AVX2)
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128((__m256i)u), _mm256_extracti128_si256((__m256i)u, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(words, words));
#else
    fo_narrow_each(dst, u);
#endif
}
static inline void fo_narrow(uint16_t* dst, LaneBits u) {
#if defined(FO_AVX512)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16((__m512i)u));
#elif defined(FO_AVX2)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm_packus_epi32(_mm256_castsi256_si128((__m256i)u), _mm256_extracti128_si256((__m256i)u, 1)));
#else
    fo_narrow_each(dst, u);
#endif
}

// x in every lane, exactly (not 0 + x: that turns -0.0 into +0.0)
static inline Lanes fo_splat(float x) { return x - Lanes{}; }

static inline float fo_sqrt(float x) { return sqrtf(x); }
static inline Lanes fo_sqrt(Lanes x) {
#if defined(FO_AVX512)
    return (Lanes)_mm512_sqrt_ps((__m512)x);
#elif defined(FO_AVX2)
    return (Lanes)_mm256_sqrt_ps((__m256)x);
#else
    Lanes out;
    for (int k = 0; k < LANES; ++k) out[k] = sqrtf(x[k]);
    return out;
#endif
}

// torch.sign: 0 for NaN and either zero
static inline float fo_sign(float x) { return (float)((x > 0.0f) - (x < 0.0f)); }
static inline Lanes fo_sign(Lanes x) {
    const Lanes zero = {}, one = zero + 1.0f;
    return fo_select(x > zero, one, zero) - fo_select(x < zero, one, zero);
}

// torch.maximum / torch.minimum: NaN wins (a + b is NaN where either is)
static inline Lanes fo_maximum(Lanes a, Lanes b) {
    return fo_select((a != a) | (b != b), a + b, fo_select(a > b, a, b));
}
static inline Lanes fo_minimum(Lanes a, Lanes b) {
    return fo_select((a != a) | (b != b), a + b, fo_select(a < b, a, b));
}
static inline Lanes fo_maximum(Lanes a, float b) { return fo_maximum(a, fo_splat(b)); }
static inline Lanes fo_maximum(float a, Lanes b) { return fo_maximum(fo_splat(a), b); }
static inline Lanes fo_minimum(Lanes a, float b) { return fo_minimum(a, fo_splat(b)); }
static inline Lanes fo_minimum(float a, Lanes b) { return fo_minimum(fo_splat(a), b); }

// the largest magnitude's bits so far (integer max over |x|'s bits orders them as the values), per lane
static inline uint32_t fo_top(uint32_t top, float x) { return top > magnitude_bits(x) ? top : magnitude_bits(x); }
static inline LaneBits fo_max(LaneBits a, LaneBits b) {
#if defined(FO_AVX512)
    return (LaneBits)_mm512_max_epu32((__m512i)a, (__m512i)b);
#elif defined(FO_AVX2)
    return (LaneBits)_mm256_max_epu32((__m256i)a, (__m256i)b);
#else
    return fo_select((LaneMask)(a > b), a, b);
#endif
}
static inline LaneBits fo_min(LaneBits a, LaneBits b) {
#if defined(FO_AVX512)
    return (LaneBits)_mm512_min_epu32((__m512i)a, (__m512i)b);
#elif defined(FO_AVX2)
    return (LaneBits)_mm256_min_epu32((__m256i)a, (__m256i)b);
#else
    return fo_select((LaneMask)(a < b), a, b);
#endif
}
static inline LaneBits fo_top(LaneBits top, Lanes x) { return fo_max(top, fo_bits(x) & 0x7FFFFFFFu); }
static inline uint32_t fo_top(uint32_t top, LaneBits lanes) {
    for (int k = 0; k < LANES; ++k) top = top > lanes[k] ? top : lanes[k];
    return top;
}

// bf16 <-> fp32 as torch converts: widening is exact; narrowing rounds to nearest even, NaN stays quiet NaN
static inline Lanes bf16_lanes(const uint16_t* src) { return fo_from_bits(fo_widen(src) << 16); }
static inline void bf16_load(const uint16_t* src, int64_t n, float* out) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) fo_put(out + i, bf16_lanes(src + i));
    for (; i < n; ++i) out[i] = from_bits((uint32_t)src[i] << 16);
}
static inline void bf16_put(uint16_t* dst, Lanes x) {
    const LaneBits u = fo_bits(x);
    const LaneBits rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    fo_narrow(dst, fo_select((LaneMask)(x != x), LaneBits{} + 0x7FC0u, rounded));
}
static inline void bf16_put(uint16_t* dst, float x) {
    uint32_t u; std::memcpy(&u, &x, 4);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    *dst = x != x ? (uint16_t)0x7FC0 : (uint16_t)rounded;
}
#endif  // FO_LANES_HPP
