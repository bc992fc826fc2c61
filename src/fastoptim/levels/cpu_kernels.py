"""The fused level's CPU kernel for 16/8/4-bit state: load, update, store, in one pass over memory.

torch's fused CPU kernels take plain fp32 state only, and Inductor's code for a block-wise quantized step
(gathers scalarised, the block's absmax a separate pass over fp32 temporaries) ran 18x slower than
torch's fused fp32 step. So the fused level carries a small C++ kernel of its own, generated per rule,
FLAGS and state formats:

* the rule's math is the rule's own ``update``, traced into C++ (``cpp_twin``): byte for byte the rule's
  IEEE fp32 math on the stored values (torch's own CPU ``sqrt`` is not correctly rounded in every lane, so
  the loop level is within an ulp of it, not always equal);
* per block of one row (the codec's blocks: 256 elements at 8 bits, 128 at 4; 256-element pieces at
  16 bits), every state is loaded into an fp32 array that stays in L1 (codes decoded through the map, times
  the block's absmax; bf16 widened), the update runs over them with p and g read in place (taking each
  quantized state's new absmax as it goes), and each state is stored back: bf16 rounded to nearest even,
  quantized states as the codes ``quant.Encoder`` gives;
* the codec has three builds under ``#if``, all exact: AVX-512 (with VBMI: 8-bit codes decoded and encoded
  by byte permutes over tables held in registers, 64 elements at a time, no gathers; see ``cell_tables``;
  4-bit codes by one permute, encoded by a search over the boundaries in a register or, for the linear map,
  its exact formula), AVX2 (the map and ``quant.Encoder``'s table read lane by lane with scalar loads, which
  a Zen 3 runs 1.4-1.5x faster than gathers), and scalar. On a Zen 4,
  one thread, 24M params, the AVX-512 build's AdamW step took 0.53x (8-bit) and 0.55x (4-bit) the CPU time
  of the AVX2 build; encoding is still over half of the 8-bit step;
* one call per bucket: a table of the tensors (one int64 row each) and the step's scalars in memory, so
  schedules never rebuild anything; the blocks are split among ``torch.get_num_threads()`` threads (ctypes
  releases the GIL), in chunks taken in turn, so no second OpenMP runtime is loaded beside torch's.

The source is compiled once per machine with the system C++ compiler (``$CXX``, else ``c++``/``g++``/
``clang++``) into a cache folder (``$FASTOPTIM_CACHE``, else ``~/.cache/fastoptim``), written atomically.
Where there is no compiler or the build fails, ``available()`` says why, the fused level warns once and
the bucket runs staged (the numbers are the same; only the speed differs).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Callable, Sequence

import torch
from torch import Tensor

from . import cpp_twin
from .. import bulk, storage
from ..storage import Format, quant

CXXFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared",
            "-fPIC", "-std=c++17")
PIECE = 256  # elements per work item at 16 bits (no codec block there)
CHUNK_BLOCKS = 64  # the fewest blocks a thread takes at a time
CHUNKS_PER_THREAD = 8


class KernelUnavailable(RuntimeError):
    """No C++ compiler here, or the kernel failed to build: the caller runs the staged path."""


# --- formats a kernel takes -------------------------------------------------------------------------

def signature(params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[list | None], i: int):
    """The state formats of param ``i`` when the kernel takes it whole (fp32, contiguous, every active state
    16/8/4-bit and of one width), else None."""
    return storage.kernel_signature(params, grads, states, i)


# --- the generated source ----------------------------------------------------------------------------

PRELUDE = r"""
#include <atomic>
#include <cstdint>
#include <cstring>
#include <cmath>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VBMI__)
#include <immintrin.h>
#define FO_AVX512 1
#define FO_AVX2 1
#elif defined(__AVX2__)
#include <immintrin.h>
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
static inline uint32_t magnitude_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u & 0x7FFFFFFFu; }
static inline float from_bits(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// bf16 <-> fp32 as torch converts: widening is exact; narrowing rounds to nearest even, NaN stays quiet NaN
static inline void bf16_load(const uint16_t* src, int64_t n, float* out) {
    for (int64_t i = 0; i < n; ++i) { uint32_t u = (uint32_t)src[i] << 16; std::memcpy(out + i, &u, 4); }
}
static inline void bf16_store(const float* in, int64_t n, uint16_t* dst) {
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u; std::memcpy(&u, in + i, 4);
        const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        dst[i] = in[i] != in[i] ? (uint16_t)0x7FC0 : (uint16_t)rounded;
    }
}

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
    idx = _mm512_permutexvar_epi8(_mm512_loadu_si512(FO_INTERLEAVE_ORDER), idx);
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
    // eight table reads by scalar loads, not a gather: 1.5x faster on a Zen 3 (gathers there cost 2 cycles a lane)
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
// lut[cell] for eight cells (each < 2**31), by scalar loads: 1.4x faster than a gather on a Zen 3
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
        const __m512i byte0 = _mm512_loadu_si512(FO_DWORD_BYTE0), byte1 = _mm512_loadu_si512(FO_DWORD_BYTE1);
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
"""


def _interleave_order() -> str:
    """The byte order that decode8's in-lane interleave (bytes -> words -> dwords) turns into code order: the
    dword for code 16q + 4l + e comes from byte 16l + 4q + e (q: output vector, l: 128-bit lane, e: element)."""
    order = [0] * 64
    for q in range(4):
        for lane in range(4):
            for e in range(4):
                order[16 * lane + 4 * q + e] = 16 * q + 4 * lane + e
    byte0 = [4 * (k % 32) for k in range(64)]  # byte 0 of dword k % 32 of a pair of vectors
    return (f"alignas(64) static const uint8_t FO_INTERLEAVE_ORDER[64] = {{{', '.join(map(str, order))}}};\n"
            f"alignas(64) static const uint8_t FO_DWORD_BYTE0[64] = {{{', '.join(map(str, byte0))}}};\n"
            f"alignas(64) static const uint8_t FO_DWORD_BYTE1[64] = {{{', '.join(str(b + 1) for b in byte0)}}};\n")


PRELUDE = PRELUDE.replace("// one quantized state's map", _interleave_order() + "\n// one quantized state's map", 1)


def _column_names(formats: Sequence[Format | None]) -> list[str]:
    """The int64 columns of one tensor's row in the table."""
    cols = ["first_block", "rows", "length", "p", "g"]
    for k, fmt in enumerate(formats):
        if fmt is None:
            continue
        cols += [f"s{k}_codes", f"s{k}_absmax"] if fmt.quantized else [f"s{k}"]
    return cols


@lru_cache(maxsize=None)
def cell_tables(qmap: quant.QuantMap) -> tuple[list[int], list[int], list[float]] | None:
    """The AVX-512 8-bit encoder's tables for ``qmap`` (None where they do not fit: it then reads
    ``quant.Encoder``'s table lane by lane: slower).

    ``quant.Encoder`` cuts every octave of magnitudes into the same number of cells; here each octave (per
    sign) takes the fewest leading mantissa bits that leave at most one boundary in a cell, so all cells fit
    in 512 bytes. Per octave (index ``32 * sign + (exponent & 31)``): ``(adjust << 5) | shift``, the cell of
    magnitude bits ``m`` being ``(m >> shift) + adjust``; per cell: its lowest code; and the 255 boundaries
    and 2.0. A cell's code is its lowest code, plus one where the value is above the boundary that follows
    that code (the one boundary inside the cell, if any). Checked here on every cell's ends with the
    encoder itself."""
    enc = quant.encoder(qmap)
    first_exponent, last_exponent = enc.lowest >> 23, enc.highest >> 23
    if qmap.bits != 8 or last_exponent - first_exponent >= 32:
        return None

    def codes(magnitudes: list[int], negative: bool) -> list[int]:
        bits = torch.tensor(magnitudes, dtype=torch.int64) | ((1 << 31) if negative else 0)
        bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
        return enc.encode(bits.view(torch.float32)).tolist()

    octaves, cells = [0] * 64, []
    for sign in (0, 1):
        for exponent in range(first_exponent, last_exponent + 1):
            low, high = max(enc.lowest, exponent << 23), min(enc.highest, ((exponent + 1) << 23) - 1)
            for shift in range(23, -1, -1):
                index = range(low >> shift, (high >> shift) + 1)
                at_low = codes([max(k << shift, low) for k in index], bool(sign))
                at_high = codes([min(((k + 1) << shift) - 1, high) for k in index], bool(sign))
                if all(abs(a - b) <= 1 for a, b in zip(at_low, at_high)):
                    break
            octaves[32 * sign + (exponent & 31)] = ((len(cells) - index[0]) << 5) | shift
            cells += [min(a, b) for a, b in zip(at_low, at_high)]
    if len(cells) > 512:
        return None
    bounds = qmap.boundaries().tolist() + [2.0]
    return octaves, cells + [0] * (512 - len(cells)), bounds


def kernel_source(update: Callable, flags: tuple, formats: tuple, n_scalars: int, has_grad_mul: bool) -> str:
    """C++ for one rule, FLAGS and state formats: ``fo_step(table, n_tensors, begin, end, scalars, grad_mul,
    maps)`` runs global blocks ``[begin, end)`` of the tensors in ``table``."""
    bits = next(f.bits for f in formats if f is not None)
    block = quant.BLOCK[bits] if bits in (8, 4) else PIECE
    cols = _column_names(formats)
    col = {name: k for k, name in enumerate(cols)}
    active = [k for k, f in enumerate(formats) if f is not None]
    quantized = [k for k in active if formats[k].quantized]
    lines, outputs = cpp_twin.trace(update, ["p_", "g_"] + [f"s{k}_" if f is not None else "" for k, f in
                                                            enumerate(formats)],
                                    [f"sc[{k}]" for k in range(n_scalars)], flags)
    body = "\n".join(f"            {line}" for line in lines)
    writes = [f"            P[i] = {outputs[0]};"]
    writes += [f"            S{k}[i] = {outputs[1 + k]};" for k in active]
    # each quantized state's absmax, taken as its new values are written (no pass of its own)
    writes += [f"            top{k} = top{k} > magnitude_bits({outputs[1 + k]}) ? top{k} : magnitude_bits({outputs[1 + k]});"
               for k in quantized]

    constants, codecs, loads, stores, probes = [], [], [], [], []
    for k in active:
        fmt = formats[k]
        if fmt.bits == 16:
            ptr = f"reinterpret_cast<uint16_t*>(row[{col[f's{k}']}]) + at"
            loads.append(f"        bf16_load({ptr}, n, S{k});")
            stores.append(f"        bf16_store(S{k}, n, {ptr});")
            continue
        bounds = octaves = cells = "nullptr"
        if fmt.bits == 4:
            literals = ", ".join(cpp_twin._literal(v) for v in fmt.qmap.boundaries().tolist())
            constants.append(f"static const float BOUNDS{k}[15] = {{{literals}}};")
            bounds = f"BOUNDS{k}"
        tables = cell_tables(fmt.qmap) if fmt.bits == 8 else None
        if tables is not None:
            octave_table, cell_table, bound_table = tables
            constants.append(f"static const int32_t OCTAVES{k}[64] = {{{', '.join(map(str, octave_table))}}};")
            constants.append(f"static const uint8_t CELLS{k}[512] = {{{', '.join(map(str, cell_table))}}};")
            constants.append(f"static const float BOUNDS{k}[256] = {{{', '.join(cpp_twin._literal(v) for v in bound_table)}}};")
            bounds, octaves, cells = f"BOUNDS{k}", f"OCTAVES{k}", f"CELLS{k}"
        codecs.append(f"    const Codec codec{k} = make_codec(maps[{2 * k}], maps[{2 * k + 1}], {bounds}, {octaves}, {cells}, "
                      f"{fmt.bits});")
        codes = f"reinterpret_cast<uint8_t*>(row[{col[f's{k}_codes']}])"
        codes += " + at" if fmt.bits == 8 else f" + r * ((length + 1) / 2) + j * {block // 2}"
        absmax = f"reinterpret_cast<float*>(row[{col[f's{k}_absmax']}])[r * nblocks + j]"
        enc = quant.encoder(fmt.qmap)
        if fmt.bits == 4:
            linear = fmt.qmap.boundaries().tolist() == [(k + 1.5) / 16 for k in range(15)]
            cells_flag = ", true" if linear else ", false"
        else:
            cells_flag = ", true" if tables is not None else ", false"
        loads.append(f"        decode{fmt.bits}({codes}, n, codec{k}, {absmax}, S{k});")
        encode = f"encode{fmt.bits}<{enc.shift}, {enc.lowest}u, {enc.highest}u, {enc.half}{cells_flag}>"
        probes.append(f"""    if (k == {k}) {{
        const Codec codec = make_codec(maps[{2 * k}], maps[{2 * k + 1}], {bounds}, {octaves}, {cells}, {fmt.bits});
        if (x) {{
            uint32_t top = 0;
            for (int64_t i = 0; i < n; ++i) top = top > magnitude_bits(x[i]) ? top : magnitude_bits(x[i]);
            *absmax = from_bits(top);
            {encode}(x, n, *absmax == 0.0f ? 1.0f : *absmax, codec, codes);
        }} else {{
            decode{fmt.bits}(codes, n, codec, *absmax, out);
        }}
    }}""")
        stores.append(f"""        {{ const float amax = from_bits(top{k});
          encode{fmt.bits}<{enc.shift}, {enc.lowest}u, {enc.highest}u, {enc.half}{cells_flag}>(S{k}, n, amax == 0.0f ? 1.0f : amax, codec{k}, {codes});
          {absmax} = amax; }}""")

    arrays = " ".join(f"alignas(64) float S{k}[{block}];" for k in active)
    tops = " ".join(f"uint32_t top{k} = 0;" for k in quantized)
    grad = "G[i] * gm" if has_grad_mul else "G[i]"
    reads = "\n".join(f"            const float s{k}_ = S{k}[i];" for k in active)
    return PRELUDE + "\n".join(constants) + f"""
extern "C" void fo_step(const int64_t* table, int64_t n_tensors, int64_t begin, int64_t end,
                        const float* sc, const float* grad_mul, const void* const* maps) {{
    const int64_t width = {len(cols)};
    const float gm = grad_mul ? *grad_mul : 1.0f;
    (void)gm; (void)maps;
{chr(10).join(codecs)}
    // the block walk: tensor t, row r, block j of the row (one division, at the start)
    int64_t t = 0;
    while (t + 1 < n_tensors && table[(t + 1) * width] <= begin) ++t;
    const int64_t* row = table + t * width;
    int64_t length = row[{col['length']}], nblocks = (length + {block - 1}) / {block};
    int64_t r = (begin - row[{col['first_block']}]) / nblocks, j = (begin - row[{col['first_block']}]) % nblocks;
    for (int64_t b = begin; b < end; ++b) {{
        const int64_t at = r * length + j * {block};
        const int64_t rest = length - j * {block};
        const int64_t n = rest < {block} ? rest : {block};
        float* __restrict__ P = reinterpret_cast<float*>(row[{col['p']}]) + at;
        const float* __restrict__ G = reinterpret_cast<const float*>(row[{col['g']}]) + at;
        {arrays}
        {tops}
{chr(10).join(loads)}
        for (int64_t i = 0; i < n; ++i) {{
            const float p_ = P[i];
            const float g_ = {grad};
{reads}
{body}
{chr(10).join(writes)}
        }}
{chr(10).join(stores)}
        if (++j == nblocks) {{  // the next block: the row's next, the next row's first, or the next tensor's first
            j = 0;
            if (++r == row[{col['rows']}] && t + 1 < n_tensors) {{
                r = 0;
                row = table + ++t * width;
                length = row[{col['length']}];
                nblocks = (length + {block - 1}) / {block};
            }}
        }}
    }}
}}

// fo_step over chunks [cuts[k], cuts[k + 1]), taken in turn by the threads of a team of the OpenMP runtime torch
// runs on (its GOMP_parallel, found by the caller): torch's own worker threads, which spin a while after each torch
// op, take the work, instead of spinning beside threads of ours on the same cores
struct FoJob {{
    const int64_t* table; int64_t n_tensors; const int64_t* cuts; int64_t n_chunks;
    const float* sc; const float* grad_mul; const void* const* maps; std::atomic<int64_t> next;
}};
static void fo_worker(void* data) {{
    FoJob* job = static_cast<FoJob*>(data);
    for (int64_t k; (k = job->next.fetch_add(1)) < job->n_chunks;)
        fo_step(job->table, job->n_tensors, job->cuts[k], job->cuts[k + 1], job->sc, job->grad_mul, job->maps);
}}
extern "C" void fo_step_team(void* gomp_parallel, uint32_t threads, const int64_t* table, int64_t n_tensors,
                             const int64_t* cuts, int64_t n_chunks, const float* sc, const float* grad_mul,
                             const void* const* maps) {{
    FoJob job{{table, n_tensors, cuts, n_chunks, sc, grad_mul, maps, {{0}}}};
    reinterpret_cast<void (*)(void (*)(void*), void*, unsigned, unsigned)>(gomp_parallel)(fo_worker, &job, threads, 0);
}}

// the codec of state k on one block, as fo_step runs it (for tests): x given, its codes and absmax; else the
// values of codes and absmax
extern "C" void fo_codec(const void* const* maps, int64_t k, const float* x, int64_t n, uint8_t* codes, float* absmax,
                         float* out) {{
    (void)maps; (void)k; (void)x; (void)n; (void)codes; (void)absmax; (void)out;
{chr(10).join(probes)}
}}
"""


# --- building -------------------------------------------------------------------------------------------

def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def required_compiler() -> str:
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler found (set CXX, or install g++ or clang++)")
    return cxx


def cache_dir() -> str:
    return os.environ.get("FASTOPTIM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fastoptim")


BUILD_TIMEOUT_S = 300


@lru_cache(maxsize=None)
def _target(cxx: str) -> str:
    """What ``-march=native`` means on this machine, as the compiler sees it (its predefined macros): part of a
    built kernel's name, so a cache folder shared by machines of other CPUs never loads a kernel built for
    instructions this one lacks."""
    try:
        done = subprocess.run([cxx, "-march=native", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{os.path.basename(cxx)} could not be run: {e}") from None
    if done.returncode != 0:
        raise KernelUnavailable(f"{os.path.basename(cxx)} does not take -march=native: {done.stderr.strip()[-500:]}")
    return "\n".join(sorted(done.stdout.splitlines()))


def _build(cxx: str, source: str, path: str, flags: Sequence[str], libraries: Sequence[str] = ()) -> None:
    """Compile ``source`` into the shared library ``path`` (written atomically); ``libraries``: linker flags
    after the source."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        src = os.path.join(work, "kernel.cpp")
        with open(src, "w") as f:
            f.write(source)
        built = os.path.join(work, "kernel.so")
        try:
            done = subprocess.run([cxx, *flags, src, "-o", built, *libraries], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except subprocess.SubprocessError as e:
            raise KernelUnavailable(f"{os.path.basename(cxx)} failed to build the kernel: {e}") from None
        if done.returncode != 0:
            raise KernelUnavailable(f"{os.path.basename(cxx)} failed to build the kernel: "
                                    f"{done.stderr.strip()[-2000:]}")
        os.replace(built, path)  # atomic: a concurrent build of the same source writes the same bytes


def load_built(load: Callable, cxx: str, source: str, path: str, flags: Sequence[str],
               libraries: Sequence[str] = ()):
    """``load(path)`` of the library built from ``source`` at ``path`` in the cache folder (built there first
    where missing; a cached file that does not load is built again once). A folder that cannot be written or a
    file that still does not load raises ``KernelUnavailable``."""
    try:
        for attempt in (0, 1):
            if not os.path.exists(path):
                _build(cxx, source, path, flags, libraries)
            try:
                return load(path)
            except (OSError, ImportError):
                if attempt:
                    raise
                os.remove(path)  # cut short or damaged: built again
    except (OSError, ImportError) as e:
        raise KernelUnavailable(f"the kernel cache {cache_dir()!r} is not usable ({e}); set FASTOPTIM_CACHE "
                                "to a writable folder") from None
    raise AssertionError("unreachable")


@lru_cache(maxsize=None)
def _library(source: str) -> ctypes.CDLL:
    """The built kernel (``load_built``); no compiler or a failed build raises ``KernelUnavailable``."""
    cxx = required_compiler()
    key = hashlib.sha256("\0".join((source, cxx, *CXXFLAGS, sys.platform, _target(cxx))).encode()).hexdigest()[:24]
    lib = load_built(ctypes.CDLL, cxx, source, os.path.join(cache_dir(), f"kernel_{key}.so"), CXXFLAGS)
    lib.fo_step.restype = None
    lib.fo_step.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_void_p]
    lib.fo_step_team.restype = None
    lib.fo_step_team.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


@lru_cache(maxsize=None)
def kernel(update: Callable, flags: tuple, formats: tuple, n_scalars: int, has_grad_mul: bool) -> ctypes.CDLL:
    return _library(kernel_source(update, flags, formats, n_scalars, has_grad_mul))


def _probe() -> ctypes.CDLL:
    """A tiny kernel (SGD, 16-bit state): what ``available`` and ``simd_width`` build to find out."""
    from ..rules.sgd import sgd_update

    return kernel(sgd_update, (False, False, True, False), (Format(16),), 5, False)


@lru_cache(maxsize=1)
def available() -> str | None:
    """None when kernels build here, else why not (checked once, on a tiny kernel)."""
    try:
        _probe()
    except KernelUnavailable as e:
        return str(e)
    return None


@lru_cache(maxsize=1)
def simd_width() -> int | None:
    """The vector width in bits that this machine's kernels run the codec at: 512 (AVX-512), 256 (AVX2) or 0
    (scalar); None where no kernel builds here."""
    return None if available() is not None else _probe().fo_simd_width()


@lru_cache(maxsize=None)
def _map_pointers(formats: tuple) -> tuple:
    """Per state: the map's values and the encoder's table (kept alive here)."""
    tensors = []
    for fmt in formats:
        quantized = fmt is not None and fmt.quantized
        tensors += [fmt.qmap.table(), quant.encoder(fmt.qmap).lut] if quantized else [None, None]
    array = (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])
    return tensors, array


@lru_cache(maxsize=1)
def omp_parallel() -> int | None:
    """The address of ``GOMP_parallel`` in the OpenMP runtime this process has loaded for torch (libgomp, or
    LLVM's and Intel's runtimes, which export it too), or None: the kernel's threads are then our own."""
    if os.environ.get("FASTOPTIM_OWN_THREADS"):
        return None
    try:
        with open("/proc/self/maps") as f:
            loaded = {line.split()[-1] for line in f if ".so" in line}
    except OSError:
        return None
    runtimes = [path for path in loaded if os.path.basename(path).startswith(("libgomp", "libomp", "libiomp5"))]
    torch_lib = os.path.dirname(torch.__file__)
    for path in sorted(runtimes, key=lambda path: (not path.startswith(torch_lib), path)):  # torch's own first
        try:
            return ctypes.cast(ctypes.CDLL(path).GOMP_parallel, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
    return None


_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, 1), thread_name_prefix="fastoptim")
    return _pool


def _rows(p: Tensor, fmt: Format) -> tuple[int, int, int]:
    """(rows, length, blocks) the kernel walks: the codec's rows and blocks, or 16-bit pieces."""
    if fmt.quantized:
        rows, length = quant.rows_of(p.shape)
        return rows, length, rows * -(-length // fmt.block)
    return 1, p.numel(), -(-p.numel() // PIECE)


GRAD_COLUMN = 4  # where a row of the table holds its grad's address (``_column_names``)


class Table:
    """The kernel's table of tensors (one int64 row each: first block, rows, length and the addresses of p, g
    and the states) for tensors that all have state ``formats``. Made once per bucket: params and state
    tensors are written in place while the step plan holds them (a replaced one makes a new plan, and so a
    new table); grads may be new tensors every step, so their addresses are checked, at C speed, each step,
    and so are the states' (``share_memory_()`` moves a state's storage in place: ``states_moved``)."""

    def __init__(self, params: list[Tensor], grads: list[Tensor], states: list[list | None], formats: tuple,
                 pools: Sequence[Tensor] = ()):
        """``pools``: buffers that states are views of (flat mode's), each watched once instead of each view."""
        self.formats = formats
        fmt = next(f for f in formats if f is not None)
        rows_table, first, self.state_tensors = [], 0, []
        for i, (p, g) in enumerate(zip(params, grads)):
            rows, length, blocks = _rows(p, fmt)
            row = [first, rows, length, p.data_ptr(), g.data_ptr()]
            for column, f in zip(states, formats):
                if f is None:
                    continue
                s = column[i]
                tensors = [s.codes, s.absmax] if f.quantized else [s]
                self.state_tensors += tensors
                row += map(Tensor.data_ptr, tensors)
            rows_table.append(row)
            first += blocks
        self.table = torch.tensor(rows_table, dtype=torch.int64)
        self.blocks = first
        self.grad_addresses = [row[GRAD_COLUMN] for row in rows_table]
        # states on a pool's storage move together: one of them is watched, and keeps the storage (and so the
        # others' memory) alive; any other state is watched on its own (a user's states may share a storage and
        # one of them be re-pointed: it must be seen)
        pooled = {t.untyped_storage()._cdata for t in pools}
        watched = {}
        for t in self.state_tensors:
            key = t.untyped_storage()._cdata
            watched.setdefault(("pool", key) if key in pooled else ("own", id(t)), t)
        self.state_tensors = list(watched.values())
        self.state_addresses = bulk.layouts(self.state_tensors, shapes=False)

    def states_moved(self) -> bool:
        """Whether a state's storage lies elsewhere than the table says (the kernel would write freed memory)."""
        return bulk.layouts(self.state_tensors, shapes=False) != self.state_addresses

    def point_at(self, grads: list[Tensor]) -> None:
        """This step's grads (the same shapes; contiguous, as ``signature`` checked)."""
        addresses = list(map(Tensor.data_ptr, grads))
        if addresses != self.grad_addresses:
            self.table[:, GRAD_COLUMN] = torch.tensor(addresses, dtype=torch.int64)
            self.grad_addresses = addresses


def run(update: Callable, table: Table, scalars: Tensor, flags: tuple, grad_mul: Tensor | None) -> None:
    """One step over the tensors of ``table``; ``scalars`` is the step's fp32 scalars on the CPU, ``grad_mul``
    a 0-d fp32 CPU tensor or None."""
    formats, first = table.formats, table.blocks
    lib = kernel(update, tuple(flags), formats, scalars.numel(), grad_mul is not None)
    _, maps = _map_pointers(formats)
    gm = None if grad_mul is None else grad_mul.data_ptr()
    threads = max(1, min(torch.get_num_threads(), first // CHUNK_BLOCKS))
    args = (table.table.data_ptr(), len(table.grad_addresses))
    if threads == 1:
        lib.fo_step(*args, 0, first, scalars.data_ptr(), gm, maps)
        return
    # more chunks than threads, taken in turn: a thread the OS holds back (a busy machine) leaves its share
    # to the others instead of keeping every thread waiting for it
    n_chunks = max(threads, min(threads * CHUNKS_PER_THREAD, first // CHUNK_BLOCKS))
    cuts = [first * k // n_chunks for k in range(n_chunks + 1)]
    team = omp_parallel()
    if team is not None:
        bounds = torch.tensor(cuts, dtype=torch.int64)
        lib.fo_step_team(team, threads, *args, bounds.data_ptr(), n_chunks, scalars.data_ptr(), gm, maps)
        return
    turns = itertools.count()  # next() on it is atomic under the GIL

    def work():
        while (k := next(turns)) < n_chunks:
            lib.fo_step(*args, cuts[k], cuts[k + 1], scalars.data_ptr(), gm, maps)

    jobs = [_threads().submit(work) for _ in range(threads)]
    for job in jobs:
        job.result()
