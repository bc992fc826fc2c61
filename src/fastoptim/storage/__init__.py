"""How optimizer state is stored, written once for every level.

A state tensor is kept in a *format*, each one a codec looked up by name (``storage.codecs``: what it makes,
loads, stores, writes into checkpoints and gives the kernels; ``state_format=`` names it, ``state_bits=`` by width):
  * plain:  the param's dtype and shape (what torch.optim keeps; ``state_bits=32``);
  * 16-bit: bf16, the param's shape;
  * 8 / 4-bit: block-wise quantized codes and one fp32 absmax per block (``quant``), held in a
    ``QuantizedState`` (``storage.state`` also says how it behaves to code that walks ``optimizer.state``
    to move tensors: Lightning, accelerate, users' helpers). 8 and 4 bits apply to params with at least
    2 dims and ``min_quant_size`` elements; smaller ones keep plain state. The map is chosen per state:
    unsigned for states that are never negative (the rule's ``unsigned_states``: second moments, Adagrad's
    sum), signed otherwise.

Every path runs on plain tensors. A bucket with state in another format runs *staged* (``paths.staged``):
each state is loaded into a temporary of the param's dtype (upcast, or dequantized) with ``load``, the path
steps the temporaries exactly as it steps plain state, and each is stored back with ``store`` (rounded to
nearest, or quantized). So every path, and torch's own fused kernels, give the numbers of the same math on the
stored values. A path that loads and stores inside its own kernel (the CPU kernel, Triton on stored formats)
says so to the dispatcher (``engine.dispatch``), which skips the temporaries for the params it takes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from . import codecs, quant
from . import rounding  # (bf16 params without an fp32 master copy: ``storage.rounding``)
from .state import PLAIN, Format, QuantizedState, is_dtensor

STATE_BITS = (32, 16, 8, 4)
MIN_QUANT_SIZE = 4096


def check_state_bits(value: Any, where: str = "state_bits") -> int | str:
    """A width (``STATE_BITS``), or the name of a codec registered beside its width's own (``codecs.register``:
    what ``state_bits`` holds for it)."""
    if isinstance(value, str) and value in codecs.keys():
        return value
    if isinstance(value, bool) or value not in STATE_BITS:
        raise ValueError(f"Invalid {where}: {value!r} (must be one of {', '.join(map(str, STATE_BITS))})")
    return value


def state_bits_of(state_bits: Any = None, state_format: Any = None) -> int | str:
    """The ``state_bits`` that a constructor's ``state_bits=``/``state_format=`` name (32 when neither is given).
    ``state_format`` is a codec's name or alias (``storage.codecs``); ``state_bits`` stays what ``opt.state_bits``
    (and a group that sets its own) holds, so both spellings give the same optimizer. Both given and naming
    different formats: a ValueError naming both."""
    if state_format is None:
        return 32 if state_bits is None else check_state_bits(state_bits)
    bits = codecs.lookup(state_format).key  # its width, for the built-in formats
    if state_bits is not None and check_state_bits(state_bits) != bits:
        raise ValueError(f"state_bits={state_bits!r} and state_format={state_format!r} name different formats "
                         f"(state_format={state_format!r} is state_bits={bits}); give one of them")
    return bits


def check_min_quant_size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"Invalid min_quant_size: {value!r} (must be an int >= 0)")
    return value


# --- formats, new states and states found ------------------------------------------------------------

def format_for(p: Tensor, name: str, bits: int | str, min_quant_size: int, unsigned_states: frozenset) -> Format:
    """The format a state of ``p`` is kept in at ``bits`` (a ``state_bits``; its codec decides: quantized widths
    only for params with >= 2 dims and ``min_quant_size`` elements; complex params, stepped through their real
    view, stay plain)."""
    if p.is_complex() or not p.is_floating_point():
        return PLAIN
    return codecs.for_bits(bits).format_for(p, name, min_quant_size, unsigned_states)


def make(p: Tensor, fmt: Format, value: float) -> Tensor | QuantizedState:
    """A new state for ``p`` in ``fmt``, every element ``value`` (sharded like ``p`` when it is a DTensor)."""
    return codecs.of(fmt).make(p, fmt, value)


def pooled(shapes: list[torch.Size], formats: list[Format | None], device) -> tuple[list, tuple[Tensor, ...]]:
    """New states kept as several tensors (their values unset; a codec whose ``tensor_dtype`` is None), one per
    shape in its format (None: no state), whose tensors are views of one buffer per part (``Codec.parts``: a
    quantized state's codes and absmax): a check of those buffers' addresses covers them all
    (``share_memory_()`` or a resize moves a buffer, views and all). Returns (states, buffers). Each view
    starts a multiple of 16 bytes into its buffer (the GPU kernel's vector loads)."""
    parts = [codecs.of(f).parts(s, f) if f is not None else None for s, f in zip(shapes, formats)]
    dtypes = {tuple(dtype for dtype, _ in p) for p in parts if p is not None}
    if len(dtypes) > 1:
        raise ValueError(f"pooled states must be kept in the same tensors, got {sorted(map(str, dtypes))}")
    dtypes = next(iter(dtypes), (torch.uint8, torch.float32))  # (no state at all: two empty buffers, as before)
    units = [16 // dtype.itemsize for dtype in dtypes]  # elements in 16 bytes
    sizes = [[math.prod(shape) for _, shape in p] if p is not None else [0] * len(dtypes) for p in parts]
    buffers = tuple(torch.empty(sum(_aligned(n[j], unit) for n in sizes), dtype=dtype, device=device)
                    for j, (dtype, unit) in enumerate(zip(dtypes, units)))
    states, at = [], [0] * len(dtypes)
    for shape, fmt, part, n in zip(shapes, formats, parts, sizes):
        if fmt is None:
            states.append(None)
            continue
        views = [buffers[j][at[j]:at[j] + n[j]].view(part[j][1]) for j in range(len(dtypes))]
        states.append(codecs.of(fmt).assemble(views, fmt, torch.Size(shape)))
        at = [a + _aligned(n[j], units[j]) for j, a in enumerate(at)]
    return states, buffers


def _aligned(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def adopt(value: Any, p: Tensor, fmt: Format) -> Tensor | QuantizedState:
    """``value`` (a state found in ``optimizer.state``) in ``fmt``: itself when it is already, else a plain
    tensor of the param's shape converted (a torch.optim checkpoint loaded, or a tensor the user put in).
    A quantized state on another device than the param's (left there by code that moved tensors only) is
    moved to it byte for byte; a tensor there is refused, as torch.optim's step refuses it. Raises ValueError
    naming what does not fit."""
    codec = codecs.of(fmt)
    if isinstance(value, QuantizedState):
        why = value.layout_error()
        if why:
            raise ValueError(why)
        if value.device != p.device:
            value = value.to(p.device)
        if value.fmt == fmt and value.shape == p.shape:
            return value.seal()  # a step holds its tensors from now on
        if codec.tensor_dtype(p.dtype) is None and value.shape == p.shape:  # kept otherwise too: span by span
            local = p.to_local() if is_dtensor(p) else p
            converted = QuantizedState.empty(local.shape, fmt, local.device)
            converted.copy_(value.local())  # (local rows into local rows)
            return converted.sharded_like(p) if is_dtensor(p) else converted
        return adopt(value.dequantize(codec.tensor_dtype(p.dtype) or p.dtype), p, fmt)
    if not isinstance(value, Tensor):
        raise TypeError(f"must be a tensor, got {type(value).__name__}")
    if value.shape != p.shape or value.device != p.device:
        raise ValueError(f"has shape {tuple(value.shape)}, device {value.device}; the param has shape "
                         f"{tuple(p.shape)}, device {p.device}")
    return codec.adopt(value, p, fmt)  # converted as its codec keeps it (rounds to nearest)


def is_plain(state: Any, p: Tensor) -> bool:
    return state is None or isinstance(state, Tensor) and state.dtype == p.dtype


def nbytes(state: Any) -> int:
    if isinstance(state, QuantizedState):
        return state.nbytes
    return state.nbytes if isinstance(state, Tensor) else 0


# --- the staged path's load and store (``paths.staged``) ---------------------------------------------------

def load(state: Tensor | QuantizedState, p: Tensor) -> Tensor:
    """A temporary of the param's dtype holding the state's values."""
    return codecs.of(state.fmt).load(state, p) if isinstance(state, QuantizedState) else state.to(p.dtype)


def store(state: Tensor | QuantizedState, values: Tensor) -> None:
    if isinstance(state, QuantizedState):
        codecs.of(state.fmt).store(state, values)
    else:
        state.copy_(values)  # 16-bit: rounds to nearest


# --- what an in-kernel path takes as stored ---------------------------------------------------------------

def kernel_format(state: Any, p: Tensor) -> Format | None:
    """The format ``state`` of ``p`` is kept in, where a kernel can load and store it in place (its tensors
    local, contiguous and laid out as the codec lays them out: the codec that claims it says), else None."""
    if isinstance(state, QuantizedState):
        return codecs.of(state.fmt).kernel_format(state, p)
    for codec in codecs.CODECS.values():
        fmt = codec.kernel_format(state, p)
        if fmt is not None:
            return fmt
    return None


def kernel_signature(params: list[Tensor], grads: list[Tensor], states: list[list | None], i: int,
                     dtype: torch.dtype = torch.float32) -> tuple | None:
    """The state formats of param ``i`` where a kernel takes it whole (local contiguous params and grads of
    ``dtype``, every active state one a kernel takes, ``kernel_format``, and all of one codec: the kernel walks
    a param one way), else None."""
    p, g = params[i], grads[i]
    if is_dtensor(p) or is_dtensor(g) or p.dtype != dtype or g.dtype != dtype:
        return None
    if not (p.is_contiguous() and g.is_contiguous()) or p.numel() == 0 or g.shape != p.shape:
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
    kept_by = {codecs.of(f) for f in formats if f is not None}
    return tuple(formats) if len(kept_by) == 1 else None


def needs_staging(params: list[Tensor], states: list[list | None]) -> bool:
    return any(not is_plain(x, p) for s in states if s is not None for x, p in zip(s, params))


# --- checkpoints -------------------------------------------------------------------------------------------

CODES, ABSMAX, FORMAT, SHAPE = ".codes", ".absmax", ".format", ".shape"
PARTS = (CODES, ABSMAX, FORMAT, SHAPE)  # a quantized state's entries, in ``import_quantized``'s order
TO_TORCH = ("a low-bit checkpoint keeps quantized states as name.codes/.absmax/.format/.shape entries, which only "
            "fastoptim loads; opt.torch_state_dict() gives one that torch.optim loads")


def export_entry(entry: dict) -> dict:
    """A param's state for ``state_dict()``: a quantized state becomes ``name.codes`` (uint8), ``name.absmax``
    (fp32), ``name.format``, an int naming the map and block (``Format.id``: state-dict walkers such as DCP's
    flattening take ints, not strings), and ``name.shape``, the param's shape (int64: at 4 bits the codes'
    shape does not tell a row of 80 from one of 79). No entry keeps the name itself, so torch.optim fails loudly
    on such a checkpoint instead of reading codes as moments (``torch_state_dict()`` is the one to give it);
    everything else as it is."""
    out = {}
    for name, value in entry.items():
        if isinstance(value, QuantizedState):
            out.update(codecs.of(value.fmt).entries(name, value))
        else:
            out[name] = value
    return out


def split_quantized(entry: dict) -> tuple[dict, dict]:
    """A saved param state split into what torch.optim's loader may cast (plain tensors) and the quantized
    parts (codes, absmax, format, shape: ``PARTS``), which it must not (it would cast the codes to the param's
    dtype). The parts are found as ``export_entry`` writes them, or nested under the state's name (``{"codes",
    "absmax", "format", "shape"}``: DCP's ``set_optimizer_state_dict`` unflattens dotted names so)."""
    quantized = {name[:-len(FORMAT)] for name in entry if isinstance(name, str) and name.endswith(FORMAT)}
    taken = {name + suffix for name in quantized for suffix in PARTS}
    plain = {k: v for k, v in entry.items() if k not in taken}
    parts = {name: tuple(entry.get(name + suffix) for suffix in PARTS) for name in quantized}
    for name, value in list(plain.items()):
        if isinstance(value, dict) and FORMAT[1:] in value:
            nested = plain.pop(name)
            parts[name] = tuple(nested.get(suffix[1:]) for suffix in PARTS)
    return plain, parts


def import_quantized(name: str, parts: tuple, p: Tensor) -> QuantizedState:
    """A saved quantized state for ``p``, checked (format, dtypes, shapes) before anything changes. The format
    is a ``Format.id``, or the string checkpoints held before ("dynamic8s/256 [48, 80]": the tag, then the
    param's shape, checked too); the param's shape is checked against ``name.shape`` where the checkpoint has
    one. A ValueError says what does not fit, and how torch.optim takes such a checkpoint (``TO_TORCH``)."""
    codes, absmax, described, shape = parts
    try:
        fmt = _saved_format(name, described, p)
        if shape is not None and (not isinstance(shape, Tensor) or shape.tolist() != list(p.shape)):
            saved = shape.tolist() if isinstance(shape, Tensor) else shape
            raise ValueError(f"state {name!r} was saved for a param of shape {saved}, this param has shape "
                             f"{list(p.shape)}")
    except ValueError as e:
        raise ValueError(f"{e} ({TO_TORCH})") from None
    codec = codecs.of(fmt)
    kept = []
    for part, value, (dtype, want) in zip(("codes", "absmax"), (codes, absmax), codec.parts(p.shape, fmt)):
        if not isinstance(value, Tensor) or value.dtype != dtype or tuple(value.shape) != want:
            dtype_name = str(dtype).removeprefix("torch.")
            got = f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}" if isinstance(value, Tensor) \
                else type(value).__name__
            raise ValueError(f"state {name!r}: {part} must be a {dtype_name} tensor of shape {want} for a param "
                             f"of shape {tuple(p.shape)} ({fmt.tag}), got {got} ({TO_TORCH})")
        kept.append(value.to(p.device, copy=True))
    return codec.assemble(kept, fmt, p.shape)


def _saved_format(name: str, described: Any, p: Tensor) -> Format:
    if isinstance(described, int) and not isinstance(described, bool):
        return Format.from_id(described)
    if isinstance(described, str):  # the form saved before ids: "tag [shape]"
        tag, _, shape = described.partition(" ")
        fmt = Format.from_tag(tag)
        if shape != str(list(p.shape)):
            raise ValueError(f"state {name!r} was saved for a param of shape {shape}, this param has shape "
                             f"{list(p.shape)}")
        return fmt
    raise ValueError(f"state {name!r}: its format entry must be an int (a format's id), got "
                     f"{type(described).__name__} {described!r}")


def torch_value(value: Any, p: Tensor) -> Any:
    """A state as torch.optim keeps it: a tensor of the param's shape and dtype (``step`` and plain states
    unchanged)."""
    if isinstance(value, QuantizedState):
        return value.dequantize(p.dtype)
    if isinstance(value, Tensor) and value.dtype == torch.bfloat16 and p.dtype != torch.bfloat16 \
            and value.shape == p.shape:
        return value.to(p.dtype)
    return value
