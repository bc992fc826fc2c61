// What every CPU kernel starts from: the vector width this build runs at, torch's NaN-propagating min/max, and
// float bits. Included (inlined by native.assemble) into step_kernel.cpp.
#ifndef FO_COMMON_HPP
#define FO_COMMON_HPP
#include "system.hpp"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VBMI__)
#define FO_AVX512 1
#define FO_AVX2 1
#elif defined(__AVX2__)
#define FO_AVX2 1
#endif

// the vector width this build's codec runs at (512, 256, or 0: scalar)
extern "C" int fo_simd_width() {
#if defined(FO_AVX512)
    return 512;
#elif defined(FO_AVX2)
    return 256;
#else
    return 0;
#endif
}

static inline float fo_maximum(float a, float b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
static inline float fo_minimum(float a, float b) { return (a != a || b != b) ? a + b : (a < b ? a : b); }

// |x|'s bits: integer max over them orders them as the values (NaN above inf), so it finds the block's absmax
static inline uint32_t float_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
static inline uint32_t magnitude_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }
static inline float from_bits(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

#endif  // FO_COMMON_HPP
