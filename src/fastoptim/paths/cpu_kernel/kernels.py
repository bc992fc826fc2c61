"""The fused level's CPU kernel for 16/8/4-bit state: load, update, store, in one pass over memory.

torch's fused CPU kernels take plain fp32 state only, and Inductor's code for a block-wise quantized step
(gathers scalarised, the block's absmax a separate pass over fp32 temporaries) is far slower than torch's
fused fp32 step. So the fused level carries a small C++ kernel of its own, generated per rule, FLAGS and
state formats from the shipped template ``native/step_kernel.cpp`` (and its headers: ``common.hpp``,
``lanes.hpp``, the codecs' ``codec.hpp`` and ``minifloat.hpp``):

* the rule's math is the rule's own ``update``, traced into C++ (``cpp_twin``): byte for byte the rule's
  IEEE fp32 math on the stored values (torch's own CPU ``sqrt`` is not correctly rounded in every lane, so
  the loop level is within an ulp of it, not always equal);
* per block of one row (the codec's blocks: 256 elements at 8 bits, 128 at 4; 256-element pieces at
  16 bits), the update runs a vector register's lanes at a time (``native/lanes.hpp``; a block's last few
  elements one at a time) with p and g read in place, taking each quantized state's new absmax as it goes.
  Each codec says how its state meets the loop (``codecs.CppPieces``): the dynamic maps decode a block into
  an fp32 array in L1 first and encode it after the loop, as ``quant.Encoder`` does; bf16 and fp8 decode
  inside the loop; bf16 is stored as it is computed, rounded to nearest even; fp8's codes of a block are
  written inside the next block's loop (``codecs.Deferred``);
* the codec has three builds under ``#if``, all exact: AVX-512 (with VBMI: 8-bit codes decoded and encoded
  by byte permutes over tables held in registers, 64 elements at a time, no gathers; see ``cell_tables``;
  4-bit codes by one permute, encoded by a search over the boundaries in a register or, for the linear map,
  its exact formula), AVX2 (the map and ``quant.Encoder``'s table read lane by lane with scalar loads, not
  gathers), and scalar;
* one call per bucket: a table of the tensors (one int64 row each) and the step's scalars in memory, so
  schedules never rebuild anything; the blocks are split among ``torch.get_num_threads()`` threads (ctypes
  releases the GIL), in chunks taken in turn, so no second OpenMP runtime is loaded beside torch's.

``native`` compiles the source once per machine and caches it. Where there is no compiler or the build
fails, ``available()`` says why, the fused level warns once and the bucket runs staged (the numbers are
the same; only the speed differs).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Callable, Sequence

import torch
from torch import Tensor

from . import cpp_twin
from ... import native, storage
from ...storage import Format, codecs
from ...storage.codecs.dynamic import cell_tables  # noqa: F401  (the 8-bit codec's AVX-512 tables)

CXXFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared",
            "-fPIC", "-std=c++17")
MAP_SLOTS = 2  # per state, the addresses of its tables in the kernel's ``maps`` (the template reads two)
CHUNK_BLOCKS = 64  # the fewest blocks a thread takes at a time
CHUNKS_PER_THREAD = 8


KernelUnavailable = native.KernelUnavailable  # no C++ compiler, or a failed build: the bucket runs staged
compiler = native.compiler


# --- formats a kernel takes -------------------------------------------------------------------------

def signature(params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[list | None], i: int):
    """The state formats of param ``i`` when the kernel takes it whole (fp32, contiguous, every active state one
    its codec lets a kernel take, ``storage.kernel_format``, all of one codec), else None."""
    return storage.kernel_signature(params, grads, states, i)


# --- the generated source ----------------------------------------------------------------------------

def _column_names(formats: Sequence[Format | None]) -> list[str]:
    """The int64 columns of one tensor's row in the table: each state's codec names its own."""
    cols = ["first_block", "rows", "length", "p", "g"]
    for k, fmt in enumerate(formats):
        if fmt is not None:
            cols += codecs.of(fmt).columns(k, fmt)
    return cols


def kernel_source(update: Callable, flags: tuple, formats: tuple, n_scalars: int) -> str:
    """C++ for one rule, FLAGS and state formats: the shipped template ``step_kernel.cpp`` filled with the rule's
    update (``cpp_twin``) and each state's load, store and codec. Its ``fo_step(table, n_tensors, begin, end,
    scalars, grad_mul, maps)`` runs global blocks ``[begin, end)`` of the tensors in ``table``. The grad is
    always multiplied by ``grad_mul`` (1 when none is given: exact), so steps with and without clipping or
    GradScaler's unscale share one kernel and one build."""
    first = next(f for f in formats if f is not None)
    block = codecs.of(first).kernel_block(first)  # one walk for all states (``signature``: one codec)
    cols = _column_names(formats)
    col = {name: k for k, name in enumerate(cols)}
    active = [k for k, f in enumerate(formats) if f is not None]
    pieces = {k: codecs.of(formats[k]).cpp(k, formats[k], col) for k in active}  # each state's (``storage.codecs``)
    missing = sorted({codecs.of(formats[k]).name for k in active if pieces[k] is None})
    if missing:  # (a format a kernel was offered without its C++: the bucket runs staged)
        raise KernelUnavailable(f"state format {', '.join(missing)} gives no CPU kernel hooks (Codec.cpp)")
    tops = [k for k in active if pieces[k].top]
    lines, outputs = cpp_twin.trace(update, ["p_", "g_"] + [f"s{k}_" if f is not None else "" for k, f in
                                                            enumerate(formats)],
                                    [f"FO_SC{k}" for k in range(n_scalars)], flags)

    def typed(text: str, lanes: bool) -> str:
        """The traced text for lanes or one float: its statements' type, and each scalar as one (the
        step's scalars held once per call, as a float and as lanes)."""
        text = text.replace(cpp_twin.LANE_TYPE, "Lanes" if lanes else "float")
        return re.sub(r"\bFO_SC(\d+)\b", r"vsc\1" if lanes else r"sc\1", text)

    deferred = [k for k in active if pieces[k].deferred]

    def lane_value(text: str) -> str:
        """An output as lanes: a traced value is one already; a number the rule returned is not."""
        return text if re.fullmatch(r"t\d+|p_|g_|s\d+_|vsc\d+", text) else f"fo_splat({text})"

    def writes(lanes: bool) -> list[str]:
        out = [None if o is None else lane_value(typed(o, True)) if lanes else typed(o, False) for o in outputs]
        put = (lambda ptr, value: f"fo_put({ptr} + i, {value});") if lanes else (lambda ptr, v: f"{ptr}[i] = {v};")
        # each state put as it is computed, or kept for its store; the largest magnitude a store needs (a
        # block's absmax) taken as the new values are written (no pass of its own)
        top = "tops{k}" if lanes else "top{k}"
        return ([put("P", out[0])]
                + [pieces[k].put.format(x=out[1 + k]) if pieces[k].put else put(f"S{k}", out[1 + k]) for k in active]
                + [f"{top.format(k=k)} = fo_top({top.format(k=k)}, {out[1 + k]});" for k in tops])

    def arrays(k: int) -> str:
        if pieces[k].deferred is None:
            return f"alignas(64) float S{k}[BLOCK];"
        return f"float* __restrict__ S{k} = Q{k}[cur]; const float* __restrict__ last{k} = Q{k}[cur ^ 1];"

    constants, codec_lines, loads, stores, probes = [], [], [], [], []
    for k in active:
        constants += pieces[k].constants
        codec_lines += [pieces[k].codec] if pieces[k].codec else []
        loads += [pieces[k].load] if pieces[k].load else []
        stores += [pieces[k].store] if pieces[k].store else []
        probes += [pieces[k].probe] if pieces[k].probe else []

    def indent(items, depth):
        return "\n".join(" " * depth + item for item in items)

    return native.assemble(
        "step_kernel.cpp", width=str(len(cols)), block=str(block), constants="\n".join(constants),
        scalars=indent([f"const float sc{k} = sc[{k}]; const Lanes vsc{k} = fo_splat(sc{k});"
                        for k in range(n_scalars)], 4),
        codecs=indent(codec_lines, 4), arrays=" ".join(arrays(k) for k in active),
        deferred_decls=indent([f"alignas(64) float Q{k}[2][BLOCK]; {pieces[k].deferred.decls}" for k in deferred], 4),
        deferred_lanes=indent([pieces[k].deferred.lanes for k in deferred], 16),
        deferred_rest=indent([pieces[k].deferred.rest for k in deferred], 12),
        deferred_finish=indent([pieces[k].deferred.finish for k in deferred], 8),
        deferred_flush=indent([f"const float* last{k} = Q{k}[cur ^ 1]; {pieces[k].deferred.rest}" for k in deferred],
                              8),
        tops=" ".join(f"uint32_t top{k} = 0; LaneBits tops{k} = {{}};" for k in tops), loads=indent(loads, 8),
        lane_reads=indent([f"const Lanes s{k}_ = {pieces[k].lanes or f'fo_lanes(S{k} + i)'};" for k in active], 12),
        tails=indent([pieces[k].tail for k in active if pieces[k].tail], 8),
        lane_body=indent([typed(line, True) for line in lines], 12), lane_writes=indent(writes(True), 12),
        reads=indent([f"const float s{k}_ = S{k}[i];" for k in active], 12),
        body=indent([typed(line, False) for line in lines], 12), writes=indent(writes(False), 12),
        merge_tops=indent([f"top{k} = fo_top(top{k}, tops{k});" for k in tops], 8),
        stores=indent(stores, 8), probes=indent(probes, 4))


# --- building -------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _library(source: str) -> ctypes.CDLL:
    """The built kernel (``native.load``); no compiler or a failed build raises ``KernelUnavailable``."""
    cxx = native.required_compiler()
    lib = native.load("kernel", source, CXXFLAGS, key=(sys.platform, native.target(cxx)), cxx=cxx,
                      precompiled="system.hpp")
    lib.fo_step.restype = None
    lib.fo_step.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_void_p]
    lib.fo_step_team.restype = None
    lib.fo_step_team.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


@lru_cache(maxsize=None)
def kernel(update: Callable, flags: tuple, formats: tuple, n_scalars: int) -> ctypes.CDLL:
    return _library(kernel_source(update, flags, formats, n_scalars))


def _probe() -> ctypes.CDLL:
    """A tiny kernel (SGD, 16-bit state): what ``available`` and ``simd_width`` build to find out."""
    from ...rules.sgd import sgd_update

    return kernel(sgd_update, (False, False, True, False), (Format(16),), 5)


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
    """Per state, ``MAP_SLOTS`` addresses: its codec's tables (a map's values, an encoder's), kept alive here."""
    tensors = []
    for fmt in formats:
        tables = () if fmt is None else codecs.of(fmt).tables(fmt)
        if len(tables) > MAP_SLOTS:
            raise ValueError(f"the CPU kernel takes {MAP_SLOTS} tables a state, {codecs.of(fmt).name} gives "
                             f"{len(tables)}")
        tensors += [*tables] + [None] * (MAP_SLOTS - len(tables))
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


GRAD_COLUMN = 4  # where a row of the table holds its grad's address (``_column_names``)


class Table:
    """The kernel's table of tensors (one int64 row each: first block, rows, length and the addresses of p, g
    and the states) for tensors that all have state ``formats``. Made once per bucket: params and state
    tensors are written in place while the step plan holds them (a replaced one makes a new plan, and so a
    new table; the plan also watches that no state moved in place, ``engine.plan``); grads may be new tensors
    every step, so their addresses are checked each step."""

    def __init__(self, params: list[Tensor], grads: list[Tensor], states: list[list | None], formats: tuple):
        self.formats = formats
        fmt = next(f for f in formats if f is not None)
        walk = codecs.of(fmt).walk  # (rows, length, blocks): the codec's (``signature``: one codec per param)
        rows_table, first, self.state_tensors = [], 0, []  # (held: the table keeps their addresses)
        for i, (p, g) in enumerate(zip(params, grads)):
            rows, length, blocks = walk(p, fmt)
            row = [first, rows, length, p.data_ptr(), g.data_ptr()]
            for column, f in zip(states, formats):
                if f is None:
                    continue
                s = column[i]
                tensors = codecs.of(f).tensors(s)
                self.state_tensors += tensors
                row += map(Tensor.data_ptr, tensors)
            rows_table.append(row)
            first += blocks
        self.table = torch.tensor(rows_table, dtype=torch.int64)
        self.blocks = first
        self.grad_addresses = [row[GRAD_COLUMN] for row in rows_table]

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
    lib = kernel(update, tuple(flags), formats, scalars.numel())
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
