"""The fused level on GPUs: one Triton kernel launch per bucket, for any number of tensors.

The rule's own ``update`` is the math: ``triton_twin`` re-binds its code object to Triton's primitives
and jits it, so every level runs one source. Around it, ``kernel_for`` generates a multi-tensor kernel
for the rule's arity:

* a tensor table in device memory (int64 rows: numel, then the addresses of p, g and each state) and a
  chunk list (rows: tensor index, first element) are built once and cached until a data_ptr changes;
* one program per chunk of ``CHUNK`` elements, so one huge tensor and thousands of tiny ones both fill
  the GPU; each program walks its chunk in unmasked ``BLOCK``-sized steps, then one masked tail:
  with the 16-byte alignment hints that split is what gives 128-bit vector loads and stores;
* AMP and clipping: ``grad_mul`` (1/scale times the clip factor) and ``found_inf`` are read inside the
  kernel (scale the grads; skip when inf), so
  ``torch.amp.GradScaler`` needs no host sync; hyper-parameters held as device tensors (an lr a
  schedule writes in place) are read from memory the same way.
The arithmetic runs in fp32 whatever the storage dtype.
"""

from __future__ import annotations

import linecache
import os
import types
from functools import lru_cache
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from . import pack_scalars

CHUNK = 1 << 16
BLOCK = 1024
NUM_WARPS = 4
ALIGN = 16  # bytes: what the kernel's multiple_of hints promise about every address

TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# --- the rule's primitives, as Triton spells them ---------------------------------------------------

def _sqrt(x):
    return tl.sqrt_rn(x)


def _sign(x):
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))


def _maximum(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: kernels run in Triton's interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _jit(fn: Callable, interpret: bool):
    """Jit for real GPUs or for the interpreter, chosen per call (not by the environment at import), so
    one process can both interpret kernels and compile them ahead of time."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        return InterpretedFunction(fn)
    return JITFunction(fn)


@lru_cache(maxsize=None)
def _prims(interpret: bool) -> dict:
    return {"sqrt": _jit(_sqrt, interpret), "sign": _jit(_sign, interpret), "maximum": _jit(_maximum, interpret)}


@lru_cache(maxsize=None)
def triton_twin(update: Callable, interpret: bool = False):
    """The rule's ``update`` with the same code object, its primitives swapped for Triton's."""
    globs = {**update.__globals__, **_prims(interpret), "tl": tl}  # the interpreter patches the tl it finds
    clone = types.FunctionType(update.__code__, globs, update.__name__, update.__defaults__, update.__closure__)
    clone.__qualname__ = f"{update.__qualname__}_triton"
    clone.__module__ = update.__module__
    return _jit(clone, interpret)


# --- the multi-tensor kernel, generated for a rule's arity ---------------------------------------------

_TEMPLATE = '''
def {name}(table, chunks, grad_mul, found_inf, scalars, {scalar_args}
           P_DTYPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
           HAS_GRAD_MUL: tl.constexpr, HAS_INF: tl.constexpr, SCALARS_IN_MEMORY: tl.constexpr, {flag_args}):
    if SCALARS_IN_MEMORY:  # tensor-valued hyper-parameters: read on the device, never synced to the host
{scalar_loads}
    if HAS_INF:
        if tl.load(found_inf) != 0:
            return
    pid = tl.program_id(0)
    tensor = tl.load(chunks + 2 * pid)
    start = tl.load(chunks + 2 * pid + 1)
    row = table + tensor * {row_len}
    end = tl.minimum(start + CHUNK, tl.load(row))
    p_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(P_DTYPE)), 16)
    g_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(P_DTYPE)), 16)
{state_ptrs}
    g_mul = 1.0
    if HAS_GRAD_MUL:
        g_mul = tl.load(grad_mul)
    n_full = (end - start) // BLOCK
    for i in range(n_full):
        offs = tl.max_contiguous(tl.multiple_of(start + i * BLOCK + tl.arange(0, BLOCK), BLOCK), BLOCK)
{full_body}
    offs = start + n_full * BLOCK + tl.arange(0, BLOCK)
    mask = offs < end
{tail_body}
'''


def _body(state_names: Sequence[str], active: Sequence[bool], n_scalars: int, n_flags: int, masked: bool,
          indent: str) -> str:
    m = ", mask=mask" if masked else ""
    lines = [f"p = tl.load(p_ptr + offs{m}).to(tl.float32)",
             f"g = tl.load(g_ptr + offs{m}).to(tl.float32)",
             "if HAS_GRAD_MUL:",
             "    g = g * g_mul"]
    args = []
    for i, on in enumerate(active):
        if on:
            lines.append(f"s{i} = tl.load(s{i}_ptr + offs{m}).to(tl.float32)")
            args.append(f"s{i}")
        else:
            args.append("None")
    args += [f"c{i}" for i in range(n_scalars)] + [f"F{i}" for i in range(n_flags)]
    lines.append(f"out = UPDATE(p, g, {', '.join(args)})")
    lines.append(f"tl.store(p_ptr + offs, out[0].to(P_DTYPE){m})")
    for i, on in enumerate(active):
        if on:
            lines.append(f"tl.store(s{i}_ptr + offs, out[{i + 1}].to(P_DTYPE){m})")
    return "\n".join(indent + line for line in lines)


@lru_cache(maxsize=None)
def kernel_for(update: Callable, state_names: tuple[str, ...], active: tuple[bool, ...], n_scalars: int,
               n_flags: int, interpret: bool = False):
    """The multi-tensor kernel for one rule and one pattern of active states (source kept in linecache so
    Triton, tracebacks and ``inspect`` can read it)."""
    name = f"{update.__name__}_multi_tensor_" + "".join("1" if a else "0" for a in active)
    state_ptrs = "\n".join(
        f"    s{i}_ptr = tl.multiple_of(tl.load(row + {3 + i}).to(tl.pointer_type(P_DTYPE)), 16)"
        for i, on in enumerate(active) if on)
    source = _TEMPLATE.format(
        name=name,
        scalar_args="".join(f"c{i}, " for i in range(n_scalars)),
        scalar_loads="\n".join(f"        c{i} = tl.load(scalars + {i})" for i in range(n_scalars)) or "        pass",
        flag_args=", ".join(f"F{i}: tl.constexpr" for i in range(n_flags)),
        row_len=3 + len(state_names),
        state_ptrs=state_ptrs or "    pass",
        full_body=_body(state_names, active, n_scalars, n_flags, False, " " * 8),
        tail_body=_body(state_names, active, n_scalars, n_flags, True, " " * 4),
    )
    filename = f"<fastoptim-kernel {name}>"
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    namespace = {"tl": tl, "triton": triton, "UPDATE": triton_twin(update, interpret)}
    exec(compile(source, filename, "exec"), namespace)
    fn = namespace[name]
    fn.__module__ = __name__
    fn.__qualname__ = name
    return _jit(fn, interpret)


# --- tables: built once, cached while every address stays the same -------------------------------------

class TensorTable:
    """The device-memory table of one bucket and its chunk list, rebuilt only when an address changes.

    Tensors the kernel cannot take (non-contiguous, or not 16-byte aligned: a view with an odd storage
    offset) are left out of the table and listed in ``fallback`` for a safe path.
    """

    def __init__(self):
        self.key: list[int] | None = None
        self.table: Tensor | None = None
        self.chunks: Tensor | None = None
        self.fallback: list[int] = []

    def update(self, columns: list[list[Tensor]]) -> None:
        key = [t.data_ptr() for col in columns for t in col]
        if key == self.key:
            return
        n = len(columns[0])
        ready = [i for i in range(n) if all(kernel_ready(col[i]) for col in columns)]
        ready_set = set(ready)
        self.fallback = [i for i in range(n) if i not in ready_set]
        rows = [[columns[0][i].numel(), *(col[i].data_ptr() for col in columns)] for i in ready]
        chunk_rows = [(r, start) for r, i in enumerate(ready)
                      for start in range(0, columns[0][i].numel(), CHUNK)]
        device = columns[0][0].device
        self.table = torch.tensor(rows or [[0] * (len(columns) + 1)], dtype=torch.int64).to(device)
        self.chunks = torch.tensor(chunk_rows or [(0, 0)], dtype=torch.int64).to(device)
        self.n_chunks = len(chunk_rows)
        self.key = key


def kernel_ready(t: Tensor) -> bool:
    """What the kernel assumes of a tensor: contiguous and 16-byte aligned."""
    return t.is_contiguous() and t.data_ptr() % ALIGN == 0


def run(update: Callable, state_names: tuple[str, ...], params: list[Tensor], grads: list[Tensor],
        states: Sequence[list[Tensor] | None], scalars: tuple, flags: tuple, table: TensorTable,
        grad_mul: Tensor | None = None, found_inf: Tensor | None = None) -> list[int]:
    """One launch for the whole bucket; returns the indices of the tensors it left to a safe path."""
    active = tuple(s is not None for s in states)
    kernel = kernel_for(update, state_names, active, len(scalars), len(flags), interpreting())
    # inactive states get the param's address: never read, keeps every row the same length
    table.update([params, grads] + [s if s is not None else params for s in states])
    if table.n_chunks:
        dummy = table.table  # any pointer: unused when the flags that name it are off
        in_memory = any(isinstance(c, Tensor) for c in scalars)
        packed = pack_scalars(scalars, params[0].device) if in_memory else dummy
        kernel[(table.n_chunks,)](
            table.table, table.chunks, grad_mul if grad_mul is not None else dummy,
            found_inf if found_inf is not None else dummy, packed,
            *[0.0 if in_memory else float(c) for c in scalars],
            P_DTYPE=TORCH_TO_TL[params[0].dtype], CHUNK=CHUNK, BLOCK=BLOCK,
            HAS_GRAD_MUL=grad_mul is not None, HAS_INF=found_inf is not None, SCALARS_IN_MEMORY=in_memory,
            **{f"F{i}": bool(f) for i, f in enumerate(flags)}, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return table.fallback


# --- ahead-of-time compile: the proof that a kernel builds for a real GPU, without one ----------------

def compile_for_gpu(rule, group: dict, dtype: torch.dtype = torch.float32, capability: int = 90):
    """Compile the rule's multi-tensor kernel for ``sm_<capability>`` (PTX and cubin) on any machine."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    active = tuple(rule.active(group))
    flags = rule.flags(group)
    n_scalars = len(rule.scalars(group, 1))
    kernel = kernel_for(rule.update, tuple(rule.state_names), active, n_scalars, len(flags), False)
    signature = {"table": "*i64", "chunks": "*i64", "grad_mul": "*fp32", "found_inf": "*fp32",
                 "scalars": "*fp32"}
    signature.update({f"c{i}": "fp32" for i in range(n_scalars)})
    constants = dict(P_DTYPE=TORCH_TO_TL[dtype], CHUNK=CHUNK, BLOCK=BLOCK, HAS_GRAD_MUL=False, HAS_INF=False,
                     SCALARS_IN_MEMORY=False,
                     **{f"F{i}": bool(f) for i, f in enumerate(flags)})
    signature.update({name: "constexpr" for name in constants})
    return triton.compile(ASTSource(kernel, signature, constexprs=constants),
                          target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": NUM_WARPS, "enable_fp_fusion": False})
