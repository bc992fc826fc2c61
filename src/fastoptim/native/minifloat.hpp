// 8-bit floating-point codes with a per-block scale (storage/codecs/fp8.py): encoded by integer operations on the
// bits (exponent rebias, round half to even by a bias and a mask, saturate), decoded the same way, so no table in
// memory. Written on lanes (lanes.hpp), each lane's bits the scalar formula's; a block's last few codes
// one at a time. Included into step_kernel.cpp after codec.hpp; Minifloat's docstring in fp8.py states the format
// these functions must match bit for bit.
#ifndef FO_MINIFLOAT_HPP
#define FO_MINIFLOAT_HPP
#include "lanes.hpp"

// The encoder's constants: normal codes take the rebias folded into the rounding bias,
// (mag + rebias + half - 1 + odd) >> (23 - M); subnormal ones (below 2**(1 - BIAS)) are the low bits of
// |y| + 2**(23 + 1 - BIAS - M), a sum the FPU rounds half to even at the smallest subnormal (the integer
// arithmetic of Minifloat.encode, in fewer operations)
template <int M, int BIAS>
struct MinifloatBits {
    static constexpr int SHIFT = 23 - M;
    static constexpr uint32_t BIAS_ADD = (uint32_t)((BIAS - 127) * (1 << 23)) + ((1u << (SHIFT - 1)) - 1u);
    static constexpr uint32_t FIRST_NORMAL = (uint32_t)(128 - BIAS) << 23;
    static constexpr uint32_t MAGIC = (uint32_t)(151 - BIAS - M) << 23;
    static constexpr uint32_t REBIAS = (uint32_t)(127 - BIAS) << 23;  // the decoder's
};

// the codes of x * inv (inv: MAXV over the block's divisor), one a lane
template <int M, int BIAS, uint32_t MAXBITS, bool SIGNED>
static inline LaneBits minifloat_code_lanes(Lanes x, float inv) {
    using F = MinifloatBits<M, BIAS>;
    const LaneBits u = fo_bits(x * inv);
    const LaneBits mag = fo_min(u & 0x7FFFFFFFu, LaneBits{} + MAXBITS);
    const LaneBits normal = (mag + F::BIAS_ADD + ((mag >> F::SHIFT) & 1u)) >> F::SHIFT;
    const LaneBits sub = fo_bits(fo_from_bits(mag) + from_bits(F::MAGIC)) - F::MAGIC;
    LaneBits code = fo_select((LaneMask)(mag < F::FIRST_NORMAL), sub, normal);
    const LaneBits sign = fo_bits(x) >> 31;  // x's (a NaN product's sign depends on operand order)
    if (SIGNED) {
        code |= sign << 7;
    } else {  // (x * inv may underflow)
        code = fo_select((LaneMask)(code == 0u) & (LaneMask)(x > Lanes{}), LaneBits{} + 1u, code);
        code = fo_select((LaneMask)(sign != 0u), LaneBits{}, code);
    }
    return code;
}

// the values of a lanes' worth of codes times scale, by the hardware's fp16 widening (F16C): each code placed as
// the fp16 number of the same sign, exponent field and mantissa, whose value is the code's over 2**(15 - BIAS)
// (fp16's bias is 15; subnormals included), times scale * 2**(15 - BIAS). That product is exact (a power of two;
// within range as scale <= FLT_MAX / MAXV and MAXV >= 2**(15 - BIAS)), so the result is the same real number as
// value * scale, rounded once. For formats fp16 holds: at most 4 exponent bits (fp16's field 31 is inf and NaN).
template <int M, int BIAS, uint32_t MAXBITS, bool SIGNED>
constexpr bool minifloat_in_halves() {
#if defined(__F16C__) && (defined(FO_AVX512) || defined(FO_AVX2))
    return (SIGNED ? 7 : 8) - M <= 4 && M >= 2 && BIAS <= 15 && MAXBITS >= ((uint32_t)(127 + 15 - BIAS) << 23);
#else
    return false;
#endif
}
#if defined(__F16C__) && (defined(FO_AVX512) || defined(FO_AVX2))
template <int M, int BIAS, bool SIGNED>
static inline Lanes minifloat_halves(const uint8_t* c, float scale) {
    const float unbias = from_bits((uint32_t)(127 + 15 - BIAS) << 23);
    // signed: the code as a word's top byte, shifted down arithmetically: sign at bit 15, its copies cleared
    const int16_t keep = (int16_t)(0x8000 | (0x7FFF >> (M - 2)));
#if defined(FO_AVX512)
    const __m256i code = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    const __m256i half = SIGNED ? _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(code, 8), M - 2),
                                                   _mm256_set1_epi16(keep))
                                : _mm256_slli_epi16(code, 10 - M);
    return (Lanes)_mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(scale * unbias));
#else
    const __m128i code = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
    const __m128i half = SIGNED ? _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(code, 8), M - 2), _mm_set1_epi16(keep))
                                : _mm_slli_epi16(code, 10 - M);
    return (Lanes)_mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(scale * unbias));
#endif
}
#endif

// the values of a lanes' worth of codes times scale (the block's absmax over MAXV)
template <int M, int BIAS, uint32_t MAXBITS, bool SIGNED>
static inline Lanes minifloat_lanes(const uint8_t* c, float scale) {
#if defined(__F16C__) && (defined(FO_AVX512) || defined(FO_AVX2))
    if constexpr (minifloat_in_halves<M, BIAS, MAXBITS, SIGNED>()) return minifloat_halves<M, BIAS, SIGNED>(c, scale);
#endif
    const LaneBits code = fo_widen(c);
    const LaneBits mag = SIGNED ? code & 0x7Fu : code;
    const Lanes normal = fo_from_bits((mag << (23 - M)) + MinifloatBits<M, BIAS>::REBIAS);
    const Lanes unit = Lanes{} + from_bits((uint32_t)(128 - BIAS - M) << 23);  // the smallest subnormal
    const Lanes sub = __builtin_convertvector((LaneMask)(mag & ((1u << M) - 1u)), Lanes) * unit;
    Lanes v = fo_select((LaneMask)((mag >> M) == 0u), sub, normal);
    if (SIGNED) v = fo_from_bits(fo_bits(v) ^ ((code & 0x80u) << 24));
    return v * scale;
}

// codes of x[i] * (MAXV / divisor): M mantissa bits, exponent bias BIAS, MAXBITS the fp32 bits of the largest value
// (MAXV), saturating; SIGNED: bit 7 the sign; else a negative value is 0 and a positive one never rounds to 0
template <int M, int BIAS, uint32_t MAXBITS, bool SIGNED>
static inline void minifloat_encode(const float* x, int64_t n, float divisor, const Codec& codec, uint8_t* c) {
    (void)codec;
    const float inv = from_bits(MAXBITS) / divisor;
    using F = MinifloatBits<M, BIAS>;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        fo_narrow(c + i, minifloat_code_lanes<M, BIAS, MAXBITS, SIGNED>(fo_lanes(x + i), inv));
    }
    for (; i < n; ++i) {
        const float y = x[i] * inv;
        uint32_t u; std::memcpy(&u, &y, 4);
        uint32_t mag = u & 0x7FFFFFFFu;
        mag = mag < MAXBITS ? mag : MAXBITS;
        const uint32_t normal = (mag + F::BIAS_ADD + ((mag >> F::SHIFT) & 1u)) >> F::SHIFT;
        uint32_t sub; const float shifted = from_bits(mag) + from_bits(F::MAGIC); std::memcpy(&sub, &shifted, 4);
        uint32_t code = mag < F::FIRST_NORMAL ? sub - F::MAGIC : normal;
        const uint32_t sign = float_bits(x[i]) >> 31;  // x's (a NaN product's sign depends on operand order)
        if (SIGNED) {
            code |= sign << 7;
        } else {
            code = sign ? 0u : (code == 0u && x[i] > 0.0f ? 1u : code);  // (x * inv may underflow)
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
    const float unit = from_bits((uint32_t)(128 - BIAS - M) << 23);  // the smallest subnormal, 2**(1 - BIAS - M)
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) fo_put(out + i, minifloat_lanes<M, BIAS, MAXBITS, SIGNED>(c + i, scale));
    for (; i < n; ++i) {
        const uint32_t code = c[i];
        const uint32_t mag = SIGNED ? code & 0x7Fu : code;
        const float normal = from_bits((mag << (23 - M)) + MinifloatBits<M, BIAS>::REBIAS);
        const float sub = (float)(int32_t)(mag & ((1u << M) - 1u)) * unit;
        float v = (mag >> M) == 0u ? sub : normal;
        if (SIGNED) v = (code & 0x80u) ? -v : v;
        out[i] = v * scale;
    }
}
#endif  // FO_MINIFLOAT_HPP
