"""The fused level on GPUs: one Triton kernel launch per bucket, for any number of tensors.

The rule's own ``update`` is the math: ``triton_twin`` re-binds its source to Triton's primitives and
jits it, so every level runs one source. Around it, ``kernel_for`` generates a multi-tensor kernel
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
The arithmetic runs in fp32 whatever the storage dtype, and it is the arithmetic the rule means:
Triton compiles ``/`` to the approximate ``div.full.f32`` (up to 2 ulp), so the twin's source is rewritten
to call ``tl.div_rn`` (IEEE division, ``div.rn.f32``) wherever the rule writes ``/``; ``sqrt`` is
``tl.sqrt_rn`` (``sqrt.rn.f32``); kernels are built without FMA contraction. 16-bit stores round to nearest
(``cvt.rn``). The PTX tests check all of it for sm_80 and sm_90.

Dtypes: the kernel takes fp32, bf16 and fp16 storage (``TORCH_TO_TL``), complex64 through its fp32 real
view. fp64 buckets (complex128's real view too) and any other dtype go to the foreach level, which is
exact in the param's own dtype (``takes(dtype)`` says which; the fused level routes, and ``record_paths``
names "foreach" for them): an fp64 kernel would need fp64 scalars passed through memory (Triton passes
Python floats as fp32) and its own IEEE division and root (``tl.div_rn`` and ``tl.sqrt_rn`` take fp32
only), for a dtype that GPU training hardly uses.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import os
import textwrap
import types
from functools import lru_cache
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from ..base import pack_scalars
from ..record import took

CHUNK = 1 << 16
BLOCK = 1024
NUM_WARPS = 4
ALIGN = 16  # bytes: what the kernel's multiple_of hints promise about every address

TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def takes(dtype: torch.dtype) -> bool:
    """Whether the kernel takes tensors of ``dtype`` (the rest go to the foreach level)."""
    return dtype in TORCH_TO_TL


# --- the rule's primitives, as Triton spells them ---------------------------------------------------

def _sqrt(x):
    return tl.sqrt_rn(x)


def _sign(x):
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))


def _maximum(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: kernels run in Triton's interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _jit(fn: Callable, interpret: bool, device_function: bool = False):
    """Jit for real GPUs or for the interpreter, chosen per call (not by the environment at import), so
    one process can both interpret kernels and compile them ahead of time. ``device_function``: called from
    a kernel (the twin, a primitive), never launched."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        return (_interpreted_device_function() if device_function else InterpretedFunction)(fn)
    return JITFunction(fn)


@lru_cache(maxsize=None)
def _interpreted_device_function():
    """The interpreter's function class, but a call from a kernel does not patch ``triton.language`` again.

    Triton's interpreter patches the ``tl`` it finds in a launched kernel's globals for the whole launch, and
    again (never undone) at every device-function call, which rebuilds the same patches: a quarter of the
    interpreter's time in our kernels, which call the twin and its primitives once per block. Ours share the
    kernel's ``tl`` (``triton_twin`` puts it in the twin's globals), so the launch's patches are the ones
    the call would make; the call runs the same rewritten function."""
    from triton.runtime.interpreter import InterpretedFunction, InterpreterError

    class InterpretedDeviceFunction(InterpretedFunction):
        def __call__(self, *args, **kwargs):
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise InterpreterError(repr(e)) from e

    return InterpretedDeviceFunction


@lru_cache(maxsize=None)
def _prims(interpret: bool) -> dict:
    return {name: _jit(fn, interpret, device_function=True)
            for name, fn in (("sqrt", _sqrt), ("sign", _sign), ("maximum", _maximum), ("clamp", _clamp))}


class _IEEEDivision(ast.NodeTransformer):
    """``a / b`` becomes ``tl.div_rn(a, b)`` (and ``a /= b`` becomes ``a = tl.div_rn(a, b)``): the operator
    cannot be re-bound through globals, and Triton's own ``/`` is the approximate ``div.full.f32``."""

    @staticmethod
    def _div(a: ast.expr, b: ast.expr) -> ast.Call:
        return ast.Call(ast.Attribute(ast.Name("tl", ast.Load()), "div_rn", ast.Load()), [a, b], [])

    def visit_BinOp(self, node: ast.BinOp) -> ast.expr:
        self.generic_visit(node)
        return ast.copy_location(self._div(node.left, node.right), node) if isinstance(node.op, ast.Div) else node

    def visit_AugAssign(self, node: ast.AugAssign) -> ast.stmt:
        self.generic_visit(node)
        if not isinstance(node.op, ast.Div):
            return node
        if not isinstance(node.target, ast.Name):
            raise TypeError("a rule may only divide-assign plain names (x /= y)")
        value = self._div(ast.Name(node.target.id, ast.Load()), node.value)
        return ast.copy_location(ast.Assign([ast.Name(node.target.id, ast.Store())], value), node)


def twin_source(update: Callable) -> str:
    """The rule's source as the Triton twin runs it: the same code, with IEEE division spelled out."""
    if update.__code__.co_freevars:
        raise TypeError(f"{update.__qualname__}: a rule's update is a plain module-level function (no closure)")
    tree = ast.parse(textwrap.dedent(inspect.getsource(update)))
    fn = tree.body[0]
    fn.decorator_list = []
    tree = ast.fix_missing_locations(_IEEEDivision().visit(tree))
    return ast.unparse(tree) + "\n"


def _exec_source(source: str, filename: str, name: str, globs: dict) -> Callable:
    """Define ``name`` from ``source``, kept in linecache so Triton (which re-reads a jitted function's source),
    tracebacks and ``inspect`` can read it."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), globs, namespace)
    return namespace[name]


def _helpers(update: Callable, interpret: bool) -> dict:
    """The twins of the plain functions ``update`` names (shared helpers, ``rules.common``): a jitted function
    calls jitted ones only, and a helper's ``/`` must be rewritten as the update's is."""
    prims = _prims(interpret)
    return {name: triton_twin(value, interpret) for name in update.__code__.co_names
            if name not in prims and isinstance(value := update.__globals__.get(name), types.FunctionType)}


@lru_cache(maxsize=None)
def triton_twin(update: Callable, interpret: bool = False):
    """The rule's ``update`` for Triton: its own source, primitives swapped for Triton's, ``/`` for IEEE
    division (``twin_source``), each helper it calls a twin of its own. The torch levels keep running the
    original."""
    # tl too: the interpreter patches the tl it finds
    globs = {**update.__globals__, **_helpers(update, interpret), **_prims(interpret), "tl": tl}
    filename = f"<fastoptim-twin {update.__module__}.{update.__qualname__}>"
    clone = _exec_source(twin_source(update), filename, update.__name__, globs)
    clone.__defaults__ = update.__defaults__
    clone.__qualname__ = f"{update.__qualname__}_triton"
    clone.__module__ = update.__module__
    return _jit(clone, interpret, device_function=True)


# --- the multi-tensor kernel, generated for a rule's arity ---------------------------------------------

# both kernels' first lines (``stored`` too): the scalars read on the device where they are tensors, and
# the step skipped where GradScaler found an inf
PROLOGUE = '''    if SCALARS_IN_MEMORY:  # tensor-valued hyper-parameters: read on the device, never synced to the host
{scalar_loads}
    if HAS_INF:
        if tl.load(found_inf) != 0:
            return
    pid = tl.program_id(0)
'''

_TEMPLATE = '''
def {name}(table, chunks, grad_mul, found_inf, scalars, {scalar_args}
           P_DTYPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
           HAS_GRAD_MUL: tl.constexpr, HAS_INF: tl.constexpr, SCALARS_IN_MEMORY: tl.constexpr, {flag_args}):
''' + PROLOGUE + '''    tensor = tl.load(chunks + 2 * pid)
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
    globs = {"tl": tl, "triton": triton, "UPDATE": triton_twin(update, interpret)}
    fn = _exec_source(source, f"<fastoptim-kernel {name}>", name, globs)
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
        # addresses, and the grads' dtypes and layouts: a grad may be freed and a new one of another dtype
        # (torch's grad_dtype) or layout take its address. A param's or state's layout cannot change while
        # the table lives: the step plan makes a new bucket (and table) when a state is replaced or a
        # param's address, strides or shape change.
        key = [t.data_ptr() for col in columns for t in col]
        key += [(g.dtype, g.is_contiguous()) for g in columns[1]]
        if key == self.key:
            return
        n = len(columns[0])
        ready = [i for i in range(n) if all(kernel_ready(col[i], columns[0][i]) for col in columns)]
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


def kernel_ready(t: Tensor, param: Tensor) -> bool:
    """What the kernel assumes of a tensor: contiguous, 16-byte aligned, and its param's dtype and size
    (one element type and one length per table row)."""
    return (t.is_contiguous() and t.data_ptr() % ALIGN == 0 and t.dtype == param.dtype
            and t.numel() == param.numel())


def run(update: Callable, state_names: tuple[str, ...], params: list[Tensor], grads: list[Tensor],
        states: Sequence[list[Tensor] | None], scalars: tuple, flags: tuple, table: TensorTable,
        grad_mul: Tensor | None = None, found_inf: Tensor | None = None) -> list[int]:
    """One launch for the whole bucket (of a dtype the kernel ``takes``); returns the indices of the tensors
    it left to a safe path."""
    active = tuple(s is not None for s in states)
    kernel = kernel_for(update, state_names, active, len(scalars), len(flags), interpreting())
    # inactive states get the param's address: never read, keeps every row the same length
    table.update([params, grads] + [s if s is not None else params for s in states])
    if table.n_chunks:
        took("triton")
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
    n_scalars = len(rule.scalars(group, 1, *rule.host_start(group)))
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
