// The block-wise quantized state's codec: 8-bit codes (one a byte) and 4-bit codes (two a byte) decoded through the
// map times the block's absmax, and encoded exactly as quant.Encoder does. Three builds under #if, all exact:
// AVX-512 (with VBMI: byte permutes over tables held in registers), AVX2 (table reads lane by lane with scalar
// loads), and scalar. Included (inlined by native.assemble) into step_kernel.cpp, after common.hpp.
#ifndef FO_CODEC_HPP
#define FO_CODEC_HPP
#include "common.hpp"

// decode8's in-lane interleave (bytes -> words -> dwords) turns byte 16l + 4q + e of its input into the dword for
// code 16q + 4l + e (q: output vector, l: 128-bit lane, e: element), so the codes are first permuted into that
// order; byte0/byte1: bytes 0 and 1 of dword k % 32 of a pair of vectors (the 8-bit encoder's cells)
struct FoByteOrders {
    uint8_t interleave[64], byte0[64], byte1[64];
};
static constexpr FoByteOrders fo_byte_orders() {
    FoByteOrders o{};
    for (int q = 0; q < 4; ++q)
        for (int lane = 0; lane < 4; ++lane)
            for (int e = 0; e < 4; ++e) o.interleave[16 * lane + 4 * q + e] = (uint8_t)(16 * q + 4 * lane + e);
    for (int k = 0; k < 64; ++k) {
        o.byte0[k] = (uint8_t)(4 * (k % 32));
        o.byte1[k] = (uint8_t)(4 * (k % 32) + 1);
    }
    return o;
}
alignas(64) static constexpr FoByteOrders FO_BYTE_ORDERS = fo_byte_orders();

// one quantized state's map: its values and quant.Encoder's table; with AVX-512 also the map in registers
struct Codec {
    const float* values;
    const uint32_t* lut;
#ifdef FO_AVX512
    __m512i planes[4][4];  // 8 bits: byte j of value k at planes[j][k / 64], byte k % 64
    __m512 table;          // 4 bits: the 16 values
    __m512 bounds;         // 4 bits: the 15 boundaries (quant.QuantMap.boundaries), ascending
    // 8 bits, the encoder's cells (see cell_tables in Python): per sign, by exponent & 31, (adjust << 5) | shift;
    // the lowest code of each cell (512 bytes); the boundaries (and 2.0 after the last) as 4 byte planes
    __m512i octaves[2][2];
    __m512i cells[8];
    __m512i bound_planes[4][4];
#endif
};

#ifdef FO_AVX512
static inline void byte_planes(const float* values, __m512i planes[4][4]) {
    alignas(64) uint8_t bytes[4][256];
    for (int k = 0; k < 256; ++k) {
        uint32_t u; std::memcpy(&u, values + k, 4);
        for (int j = 0; j < 4; ++j) bytes[j][k] = (uint8_t)(u >> (8 * j));
    }
    for (int j = 0; j < 4; ++j)
        for (int q = 0; q < 4; ++q) planes[j][q] = _mm512_load_si512(bytes[j] + 64 * q);
}
#endif

// bounds: 4 bits, the map's 15 boundaries; 8 bits: the encoder's cell tables, or null (the table read lane by lane)
static inline Codec make_codec(const void* values, const void* lut, const float* bounds, const int32_t* octaves,
                               const uint8_t* cells, int bits) {
    Codec c;
    c.values = static_cast<const float*>(values);
    c.lut = static_cast<const uint32_t*>(lut);
#ifdef FO_AVX512
    if (bits == 8) {
        byte_planes(c.values, c.planes);
        if (cells) {
            for (int sign = 0; sign < 2; ++sign)
                for (int h = 0; h < 2; ++h) c.octaves[sign][h] = _mm512_loadu_si512(octaves + 32 * sign + 16 * h);
            for (int q = 0; q < 8; ++q) c.cells[q] = _mm512_loadu_si512(cells + 64 * q);
            byte_planes(bounds, c.bound_planes);
        }
    } else {
        c.table = _mm512_loadu_ps(c.values);
        c.bounds = _mm512_mask_loadu_ps(_mm512_set1_ps(INFINITY), 0x7FFF, bounds);
    }
#else
    (void)bits; (void)bounds; (void)octaves; (void)cells;
#endif
    return c;
}

#ifdef FO_AVX512
// 64 fp32 entries table[idx byte k] of a 256-entry table held as byte planes, in code order: two 128-entry
// byte permutes per plane (the index's top bit picks one), the four planes interleaved into dwords
static inline void lookup64(const __m512i planes[4][4], __m512i idx, __m512i out[4]) {
    idx = _mm512_permutexvar_epi8(_mm512_loadu_si512(FO_BYTE_ORDERS.interleave), idx);
    const __mmask64 top = _mm512_movepi8_mask(idx);
    __m512i b[4];
    for (int j = 0; j < 4; ++j)
        b[j] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(planes[j][0], idx, planes[j][1]),
                                      _mm512_permutex2var_epi8(planes[j][2], idx, planes[j][3]));
    const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_unpacklo_epi16(lo01, lo23);
    out[1] = _mm512_unpackhi_epi16(lo01, lo23);
    out[2] = _mm512_unpacklo_epi16(hi01, hi23);
    out[3] = _mm512_unpackhi_epi16(hi01, hi23);
}
#endif

// out[i] = values[code i] * absmax; 8-bit codes one a byte
static inline void decode8(const uint8_t* c, int64_t n, const Codec& codec, float absmax, float* out) {
    int64_t i = 0;
#if defined(FO_AVX512)
    const __m512 a = _mm512_set1_ps(absmax);
    for (; i + 64 <= n; i += 64) {
        __m512i v[4];
        lookup64(codec.planes, _mm512_loadu_si512(c + i), v);
        for (int q = 0; q < 4; ++q) _mm512_storeu_ps(out + i + 16 * q, _mm512_mul_ps(_mm512_castsi512_ps(v[q]), a));
    }
#elif defined(FO_AVX2)
    // eight table reads by scalar loads, not a gather: faster where gathers run lane by lane (Zen 3)
    const __m256 a = _mm256_set1_ps(absmax);
    const float* v = codec.values;
    for (; i + 8 <= n; i += 8) {
        uint64_t w; std::memcpy(&w, c + i, 8);
        const __m128 lo = _mm_setr_ps(v[w & 255], v[(w >> 8) & 255], v[(w >> 16) & 255], v[(w >> 24) & 255]);
        const __m128 hi = _mm_setr_ps(v[(w >> 32) & 255], v[(w >> 40) & 255], v[(w >> 48) & 255], v[w >> 56]);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_set_m128(hi, lo), a));
    }
#endif
    for (; i < n; ++i) out[i] = codec.values[c[i]] * absmax;
}

// 4-bit codes two a byte, the first in the low nibble
static inline void decode4(const uint8_t* c, int64_t n, const Codec& codec, float absmax, float* out) {
    int64_t i = 0;
#if defined(FO_AVX512)
    const __m512 a = _mm512_set1_ps(absmax);
    const __m128i pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i nibble = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    for (; i + 16 <= n; i += 16) {  // 8 bytes: 16 codes (the permute reads an index's low 4 bits only)
        const __m128i bytes = _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i / 2)), pairs);
        const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(bytes), nibble);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_permutexvar_ps(idx, codec.table), a));
    }
#elif defined(FO_AVX2)
    const __m256 a = _mm256_set1_ps(absmax);
    const __m256 low_half = _mm256_loadu_ps(codec.values), high_half = _mm256_loadu_ps(codec.values + 8);
    const __m256i nibble = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    for (; i + 16 <= n; i += 16) {  // 8 bytes: 16 codes
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i / 2)));
        const __m256i lo = _mm256_and_si256(bytes, nibble), hi = _mm256_srli_epi32(bytes, 4);
        // a 16-entry table: two 8-entry permutes, picked by bit 3 of the code
        const __m256 vlo = _mm256_mul_ps(_mm256_blendv_ps(_mm256_permutevar8x32_ps(low_half, lo), _mm256_permutevar8x32_ps(high_half, lo),
                                                          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(lo, eight), 28))), a);
        const __m256 vhi = _mm256_mul_ps(_mm256_blendv_ps(_mm256_permutevar8x32_ps(low_half, hi), _mm256_permutevar8x32_ps(high_half, hi),
                                                          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(hi, eight), 28))), a);
        const __m256 first = _mm256_unpacklo_ps(vlo, vhi), second = _mm256_unpackhi_ps(vlo, vhi);  // per 128-bit lane
        _mm256_storeu_ps(out + i, _mm256_permute2f128_ps(first, second, 0x20));
        _mm256_storeu_ps(out + i + 8, _mm256_permute2f128_ps(first, second, 0x31));
    }
#endif
    for (; i < n; ++i) out[i] = codec.values[(c[i / 2] >> ((i & 1) * 4)) & 15] * absmax;
}

// quant.Encoder: the code of x / divisor, one table read and integer compares
template <int SHIFT, uint32_t LOWEST, uint32_t HIGHEST, int32_t HALF>
static inline uint32_t encode_one(float x, float divisor, const uint32_t* lut) {
    constexpr uint32_t MASK = (1u << SHIFT) - 1u;
    const float y = x / divisor;
    uint32_t u; std::memcpy(&u, &y, 4);
    uint32_t m = u & 0x7FFFFFFFu;
    m = m < LOWEST ? LOWEST : (m > HIGHEST ? HIGHEST : m);
    const uint32_t entry = lut[((m - LOWEST) >> SHIFT) + ((u >> 31) ? (uint32_t)HALF : 0u)];
    const uint32_t low = (m & MASK) ^ ((u >> 31) ? MASK : 0u);
    return (entry >> 24) + (uint32_t)(low > (entry & MASK));
}

#ifdef FO_AVX2
// lut[cell] for eight cells (each < 2**31), by scalar loads: faster than a gather where gathers run lane by lane
static inline __m256i lut_entries(__m256i cell, const uint32_t* lut) {
    const __m128i lo = _mm256_castsi256_si128(cell), hi = _mm256_extracti128_si256(cell, 1);
    const uint64_t a = (uint64_t)_mm_cvtsi128_si64(lo), b = (uint64_t)_mm_extract_epi64(lo, 1);
    const uint64_t c = (uint64_t)_mm_cvtsi128_si64(hi), d = (uint64_t)_mm_extract_epi64(hi, 1);
    return _mm256_setr_epi32((int)lut[(uint32_t)a], (int)lut[a >> 32], (int)lut[(uint32_t)b], (int)lut[b >> 32],
                             (int)lut[(uint32_t)c], (int)lut[c >> 32], (int)lut[(uint32_t)d], (int)lut[d >> 32]);
}

template <int SHIFT, uint32_t LOWEST, uint32_t HIGHEST, int32_t HALF>
static inline __m256i encode_lanes(__m256 x, __m256 d, const uint32_t* lut) {
    const __m256i mask = _mm256_set1_epi32((int32_t)((1u << SHIFT) - 1u)), magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i lowest = _mm256_set1_epi32((int32_t)LOWEST), highest = _mm256_set1_epi32((int32_t)HIGHEST);
    const __m256i half = _mm256_set1_epi32(HALF), one = _mm256_set1_epi32(1);
    const __m256i u = _mm256_castps_si256(_mm256_div_ps(x, d));
    const __m256i m = _mm256_min_epu32(_mm256_max_epu32(_mm256_and_si256(u, magnitude), lowest), highest);
    const __m256i negative = _mm256_srai_epi32(u, 31);
    const __m256i cell = _mm256_add_epi32(_mm256_srli_epi32(_mm256_sub_epi32(m, lowest), SHIFT), _mm256_and_si256(negative, half));
    const __m256i entry = lut_entries(cell, lut);
    const __m256i low = _mm256_xor_si256(_mm256_and_si256(m, mask), _mm256_and_si256(negative, mask));
    const __m256i split = _mm256_and_si256(entry, mask);  // low > split, unsigned (both < 2**31)
    const __m256i up = _mm256_and_si256(_mm256_cmpgt_epi32(low, split), one);
    return _mm256_add_epi32(_mm256_srli_epi32(entry, 24), up);
}
#endif

#ifdef FO_AVX2
// quant.linear_no_zero's codes of x / d by its exact formula (the reasoning is encode4's, AVX-512 branch)
template <uint32_t HIGHEST>
static inline __m256i linear_lanes(__m256 x, __m256 d) {
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i u = _mm256_castps_si256(_mm256_div_ps(x, d));
    const __m256i m = _mm256_min_epu32(_mm256_and_si256(u, magnitude), _mm256_set1_epi32((int32_t)HIGHEST));
    const __m256 y = _mm256_castsi256_ps(_mm256_or_si256(m, _mm256_andnot_si256(magnitude, u)));  // m's bits, u's sign
    const __m256 t = _mm256_sub_ps(_mm256_mul_ps(y, _mm256_set1_ps(16.0f)), _mm256_set1_ps(1.5f));
    const __m256i code = _mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
    return _mm256_min_epi32(_mm256_max_epi32(code, _mm256_setzero_si256()), _mm256_set1_epi32(15));
}
#endif

// 8-bit codes of x / divisor, one a byte
template <int SHIFT, uint32_t LOWEST, uint32_t HIGHEST, int32_t HALF, bool CELLS>
static inline void encode8(const float* x, int64_t n, float divisor, const Codec& codec, uint8_t* c) {
    int64_t i = 0;
#if defined(FO_AVX512)
    if (CELLS) {
        // The quotient's magnitude is clamped as quant.Encoder clamps it; its exponent picks (per sign) how many
        // mantissa bits cut that octave into cells that hold at most one boundary, and where its cells start;
        // the cell's lowest code comes from a 512-byte table, and one compare with the boundary above that
        // code finds the code. The tables are byte permutes in registers, 64 elements at a time.
        const __m512 d = _mm512_set1_ps(divisor);
        const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), shift_bits = _mm512_set1_epi32(31);
        const __m512i lowest = _mm512_set1_epi32((int32_t)LOWEST), highest = _mm512_set1_epi32((int32_t)HIGHEST);
        const __m512i byte0 = _mm512_loadu_si512(FO_BYTE_ORDERS.byte0), byte1 = _mm512_loadu_si512(FO_BYTE_ORDERS.byte1);
        for (; i + 64 <= n; i += 64) {
            __m512i cell[4];
            __m512 y[4];
            for (int q = 0; q < 4; ++q) {
                const __m512i u = _mm512_castps_si512(_mm512_div_ps(_mm512_loadu_ps(x + i + 16 * q), d));
                const __m512i m = _mm512_min_epu32(_mm512_max_epu32(_mm512_and_si512(u, magnitude), lowest), highest);
                y[q] = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(m, u, magnitude, 0xE4));  // m's bits, u's sign
                const __m512i exponent = _mm512_srli_epi32(m, 23);
                const __m512i octave = _mm512_mask_mov_epi32(
                    _mm512_permutex2var_epi32(codec.octaves[0][0], exponent, codec.octaves[0][1]), _mm512_movepi32_mask(u),
                    _mm512_permutex2var_epi32(codec.octaves[1][0], exponent, codec.octaves[1][1]));
                cell[q] = _mm512_add_epi32(_mm512_srlv_epi32(m, _mm512_and_si512(octave, shift_bits)), _mm512_srai_epi32(octave, 5));
            }
            // cells < 512: their low and high bytes, 64 to a vector, in element order
            const __mmask64 upper = 0xFFFFFFFF00000000ull;
            const __m512i low = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(cell[0], byte0, cell[1]),
                                                       _mm512_permutex2var_epi8(cell[2], byte0, cell[3]));
            const __m512i high = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(cell[0], byte1, cell[1]),
                                                        _mm512_permutex2var_epi8(cell[2], byte1, cell[3]));
            const __mmask64 bit7 = _mm512_movepi8_mask(low), bit8 = _mm512_test_epi8_mask(high, _mm512_set1_epi8(1));
            const __m512i first = _mm512_mask_blend_epi8(bit7, _mm512_permutex2var_epi8(codec.cells[0], low, codec.cells[1]),
                                                         _mm512_permutex2var_epi8(codec.cells[2], low, codec.cells[3]));
            const __m512i second = _mm512_mask_blend_epi8(bit7, _mm512_permutex2var_epi8(codec.cells[4], low, codec.cells[5]),
                                                          _mm512_permutex2var_epi8(codec.cells[6], low, codec.cells[7]));
            const __m512i code = _mm512_mask_blend_epi8(bit8, first, second);
            __m512i bound[4];
            lookup64(codec.bound_planes, code, bound);
            __mmask16 above[4];
            for (int q = 0; q < 4; ++q) above[q] = _mm512_cmp_ps_mask(y[q], _mm512_castsi512_ps(bound[q]), _CMP_GT_OQ);
            const __mmask64 up = _mm512_kunpackd(_mm512_kunpackw(above[3], above[2]), _mm512_kunpackw(above[1], above[0]));
            _mm512_storeu_si512(c + i, _mm512_mask_add_epi8(code, up, code, _mm512_set1_epi8(1)));
        }
    }
    const __m256 d = _mm256_set1_ps(divisor);
    for (; i + 16 <= n; i += 16) {
        const __m256i first = encode_lanes<SHIFT, LOWEST, HIGHEST, HALF>(_mm256_loadu_ps(x + i), d, codec.lut);
        const __m256i second = encode_lanes<SHIFT, LOWEST, HIGHEST, HALF>(_mm256_loadu_ps(x + i + 8), d, codec.lut);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), _mm512_cvtepi32_epi8(_mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1)));
    }
#elif defined(FO_AVX2)
    const __m256 d = _mm256_set1_ps(divisor);
    const __m128i in_order = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    for (; i + 16 <= n; i += 16) {  // 16 codes: two encodes in flight, packed per 128-bit lane, then put in order
        const __m256i first = encode_lanes<SHIFT, LOWEST, HIGHEST, HALF>(_mm256_loadu_ps(x + i), d, codec.lut);
        const __m256i second = encode_lanes<SHIFT, LOWEST, HIGHEST, HALF>(_mm256_loadu_ps(x + i + 8), d, codec.lut);
        const __m256i words = _mm256_packus_epi32(first, second);
        const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), _mm_shuffle_epi8(bytes, in_order));
    }
    for (; i + 8 <= n; i += 8) {  // 8 codes (< 256) packed to bytes
        const __m256i code = encode_lanes<SHIFT, LOWEST, HIGHEST, HALF>(_mm256_loadu_ps(x + i), d, codec.lut);
        const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(c + i), _mm_packus_epi16(words, words));
    }
#endif
    for (; i < n; ++i) c[i] = (uint8_t)encode_one<SHIFT, LOWEST, HIGHEST, HALF>(x[i], divisor, codec.lut);
}

// 4-bit codes of x / divisor, two a byte (the first in the low nibble; an odd last code: high nibble 0)
template <int SHIFT, uint32_t LOWEST, uint32_t HIGHEST, int32_t HALF, bool LINEAR>
static inline void encode4(const float* x, int64_t n, float divisor, const Codec& codec, uint8_t* c) {
    int64_t i = 0;
#if defined(FO_AVX512)
    if (LINEAR) {
        // quant.linear_no_zero: boundaries (k + 1.5) / 16, so the code is ceil(16 y - 1.5) clamped to [0, 15].
        // Both steps are exact where the code is not 0 (16 y >= 0.75: Sterbenz up to 3, above it 1.5 is a
        // multiple of 16 y's ulp); below, the difference stays negative. A NaN reads as +-1, as the encoder's
        // clamp reads it.
        const __m512 d = _mm512_set1_ps(divisor), sixteen = _mm512_set1_ps(16.0f), offset = _mm512_set1_ps(1.5f);
        const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), highest = _mm512_set1_epi32((int32_t)HIGHEST);
        const __m512i zero = _mm512_setzero_si512(), fifteen = _mm512_set1_epi32(15);
        for (; i + 16 <= n; i += 16) {
            const __m512i u = _mm512_castps_si512(_mm512_div_ps(_mm512_loadu_ps(x + i), d));
            const __m512i m = _mm512_min_epu32(_mm512_and_si512(u, magnitude), highest);
            const __m512 y = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(m, u, magnitude, 0xE4));  // m's bits, u's sign
            const __m512 t = _mm512_sub_ps(_mm512_mul_ps(y, sixteen), offset);
            const __m512i code = _mm512_min_epi32(_mm512_max_epi32(
                _mm512_cvt_roundps_epi32(t, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC), zero), fifteen);
            _mm_storel_epi64(reinterpret_cast<__m128i*>(c + i / 2), _mm512_cvtepi64_epi8(_mm512_or_si512(code, _mm512_srli_epi64(code, 28))));
        }
    }
    // the code is the count of boundaries below the quotient: a binary search over the 15 boundaries held in
    // one register. The quotient's magnitude is first clamped to [LOWEST, HIGHEST] as quant.Encoder clamps
    // it (no boundary lies outside, and a NaN reads as +-1), so the float compares see no NaN.
    const __m512 d = _mm512_set1_ps(divisor);
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i lowest = _mm512_set1_epi32((int32_t)LOWEST), highest = _mm512_set1_epi32((int32_t)HIGHEST);
    for (; i + 64 <= n; i += 64) {  // four vectors at a time: four searches in flight
        __m512 y[4];
        __m512i code[4];
        for (int q = 0; q < 4; ++q) {
            const __m512i u = _mm512_castps_si512(_mm512_div_ps(_mm512_loadu_ps(x + i + 16 * q), d));
            const __m512i m = _mm512_min_epu32(_mm512_max_epu32(_mm512_and_si512(u, magnitude), lowest), highest);
            y[q] = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(m, u, magnitude, 0xE4));  // m's bits, u's sign
            code[q] = _mm512_setzero_si512();
        }
        for (int step = 8; step >= 1; step /= 2)
            for (int q = 0; q < 4; ++q) {
                const __m512 bound = _mm512_permutexvar_ps(_mm512_add_epi32(code[q], _mm512_set1_epi32(step - 1)), codec.bounds);
                code[q] = _mm512_mask_add_epi32(code[q], _mm512_cmp_ps_mask(y[q], bound, _CMP_GT_OQ), code[q], _mm512_set1_epi32(step));
            }
        // pairs of codes (one 64-bit lane each) into one byte: low code | high code << 4
        for (int q = 0; q < 4; ++q)
            _mm_storel_epi64(reinterpret_cast<__m128i*>(c + (i + 16 * q) / 2),
                             _mm512_cvtepi64_epi8(_mm512_or_si512(code[q], _mm512_srli_epi64(code[q], 28))));
    }
#elif defined(FO_AVX2)
    const __m256 d = _mm256_set1_ps(divisor);
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (; i + 16 <= n; i += 16) {  // 16 codes: pairs (one 64-bit lane each) to bytes, low code | high code << 4
        __m256i pairs[2];
        for (int h = 0; h < 2; ++h) {
            const __m256 xs = _mm256_loadu_ps(x + i + 8 * h);
            const __m256i code = LINEAR ? linear_lanes<HIGHEST>(xs, d) : encode_lanes<SHIFT, LOWEST, HIGHEST, HALF>(xs, d, codec.lut);
            pairs[h] = _mm256_permutevar8x32_epi32(_mm256_or_si256(code, _mm256_srli_epi64(code, 28)), even);
        }
        const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(pairs[0]), _mm256_castsi256_si128(pairs[1]));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(c + i / 2), _mm_packus_epi16(words, words));
    }
#endif
    for (; i + 1 < n; i += 2)
        c[i / 2] = (uint8_t)(encode_one<SHIFT, LOWEST, HIGHEST, HALF>(x[i], divisor, codec.lut) |
                             (encode_one<SHIFT, LOWEST, HIGHEST, HALF>(x[i + 1], divisor, codec.lut) << 4));
    if (i < n) c[i / 2] = (uint8_t)encode_one<SHIFT, LOWEST, HIGHEST, HALF>(x[i], divisor, codec.lut);
}
#endif  // FO_CODEC_HPP
