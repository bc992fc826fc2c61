// 8-bit floating-point codes with a per-block scale (storage/codecs/fp8.py): encoded by integer operations on the
// bits (exponent rebias, round half to even by a bias and a mask, saturate), decoded the same way, so no table in
// memory. Plain loops the compiler vectorizes (variable shifts, blends). Included into step_kernel.cpp after
// codec.hpp; Minifloat's docstring in fp8.py states the format these functions must match bit for bit.
#ifndef FO_MINIFLOAT_HPP
#define FO_MINIFLOAT_HPP
#include "common.hpp"

// codes of x[i] * (MAXV / divisor): M mantissa bits, exponent bias BIAS, MAXBITS the fp32 bits of the largest value
// (MAXV), saturating; SIGNED: bit 7 the sign; else a negative value is 0 and a positive one never rounds to 0
template <int M, int BIAS, uint32_t MAXBITS, bool SIGNED>
static inline void minifloat_encode(const float* x, int64_t n, float divisor, const Codec& codec, uint8_t* c) {
    (void)codec;
    const float inv = from_bits(MAXBITS) / divisor;
    // normal: the rebias folded into the rounding bias, (mag + rebias + half - 1 + odd) >> (23 - M); subnormal
    // (below 2**(1 - BIAS)): the FPU rounds |y| + 2**(23 + 1 - BIAS - M), whose ulp is the smallest subnormal,
    // half to even, and the sum's low bits are the code (the integer arithmetic of Minifloat.encode, in fewer
    // operations)
    constexpr int SHIFT = 23 - M;
    constexpr uint32_t BIAS_ADD = (uint32_t)((BIAS - 127) * (1 << 23)) + ((1u << (SHIFT - 1)) - 1u);
    constexpr uint32_t FIRST_NORMAL = (uint32_t)(128 - BIAS) << 23;
    constexpr uint32_t MAGIC = (uint32_t)(151 - BIAS - M) << 23;
    for (int64_t i = 0; i < n; ++i) {
        const float y = x[i] * inv;
        uint32_t u; std::memcpy(&u, &y, 4);
        uint32_t mag = u & 0x7FFFFFFFu;
        mag = mag < MAXBITS ? mag : MAXBITS;
        const uint32_t normal = (mag + BIAS_ADD + ((mag >> SHIFT) & 1u)) >> SHIFT;
        uint32_t sub; const float shifted = from_bits(mag) + from_bits(MAGIC); std::memcpy(&sub, &shifted, 4);
        uint32_t code = mag < FIRST_NORMAL ? sub - MAGIC : normal;
        if (SIGNED) {
            code |= (u >> 24) & 0x80u;
        } else {
            code = (u >> 31) ? 0u : (code == 0u && x[i] > 0.0f ? 1u : code);  // (x * inv may underflow)
        }
        c[i] = (uint8_t)code;
    }
}

// a block's absmax as stored: at least 2**-100 unless 0 (fp8.SMALLEST_SCALE: MAXV / absmax stays finite)
static inline float fp8_scale(float amax) { return amax > 0.0f && amax < 0x1p-100f ? 0x1p-100f : amax; }

// values of codes c[i] times divisor / MAXV (the block's absmax over the largest value)
template <int M, int BIAS, uint32_t MAXBITS, bool SIGNED>
static inline void minifloat_decode(const uint8_t* c, int64_t n, const Codec& codec, float absmax, float* out) {
    (void)codec;
    const float scale = absmax / from_bits(MAXBITS);
    constexpr uint32_t REBIAS = (uint32_t)(127 - BIAS) << 23;
    const float unit = from_bits((uint32_t)(128 - BIAS - M) << 23);  // the smallest subnormal, 2**(1 - BIAS - M)
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t code = c[i];
        const uint32_t mag = SIGNED ? code & 0x7Fu : code;
        const float normal = from_bits((mag << (23 - M)) + REBIAS);
        const float sub = (float)(int32_t)(mag & ((1u << M) - 1u)) * unit;
        float v = (mag >> M) == 0u ? sub : normal;
        if (SIGNED) v = (code & 0x80u) ? -v : v;
        out[i] = v * scale;
    }
}
#endif  // FO_MINIFLOAT_HPP
