"""The fused level's CPU kernel for 16/8/4-bit state: load, update, store, in one pass over memory.

torch's fused CPU kernels take plain fp32 state only, and Inductor's code for a block-wise quantized step
(gathers scalarised, the block's absmax a separate pass over fp32 temporaries) ran 18x slower than
torch's fused fp32 step. So the fused level carries a small C++ kernel of its own, generated per rule,
FLAGS and state formats:

* the rule's math is the rule's own ``update``, traced into C++ (``cpp_twin``): byte for byte the rule's
  IEEE fp32 math on the stored values (torch's own CPU ``sqrt`` is not correctly rounded in every lane, so
  the loop level is within an ulp of it, not always equal);
* per block of one row (the codec's blocks: 256 elements at 8 bits, 128 at 4; 256-element pieces at
  16 bits), p, g and every state are loaded into fp32 arrays that stay in L1 (codes decoded through the
  map, times the block's absmax; bf16 widened), the update runs over them, and each state is stored back:
  bf16 rounded to nearest even, quantized states with the block's new absmax and the codec's own
  nearest-code tables (``quant.Encoder``);
* one call per bucket: a table of the tensors (one int64 row each) and the step's scalars in memory, so
  schedules never rebuild anything; the blocks are split among ``torch.get_num_threads()`` threads (ctypes
  releases the GIL), so no second OpenMP runtime is loaded beside torch's.

The source is compiled once per machine with the system C++ compiler (``$CXX``, else ``c++``/``g++``/
``clang++``) into a cache folder (``$FASTOPTIM_CACHE``, else ``~/.cache/fastoptim``), written atomically.
Where there is no compiler or the build fails, ``available()`` says why, the fused level warns once and
the bucket runs staged (the numbers are the same; only the speed differs).
"""

from __future__ import annotations

import ctypes
import hashlib
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
from ..storage import Format, QuantizedState, quant

CXXFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared",
            "-fPIC", "-std=c++17")
PIECE = 256  # elements per work item at 16 bits (no codec block there)


class KernelUnavailable(RuntimeError):
    """No C++ compiler here, or the kernel failed to build: the caller runs the staged path."""


# --- formats a kernel takes -------------------------------------------------------------------------

def kernel_format(state, p: Tensor) -> Format | None:
    """The format ``state`` of ``p`` is in, when the kernel can load and store it in place (None: not)."""
    if isinstance(state, QuantizedState):
        ok = state.codes.is_contiguous() and state.absmax.is_contiguous() and state.absmax.dtype == torch.float32
        return state.fmt if ok and state.shape == p.shape else None
    if isinstance(state, Tensor) and state.dtype == torch.bfloat16 and state.is_contiguous():
        return Format(16)
    return None


def signature(params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[list | None], i: int):
    """The state formats of param ``i`` when the kernel takes it whole (fp32, contiguous, every active state
    16/8/4-bit and of one width), else None."""
    p, g = params[i], grads[i]
    if p.dtype != torch.float32 or g.dtype != torch.float32 or not (p.is_contiguous() and g.is_contiguous()):
        return None
    if p.numel() == 0 or g.shape != p.shape:
        return None
    formats = []
    for column in states:
        if column is None:
            formats.append(None)
            continue
        fmt = kernel_format(column[i], p)
        if fmt is None:
            return None
        formats.append(fmt)
    widths = {f.bits for f in formats if f is not None}
    return tuple(formats) if len(widths) == 1 else None


# --- the generated source ----------------------------------------------------------------------------

PRELUDE = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#if defined(__AVX2__)
#include <immintrin.h>
#define FO_AVX2 1
#endif

static inline float fo_maximum(float a, float b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
static inline float fo_minimum(float a, float b) { return (a != a || b != b) ? a + b : (a < b ? a : b); }

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

// out[i] = values[code i] * absmax; 8-bit codes one a byte
static inline void decode8(const uint8_t* c, int64_t n, const float* values, float absmax, float* out) {
    int64_t i = 0;
#ifdef FO_AVX2
    const __m256 a = _mm256_set1_ps(absmax);
    for (; i + 8 <= n; i += 8) {
        const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(values, idx, 4), a));
    }
#endif
    for (; i < n; ++i) out[i] = values[c[i]] * absmax;
}

// 4-bit codes two a byte, the first in the low nibble
static inline void decode4(const uint8_t* c, int64_t n, const float* values, float absmax, float* out) {
    int64_t i = 0;
#ifdef FO_AVX2
    const __m256 a = _mm256_set1_ps(absmax);
    const __m256 low_half = _mm256_loadu_ps(values), high_half = _mm256_loadu_ps(values + 8);
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
    for (; i < n; ++i) out[i] = values[(c[i / 2] >> ((i & 1) * 4)) & 15] * absmax;
}

// the block's absmax: the largest |x|, through the bits (integer max orders them as the values; NaN wins)
static inline float block_absmax(const float* x, int64_t n) {
    uint32_t top = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u; std::memcpy(&u, x + i, 4);
        u &= 0x7FFFFFFFu;
        top = u > top ? u : top;
    }
    float out; std::memcpy(&out, &top, 4);
    return out;
}

// quant.Encoder: the code of x / divisor, one table read and integer compares
template <int SHIFT, uint32_t LOWEST, uint32_t HIGHEST, int32_t HALF>
static inline void encode(const float* x, int64_t n, float divisor, const uint32_t* lut, int32_t* out) {
    constexpr uint32_t MASK = (1u << SHIFT) - 1u;
    int64_t i = 0;
#ifdef FO_AVX2
    const __m256 d = _mm256_set1_ps(divisor);
    const __m256i mask = _mm256_set1_epi32((int32_t)MASK), magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i lowest = _mm256_set1_epi32((int32_t)LOWEST), highest = _mm256_set1_epi32((int32_t)HIGHEST);
    const __m256i half = _mm256_set1_epi32(HALF), one = _mm256_set1_epi32(1);
    for (; i + 8 <= n; i += 8) {
        const __m256i u = _mm256_castps_si256(_mm256_div_ps(_mm256_loadu_ps(x + i), d));
        const __m256i m = _mm256_min_epu32(_mm256_max_epu32(_mm256_and_si256(u, magnitude), lowest), highest);
        const __m256i negative = _mm256_srai_epi32(u, 31);
        const __m256i cell = _mm256_add_epi32(_mm256_srli_epi32(_mm256_sub_epi32(m, lowest), SHIFT), _mm256_and_si256(negative, half));
        const __m256i entry = _mm256_i32gather_epi32(reinterpret_cast<const int*>(lut), cell, 4);
        const __m256i low = _mm256_xor_si256(_mm256_and_si256(m, mask), _mm256_and_si256(negative, mask));
        const __m256i split = _mm256_and_si256(entry, mask);  // low > split, unsigned (both < 2**31)
        const __m256i up = _mm256_and_si256(_mm256_cmpgt_epi32(low, split), one);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_add_epi32(_mm256_srli_epi32(entry, 24), up));
    }
#endif
    for (; i < n; ++i) {
        const float y = x[i] / divisor;
        uint32_t u; std::memcpy(&u, &y, 4);
        uint32_t m = u & 0x7FFFFFFFu;
        m = m < LOWEST ? LOWEST : (m > HIGHEST ? HIGHEST : m);
        const uint32_t entry = lut[((m - LOWEST) >> SHIFT) + ((u >> 31) ? (uint32_t)HALF : 0u)];
        const uint32_t low = (m & MASK) ^ ((u >> 31) ? MASK : 0u);
        out[i] = (int32_t)(entry >> 24) + (int32_t)(low > (entry & MASK));
    }
}

static inline void pack8(const int32_t* codes, int64_t n, uint8_t* c) {
    for (int64_t i = 0; i < n; ++i) c[i] = (uint8_t)codes[i];
}
static inline void pack4(const int32_t* codes, int64_t n, uint8_t* c) {  // an odd last code: high nibble 0
    for (int64_t i = 0; i < n / 2; ++i) c[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
    if (n & 1) c[n / 2] = (uint8_t)codes[n - 1];
}
"""


def _column_names(formats: Sequence[Format | None]) -> list[str]:
    """The int64 columns of one tensor's row in the table."""
    cols = ["first_block", "rows", "length", "p", "g"]
    for k, fmt in enumerate(formats):
        if fmt is None:
            continue
        cols += [f"s{k}_codes", f"s{k}_absmax"] if fmt.quantized else [f"s{k}"]
    return cols


def kernel_source(update: Callable, flags: tuple, formats: tuple, n_scalars: int, has_grad_mul: bool) -> str:
    """C++ for one rule, FLAGS and state formats: ``fo_step(table, n_tensors, begin, end, scalars, grad_mul,
    maps)`` runs global blocks ``[begin, end)`` of the tensors in ``table``."""
    bits = next(f.bits for f in formats if f is not None)
    block = quant.BLOCK[bits] if bits in (8, 4) else PIECE
    cols = _column_names(formats)
    col = {name: k for k, name in enumerate(cols)}
    active = [k for k, f in enumerate(formats) if f is not None]
    lines, outputs = cpp_twin.trace(update, ["p_", "g_"] + [f"s{k}_" if f is not None else "" for k, f in
                                                            enumerate(formats)],
                                    [f"sc[{k}]" for k in range(n_scalars)], flags)
    body = "\n".join(f"            {line}" for line in lines)
    writes = [f"            P[i] = {outputs[0]};"]
    writes += [f"            S{k}[i] = {outputs[1 + k]};" for k in active]

    loads, stores = [], []
    for k in active:
        fmt = formats[k]
        if fmt.bits == 16:
            ptr = f"reinterpret_cast<uint16_t*>(row[{col[f's{k}']}]) + at"
            loads.append(f"        bf16_load({ptr}, n, S{k});")
            stores.append(f"        bf16_store(S{k}, n, {ptr});")
            continue
        codes = f"reinterpret_cast<uint8_t*>(row[{col[f's{k}_codes']}])"
        codes += " + at" if fmt.bits == 8 else f" + r * ((length + 1) / 2) + j * {block // 2}"
        absmax = f"reinterpret_cast<float*>(row[{col[f's{k}_absmax']}])[r * nblocks + j]"
        values = f"reinterpret_cast<const float*>(maps[{2 * k}])"
        lut = f"reinterpret_cast<const uint32_t*>(maps[{2 * k + 1}])"
        enc = quant.encoder(fmt.qmap)
        loads.append(f"        decode{fmt.bits}({codes}, n, {values}, {absmax}, S{k});")
        stores.append(f"""        {{ const float amax = block_absmax(S{k}, n);
          encode<{enc.shift}, {enc.lowest}u, {enc.highest}u, {enc.half}>(S{k}, n, amax == 0.0f ? 1.0f : amax, {lut}, C);
          pack{fmt.bits}(C, n, {codes});
          {absmax} = amax; }}""")

    arrays = " ".join(f"float S{k}[{block}];" for k in active)
    grad = "G[at + i] * gm" if has_grad_mul else "G[at + i]"
    reads = "\n".join(f"            const float s{k}_ = S{k}[i];" for k in active)
    loads_s, stores_s = "\n".join(loads), "\n".join(stores)
    return PRELUDE + f"""
extern "C" void fo_step(const int64_t* table, int64_t n_tensors, int64_t begin, int64_t end,
                        const float* sc, const float* grad_mul, const void* const* maps) {{
    const int64_t width = {len(cols)};
    const float gm = grad_mul ? *grad_mul : 1.0f;
    (void)gm;
    int64_t t = 0;
    while (t + 1 < n_tensors && table[(t + 1) * width] <= begin) ++t;
    for (int64_t b = begin; b < end; ++b) {{
        while (t + 1 < n_tensors && table[(t + 1) * width] <= b) ++t;
        const int64_t* row = table + t * width;
        const int64_t length = row[{col['length']}];
        const int64_t nblocks = (length + {block - 1}) / {block};
        const int64_t local = b - row[{col['first_block']}];
        const int64_t r = local / nblocks, j = local % nblocks;
        const int64_t at = r * length + j * {block};
        const int64_t rest = length - j * {block};
        const int64_t n = rest < {block} ? rest : {block};
        float* __restrict__ Pp = reinterpret_cast<float*>(row[{col['p']}]) + at;
        const float* __restrict__ G = reinterpret_cast<const float*>(row[{col['g']}]);
        float P[{block}]; {arrays}
        int32_t C[{block}]; (void)C;
        for (int64_t i = 0; i < n; ++i) P[i] = Pp[i];
{loads_s}
        for (int64_t i = 0; i < n; ++i) {{
            const float p_ = P[i];
            const float g_ = {grad};
{reads}
{body}
{chr(10).join(writes)}
        }}
        for (int64_t i = 0; i < n; ++i) Pp[i] = P[i];
{stores_s}
    }}
}}
"""


# --- building -------------------------------------------------------------------------------------------

def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


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


def _build(cxx: str, source: str, path: str) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        src = os.path.join(work, "kernel.cpp")
        with open(src, "w") as f:
            f.write(source)
        built = os.path.join(work, "kernel.so")
        try:
            done = subprocess.run([cxx, *CXXFLAGS, src, "-o", built], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except subprocess.SubprocessError as e:
            raise KernelUnavailable(f"{os.path.basename(cxx)} failed to build the kernel: {e}") from None
        if done.returncode != 0:
            raise KernelUnavailable(f"{os.path.basename(cxx)} failed to build the kernel: "
                                    f"{done.stderr.strip()[-2000:]}")
        os.replace(built, path)  # atomic: a concurrent build of the same source writes the same bytes


@lru_cache(maxsize=None)
def _library(source: str) -> ctypes.CDLL:
    """The built kernel, from the cache folder or built into it. Any failure (no compiler, a failed build, a
    cache folder that cannot be written, a cached file that does not load) raises ``KernelUnavailable``; a
    cached file that does not load is built again once."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler found (set CXX, or install g++ or clang++)")
    key = hashlib.sha256("\0".join((source, cxx, *CXXFLAGS, sys.platform, _target(cxx))).encode()).hexdigest()[:24]
    path = os.path.join(cache_dir(), f"kernel_{key}.so")
    try:
        for attempt in (0, 1):
            if not os.path.exists(path):
                _build(cxx, source, path)
            try:
                lib = ctypes.CDLL(path)
                break
            except OSError:
                if attempt:
                    raise
                os.remove(path)  # cut short or damaged: built again
    except OSError as e:
        raise KernelUnavailable(f"the kernel cache {cache_dir()!r} is not usable ({e}); set FASTOPTIM_CACHE "
                                "to a writable folder") from None
    lib.fo_step.restype = None
    lib.fo_step.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_void_p]
    return lib


@lru_cache(maxsize=None)
def kernel(update: Callable, flags: tuple, formats: tuple, n_scalars: int, has_grad_mul: bool) -> ctypes.CDLL:
    return _library(kernel_source(update, flags, formats, n_scalars, has_grad_mul))


@lru_cache(maxsize=1)
def available() -> str | None:
    """None when kernels build here, else why not (checked once, on a tiny kernel)."""
    from ..rules.sgd import sgd_update

    try:
        kernel(sgd_update, (False, False, True, False), (Format(16),), 5, False)
    except KernelUnavailable as e:
        return str(e)
    return None


@lru_cache(maxsize=None)
def _map_pointers(formats: tuple) -> tuple:
    """Per state: the map's values and the encoder's table (kept alive here)."""
    tensors = []
    for fmt in formats:
        quantized = fmt is not None and fmt.quantized
        tensors += [fmt.qmap.table(), quant.encoder(fmt.qmap).lut] if quantized else [None, None]
    array = (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])
    return tensors, array


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


def run(update: Callable, params: list[Tensor], grads: list[Tensor], states: list[list | None], formats: tuple,
        scalars: Tensor, flags: tuple, grad_mul: Tensor | None) -> None:
    """One step over tensors that all have state ``formats`` (see ``signature``); ``scalars`` is the step's
    fp32 scalars on the CPU, ``grad_mul`` a 0-d fp32 CPU tensor or None."""
    lib = kernel(update, tuple(flags), formats, scalars.numel(), grad_mul is not None)
    fmt = next(f for f in formats if f is not None)
    rows_table, first = [], 0
    for i, (p, g) in enumerate(zip(params, grads)):
        rows, length, blocks = _rows(p, fmt)
        row = [first, rows, length, p.data_ptr(), g.data_ptr()]
        for column, f in zip(states, formats):
            if f is None:
                continue
            s = column[i]
            row += [s.codes.data_ptr(), s.absmax.data_ptr()] if f.quantized else [s.data_ptr()]
        rows_table.append(row)
        first += blocks
    table = torch.tensor(rows_table, dtype=torch.int64)
    _, maps = _map_pointers(formats)
    gm = None if grad_mul is None else grad_mul.data_ptr()
    threads = max(1, min(torch.get_num_threads(), first // 64))
    cuts = [first * k // threads for k in range(threads + 1)]
    args = (table.data_ptr(), len(rows_table))
    if threads == 1:
        lib.fo_step(*args, 0, first, scalars.data_ptr(), gm, maps)
        return
    jobs = [_threads().submit(lib.fo_step, *args, cuts[k], cuts[k + 1], scalars.data_ptr(), gm, maps)
            for k in range(threads)]
    for job in jobs:
        job.result()
