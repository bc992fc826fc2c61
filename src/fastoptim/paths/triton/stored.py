"""The fused level's Triton kernel for 16/8/4-bit state: load, update and store the state in registers.

Where ``kernels`` steps plain state, this kernel steps params whose states are kept as ``storage``
keeps them, in one launch per bucket (and state formats) and one pass over memory, no temporaries:

* the work is the codec's blocks (``quant``: 256 elements at 8 bits, 128 at 4, along each row, never
  across dim 0; 16-bit state takes 256-element pieces of the flat tensor). A program takes up to
  ``CHUNK_TILES`` tiles of ``tile_blocks(block)`` consecutive blocks of one tensor (``TILE_ELEMENTS``
  elements); a tile is a ``[blocks, block]`` register array, so each block's absmax is one max-reduction
  along its row;
* codes are decoded through the map (a table in device memory) times the block's absmax; the rule's own
  ``update`` (``triton_twin``) runs in fp32; each quantized state is stored with its block's new absmax
  and the codec's nearest-code table (``quant.Encoder``: one table read, integer compares on the bits of
  ``x / absmax``, the division IEEE ``tl.div_rn``), so the codes are exactly ``quant.quantize``'s;
* bf16 state is widened and rounded back to nearest even with integer operations on the bits (as torch
  rounds), not with a dtype cast: the interpreter would truncate where the GPU rounds, and this way the
  GPU, the interpreter and the staged path store the same bytes;
* a tensor whose rows are whole blocks and whose addresses are 16-byte aligned takes a branch with
  alignment hints (vector loads and stores of codes, params and grads); any other tensor (ragged rows,
  odd addresses) the masked branch with per-block offsets, so no tensor the formats allow is refused;
* ``grad_mul`` and ``found_inf`` are read inside the kernel, as in ``kernels``: a step GradScaler
  skips stores nothing;
* bf16 params with ``rounding="stochastic"``: loaded as bits, stepped in fp32, rounded back with the bits
  ``storage.rounding.stochastic_round`` draws (16 bits of mix32(element index + the step's key) added to the fp32
  pattern, the low half dropped); with ``rounding="kahan"``: stepped as param plus compensation, stored
  rounded to nearest with what that lost as the new compensation. Integer operations on the bits, so the
  params are the staged path's bit for bit.

What it takes (``signature``): contiguous params and grads of one shape, fp32 (bf16 when rounded
stochastically or with Kahan), every active state one its codec offers (``Codec.kernel_format``: bf16, a
``QuantizedState`` not sharded), all of one codec, whose hooks give the pointers, loads and stores. The rest
runs staged (``paths.staged``).

HBM traffic per param, on paper (the whole-rows branch; the map and the encoder's table are gathered
from L1/L2): AdamW fp32 params, 8-bit states: p 4 + 4, g 4, two codes 1 + 1 each, absmax 2 x (4 + 4) / 256:
16.06 B (28 B at 32-bit state, 20 B at 16-bit, 14.1 B at 4-bit).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..base import pack_scalars
from ..record import took
from .kernels import ALIGN, NUM_WARPS, PROLOGUE, _exec_source, _jit, interpreting, triton_twin
from ... import storage
from ...native import bulk
from ...storage import Format, codecs

TILE_ELEMENTS = 2048  # elements per tile: 16 per thread at 4 warps, one 128-bit load of 8-bit codes
CHUNK_TILES = 8      # tiles per program


def block_of(bits: int | str) -> int:
    """Elements per work block of the format ``state_bits=bits`` names (``codec_block`` of its codec)."""
    return codec_block((codecs.for_bits(bits).format(),))


def codec_block(formats: Sequence[Format | None]) -> int:
    """Elements per work block: the codec's (``signature``: one codec per param)."""
    first = next(f for f in formats if f is not None)
    return codecs.of(first).kernel_block(first)


def tile_blocks(block: int) -> int:
    return TILE_ELEMENTS // block


# --- formats the kernel takes --------------------------------------------------------------------------

ROUNDINGS = ("nearest", "stochastic", "kahan")  # "nearest": fp32 params; the others: bf16 params


def signature(params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[list | None], i: int,
              rounding: str = "nearest"):
    """The state formats of param ``i`` when the kernel takes it whole, else None. fp32 params and grads; with
    ``rounding`` "stochastic" or "kahan", bf16 ones (stepped in fp32 and rounded back so), whose plain states are
    bf16 too: they step through fp32 and are stored rounded to nearest, exactly the 16-bit format."""
    return storage.kernel_signature(params, grads, states, i, torch.float32 if rounding == "nearest" else torch.bfloat16)


# --- the generated kernel ---------------------------------------------------------------------------

_TEMPLATE = '''
def {name}(table, work, grad_mul, found_inf, scalars, keys, {map_args}{scalar_args}
           TB: tl.constexpr, QB: tl.constexpr, CHUNK_TILES: tl.constexpr, STOCHASTIC: tl.constexpr,
           HAS_GRAD_MUL: tl.constexpr, HAS_INF: tl.constexpr, SCALARS_IN_MEMORY: tl.constexpr, {flag_args}):
''' + PROLOGUE + '''    tensor = tl.load(work + 2 * pid)
    first = tl.load(work + 2 * pid + 1)
    row = table + tensor * {row_len}
    n_blocks = tl.load(row)
    length = tl.load(row + 1)
    per_row = tl.load(row + 2)
    whole = tl.load(row + 3)
    last = tl.minimum(first + CHUNK_TILES * TB, n_blocks)
    g_mul = 1.0
    if HAS_GRAD_MUL:
        g_mul = tl.load(grad_mul)
    key = 0
    if STOCHASTIC:  # this step's key of the param's random stream (``storage.rounding.rounding_key``)
        key = tl.load(keys + tensor)
    tile = tl.arange(0, TB)
    k = tl.arange(0, QB)
    if whole != 0:  # rows of whole blocks, aligned: the tile is one contiguous run; pointers loaded here so
        # the alignment hints stay on this branch
{whole_ptrs}
        for b0 in range(first, last, TB):
            blocks = b0 + tile
            block_mask = blocks < last
            mask = block_mask[:, None]
            offs = tl.multiple_of(b0 * QB, QB) + tile[:, None] * QB + k[None, :]
{whole_body}
    else:  # ragged rows or odd addresses: per-block offsets, masked to each block's length
{ragged_ptrs}
        for b0 in range(first, last, TB):
            blocks = b0 + tile
            block_mask = blocks < last
            r = blocks // per_row
            j = blocks - r * per_row
            n_in = tl.minimum(length - j * QB, QB)
            mask = block_mask[:, None] & (k[None, :] < n_in[:, None])
            offs = (r * length + j * QB)[:, None] + k[None, :]
{ragged_body}
'''


def _ptrs(formats: Sequence[Format | None], hinted: bool, rounding: str) -> str:
    def unhinted(col: int, kind: str) -> str:
        return f"tl.load(row + {col}).to(tl.pointer_type({kind}))"

    def ptr(col: int, kind: str) -> str:
        return f"tl.multiple_of({unhinted(col, kind)}, {ALIGN})" if hinted else unhinted(col, kind)

    value = "tl.float32" if rounding == "nearest" else "tl.int16"  # bf16 params: their bits
    lines = [f"p_ptr = {ptr(4, value)}", f"g_ptr = {ptr(5, value)}"]
    col = 6
    if rounding == "kahan":  # the compensation: what rounding the param to bf16 lost, bf16
        lines.append(f"comp_ptr = {ptr(col, 'tl.int16')}")
        col += 1
    for i, fmt in enumerate(formats):
        if fmt is None:
            continue
        for name, kind, aligned in codecs.of(fmt).triton_pointers(i, fmt):  # one column each
            lines.append(f"{name} = {ptr(col, kind) if aligned else unhinted(col, kind)}")
            col += 1
    return "\n".join(" " * 8 + line for line in lines)


def _bf16_nearest(x: str, bits: str) -> str:
    """uint32 whose low half is fp32 ``x`` (its bits ``bits``) rounded to bf16, nearest even, as torch rounds."""
    return f"tl.where({x} != {x}, 0x7FC0, ({bits} + 0x7FFF + (({bits} >> 16) & 1)) >> 16)"


def _store_param(rounding: str) -> list[str]:
    if rounding == "nearest":
        return ["tl.store(p_ptr + offs, out[0], mask=mask)"]
    if rounding == "kahan":  # ``storage.rounding.round_into``: the param to nearest, what that lost into the compensation
        return ["p_bits = out[0].to(tl.uint32, bitcast=True)",
                f"p_new = {_bf16_nearest('out[0]', 'p_bits')}",
                "tl.store(p_ptr + offs, p_new.to(tl.int16), mask=mask)",
                "lost = out[0] - (p_new << 16).to(tl.float32, bitcast=True)",
                "lost_bits = lost.to(tl.uint32, bitcast=True)",
                f"tl.store(comp_ptr + offs, ({_bf16_nearest('lost', 'lost_bits')}).to(tl.int16), mask=mask)"]
    # ``storage.rounding.stochastic_round``: 16 bits of mix32(index + key) added to the fp32 pattern's low half, which
    # is then dropped (integer operations, so the GPU and the interpreter agree); NaN and inf to nearest
    return ["p_bits = out[0].to(tl.uint32, bitcast=True)",
            "h = (offs + key).to(tl.uint32)",
            "h = h ^ (h >> 16)",
            "h = h * 0x7FEB352D",
            "h = h ^ (h >> 15)",
            "h = h * 0x846CA68B",
            "h = h ^ (h >> 16)",
            "p_up = (p_bits + (h >> 16)) >> 16",
            f"p_near = {_bf16_nearest('out[0]', 'p_bits')}",
            "p_new = tl.where((p_bits & 0x7F800000) == 0x7F800000, p_near, p_up)",
            "tl.store(p_ptr + offs, p_new.to(tl.int16), mask=mask)"]


def _body(formats: Sequence[Format | None], n_scalars: int, n_flags: int, whole: bool, rounding: str) -> str:
    lines = []
    for codec in dict.fromkeys(codecs.of(f) for f in formats if f is not None):  # each codec's, once
        lines += codec.triton_prelude(whole)
    if rounding != "nearest":  # bf16 bits widened exactly
        lines += [f"{x} = (tl.load({x}_ptr + offs, mask=mask, other=0).to(tl.int32) << 16)"
                  f".to(tl.float32, bitcast=True)" for x in ("p", "g")]
        if rounding == "kahan":  # the param as the compensated sum (``paths.staged``)
            lines += ["p = p + (tl.load(comp_ptr + offs, mask=mask, other=0).to(tl.int32) << 16)"
                      ".to(tl.float32, bitcast=True)"]
    else:
        lines += ["p = tl.load(p_ptr + offs, mask=mask, other=0.0)",
                  "g = tl.load(g_ptr + offs, mask=mask, other=0.0)"]
    lines += ["if HAS_GRAD_MUL:",
              "    g = g * g_mul"]
    args = []
    for i, fmt in enumerate(formats):
        if fmt is None:
            args.append("None")
            continue
        lines += codecs.of(fmt).triton_load(i, fmt, whole)  # the codec's hook (``storage.codecs``)
        args.append(f"s{i}")
    args += [f"c{i}" for i in range(n_scalars)] + [f"F{i}" for i in range(n_flags)]
    lines.append(f"out = UPDATE(p, g, {', '.join(args)})")
    lines += _store_param(rounding)
    for i, fmt in enumerate(formats):
        if fmt is not None:
            lines += codecs.of(fmt).triton_store(i, fmt, f"out[{i + 1}]")
    return "\n".join(" " * 12 + line for line in lines)


def row_length(formats: Sequence[Format | None], rounding: str = "nearest") -> int:
    """int64 columns of one tensor's table row: n_blocks, length, blocks per row, whole, p, g, with Kahan
    rounding the compensation, then per state its codec's pointers (bf16: one; codes and absmax: two)."""
    return 6 + (rounding == "kahan") + sum(0 if f is None else len(codecs.of(f).triton_pointers(0, f)) for f in formats)


@lru_cache(maxsize=None)
def kernel_for(update: Callable, formats: tuple, n_scalars: int, n_flags: int, interpret: bool = False,
               rounding: str = "nearest"):
    """The kernel for one rule, one tuple of state formats (None: inactive) and one rounding of the params
    (``ROUNDINGS``)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding {rounding!r} is not one of {ROUNDINGS}")
    tag = "_".join("x" if f is None else f.tag.replace("/", "b") for f in formats)
    tag = "".join(c if c.isalnum() or c == "_" else "_" for c in tag)  # (a codec's name may hold any character)
    name = f"{update.__name__}_stored_{tag}" + ("" if rounding == "nearest" else f"_bf16_{rounding}")
    source = _TEMPLATE.format(
        name=name,
        map_args="".join(f"{arg}, " for arg, _ in _table_args(formats)),
        scalar_args="".join(f"c{i}, " for i in range(n_scalars)),
        scalar_loads="\n".join(f"        c{i} = tl.load(scalars + {i})" for i in range(n_scalars)) or "        pass",
        flag_args=", ".join(f"F{i}: tl.constexpr" for i in range(n_flags)),
        row_len=row_length(formats, rounding),
        whole_ptrs=_ptrs(formats, True, rounding), ragged_ptrs=_ptrs(formats, False, rounding),
        whole_body=_body(formats, n_scalars, n_flags, True, rounding),
        ragged_body=_body(formats, n_scalars, n_flags, False, rounding),
    )
    globs = {"tl": tl, "triton": triton, "UPDATE": triton_twin(update, interpret)}
    fn = _exec_source(source, f"<fastoptim-kernel {name}>", name, globs)
    fn.__module__ = __name__
    fn.__qualname__ = name
    return _jit(fn, interpret)


def _table_args(formats: Sequence[Format | None]) -> list[tuple[str, str]]:
    """The kernel's arguments for the states' tables (a map's values, an encoder's): (name, type)."""
    return [arg for i, f in enumerate(formats) if f is not None for arg in codecs.of(f).triton_tables(i, f)]


# --- tables ---------------------------------------------------------------------------------------------

def _layout(p: Tensor, fmt: Format) -> tuple[int, int, int]:
    """(blocks, row length, blocks per row) the kernel walks for ``p``: its codec's rows and blocks."""
    rows, length, blocks = codecs.of(fmt).walk(p, fmt)
    return blocks, length, blocks // rows if rows else 0


class StoredTable:
    """The device-memory table and work list of one group of params (one tuple of formats), rebuilt only
    when an address changes."""

    def __init__(self):
        self.key = None

    def update(self, params, grads, states, formats, comps=None) -> None:
        """``comps``: with Kahan rounding, each param's compensation. Every tensor's address is read each step in
        one C++ pass (``bulk.layouts``), not one Python call per tensor."""
        watched = [*params, *grads, *(comps or ())]
        for column, fmt in zip(states, formats):
            if fmt is not None:
                tensors = codecs.of(fmt).tensors
                for s in column:
                    watched.extend(tensors(s))
        addresses = bulk.layouts(watched, shapes=False)
        if addresses == self.key:
            return
        first = next(f for f in formats if f is not None)
        block = codec_block(formats)
        per_program = CHUNK_TILES * tile_blocks(block)
        rows, work = [], []
        for t, (p, g) in enumerate(zip(params, grads)):
            n_blocks, length, per_row = _layout(p, first)
            columns = [p.data_ptr(), g.data_ptr()]
            bases = [p.data_ptr(), g.data_ptr()]
            if comps is not None:
                columns.append(comps[t].data_ptr())
                bases.append(comps[t].data_ptr())
            for column, fmt in zip(states, formats):
                if fmt is None:
                    continue
                codec = codecs.of(fmt)
                for tensor, (_, _, aligned) in zip(codec.tensors(column[t]), codec.triton_pointers(0, fmt)):
                    columns.append(tensor.data_ptr())
                    if aligned:  # read with the whole-rows branch's alignment hint
                        bases.append(tensor.data_ptr())
            whole = length % block == 0 and all(a % ALIGN == 0 for a in bases)
            rows.append([n_blocks, length, per_row, int(whole), *columns])
            work += [(t, b) for b in range(0, n_blocks, per_program)]
        device = params[0].device
        self.table = torch.tensor(rows, dtype=torch.int64).to(device)
        self.work = torch.tensor(work, dtype=torch.int64).to(device)
        self.n_programs = len(work)
        self.key = addresses


@lru_cache(maxsize=None)
def _tables(fmt: Format, device: torch.device) -> tuple[Tensor, ...]:
    return codecs.of(fmt).tables(fmt, device)


def run(update: Callable, params: list[Tensor], grads: list[Tensor], states: list[list | None], formats: tuple,
        scalars: tuple, flags: tuple, table: StoredTable, grad_mul: Tensor | None = None,
        found_inf: Tensor | None = None, rounding_keys: Tensor | None = None,
        comps: list[Tensor] | None = None) -> None:
    """One launch over params that all have state ``formats`` (see ``signature``). bf16 params: rounded
    stochastically with ``rounding_keys`` (one per param, ``storage.rounding.rounding_keys``), or with Kahan's
    compensations ``comps`` (bf16, one per param)."""
    block = codec_block(formats)
    stochastic = rounding_keys is not None
    rounding = "stochastic" if stochastic else "kahan" if comps is not None else "nearest"
    kernel = kernel_for(update, formats, len(scalars), len(flags), interpreting(), rounding)
    table.update(params, grads, states, formats, comps)
    device = params[0].device
    maps = [t for fmt in formats if fmt is not None for t in _tables(fmt, device)]
    dummy = table.table
    in_memory = any(isinstance(c, Tensor) for c in scalars)
    packed = pack_scalars(scalars, device) if in_memory else dummy
    took("triton_stored")
    kernel[(table.n_programs,)](
        table.table, table.work, grad_mul if grad_mul is not None else dummy,
        found_inf if found_inf is not None else dummy, packed,
        rounding_keys.to(device, non_blocking=True) if stochastic else dummy, *maps,
        *[0.0 if in_memory else float(c) for c in scalars],
        TB=tile_blocks(block), QB=block, CHUNK_TILES=CHUNK_TILES, STOCHASTIC=stochastic,
        HAS_GRAD_MUL=grad_mul is not None, HAS_INF=found_inf is not None, SCALARS_IN_MEMORY=in_memory,
        **{f"F{i}": bool(f) for i, f in enumerate(flags)}, num_warps=NUM_WARPS, enable_fp_fusion=False)


# --- ahead-of-time compile ---------------------------------------------------------------------------

def compile_for_gpu(rule, group: dict, formats: tuple, capability: int = 90, grad_mul: bool = False,
                    found_inf: bool = False, rounding: str = "nearest"):
    """Compile the rule's stored-state kernel for ``sm_<capability>`` (PTX and cubin) on any machine."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    flags = rule.flags(group)
    n_scalars = len(rule.scalars(group, 1, *rule.host_start(group)))
    block = codec_block(formats)
    kernel = kernel_for(rule.update, formats, n_scalars, len(flags), False, rounding)
    signature = {"table": "*i64", "work": "*i64", "grad_mul": "*fp32", "found_inf": "*fp32", "scalars": "*fp32",
                 "keys": "*i64"}
    signature.update(dict(_table_args(formats)))
    signature.update({f"c{i}": "fp32" for i in range(n_scalars)})
    constants = dict(TB=tile_blocks(block), QB=block, CHUNK_TILES=CHUNK_TILES,
                     STOCHASTIC=rounding == "stochastic",
                     HAS_GRAD_MUL=grad_mul,
                     HAS_INF=found_inf, SCALARS_IN_MEMORY=False, **{f"F{i}": bool(f) for i, f in enumerate(flags)})
    signature.update({name: "constexpr" for name in constants})
    return triton.compile(ASTSource(kernel, signature, constexprs=constants),
                          target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": NUM_WARPS, "enable_fp_fusion": False})
