"""What a state is kept as: its ``Format``, and ``QuantizedState`` (8/4-bit codes and their scales).

Code outside the library walks ``optimizer.state`` to move it between devices, and a quantized state must
behave like tensors to it:
  * Lightning's ``apply_to_collection`` (``_optimizer_to_device``, at the end of ``fit()`` and on resume) rebuilds
    a dataclass field by field: it deep-copies it and sets each field on the copy, and refuses frozen ones;
    ``move_data_to_device`` calls ``.to(device)`` on anything that has a ``.to``, as accelerate's
    ``send_to_device`` does. So ``QuantizedState`` is a dataclass that is not frozen, with ``to``/``cpu``/``cuda``,
    and ``Format`` is no dataclass at all: a leaf, with no tensors to move.
  * A walk never changes a state in place: it makes a moved copy and puts that into the state dict, which the
    step plan counts as a change. A state's fields are still never reassigned while a step may hold its
    tensors (the fused level's table holds their addresses): a state made by its constructor or taken by a
    step refuses it; copies (``copy.copy``, ``copy.deepcopy``, unpickled) take it until a step takes them.
  * A state left on another device than its param's (a walk that moves tensors only, such as accelerate's
    ``recursively_apply``) is moved to the param's at the next step (``storage.adopt``).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from . import quant, registry


class Format:
    """How one state of one param is stored. ``bits`` 32 is plain (the param's dtype). ``codec``: the name of
    the codec that keeps it where that is not its width's own (one registered beside the built-in formats;
    ``storage.codecs.of``), else None. Immutable."""

    def __init__(self, bits: int, signed: bool = True, codec: str | None = None):
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "signed", signed)
        object.__setattr__(self, "codec", codec)

    def __setattr__(self, name, value):
        raise AttributeError(f"a Format is immutable (tried to set {name!r})")

    def __eq__(self, other):
        if not isinstance(other, Format):
            return NotImplemented
        return (self.bits, self.signed, self.codec) == (other.bits, other.signed, other.codec)

    def __hash__(self) -> int:
        return hash((self.bits, self.signed) if self.codec is None else (self.bits, self.signed, self.codec))

    def __reduce__(self):
        return Format, (self.bits, self.signed) if self.codec is None else (self.bits, self.signed, self.codec)

    def __repr__(self) -> str:
        codec = "" if self.codec is None else f", codec={self.codec!r}"
        return f"Format(bits={self.bits}, signed={self.signed}{codec})"

    @property
    def plain(self) -> bool:
        return self.bits == 32 and self.codec is None

    # what the format's codec says (``storage.codecs``): a quantized format's map and block, and its tag

    @property
    def quantized(self) -> bool:
        return registry.of(self).quantized

    @property
    def qmap(self) -> quant.QuantMap:
        return registry.of(self).qmap(self)

    @property
    def block(self) -> int:
        return registry.of(self).block(self)

    @property
    def tag(self) -> str:
        """What a checkpoint records: the map and block size (the codes mean nothing without them)."""
        return registry.of(self).tag(self)

    @property
    def id(self) -> int:
        """What a checkpoint's ``name.format`` entry holds: an int fixed by the tag (``registry.tag_id``)."""
        return registry.tag_id(self.tag)

    @staticmethod
    def from_tag(tag: str) -> "Format":
        """The quantized format whose ``tag`` is ``tag`` (ValueError where none is)."""
        return registry.from_tag(tag)

    @staticmethod
    def from_id(number: int) -> "Format":
        """The quantized format whose ``id`` is ``number`` (ValueError naming it where none is)."""
        return registry.from_id(number)


PLAIN = Format(32)

_SEALED: weakref.WeakSet = weakref.WeakSet()  # states whose fields are not reassigned any more


@dataclass(eq=False)
class QuantizedState:
    """One state tensor kept as block-wise codes (``quant``): ``codes`` uint8, ``absmax`` fp32 per block.
    Its tensors are written in place, never swapped while a step may hold them: to replace a state, put a new
    one into ``optimizer.state`` (the module docstring says which states take a field set)."""
    codes: Tensor
    absmax: Tensor
    fmt: Format
    shape: torch.Size

    def __post_init__(self):
        _SEALED.add(self)

    def __setattr__(self, name, value):
        if self in _SEALED:
            raise AttributeError(f"a QuantizedState's {name!r} is not reassigned: a step may hold its tensors; "
                                 f"put a new state into optimizer.state instead (copy.copy(state) gives one to edit)")
        object.__setattr__(self, name, value)

    def seal(self) -> "QuantizedState":
        """Refuse field assignments from now on (a step is about to hold its tensors)."""
        _SEALED.add(self)
        return self

    @staticmethod
    def empty(shape, fmt: Format, device) -> "QuantizedState":
        """A state of a param of ``shape`` in ``fmt`` on ``device``, its values unset."""
        tensors = [torch.empty(part, dtype=dtype, device=device) for dtype, part in registry.of(fmt).parts(shape, fmt)]
        return QuantizedState(*tensors, fmt, torch.Size(shape))

    @staticmethod
    def of(values: Tensor, fmt: Format, device=None, through: torch.dtype | None = None) -> "QuantizedState":
        """``values`` quantized (on ``device``, ``values``' by default; each span first rounded to ``through``
        where given, as a cast to the param's dtype would round it; converted span by span: no temporary of the
        whole tensor); a sharded ``values`` (a DTensor sharded on dim 0, as FSDP2 shards) gives codes and absmax
        sharded the same way, each rank quantizing its own rows."""
        if is_dtensor(values):
            return QuantizedState.of(values.to_local(), fmt, device, through).sharded_like(values)
        state = QuantizedState.empty(values.shape, fmt, values.device if device is None else device)
        convert(values, state, through)
        return state

    @staticmethod
    def full(p: Tensor, fmt: Format, value: float) -> "QuantizedState":
        """A state of ``p`` (sharded like it when it is a DTensor) with every element ``value``, its codes and
        absmax written directly."""
        local = p.to_local() if is_dtensor(p) else p
        state = QuantizedState.empty(local.shape, fmt, local.device)
        registry.of(fmt).fill(state, value)
        return state.sharded_like(p) if is_dtensor(p) else state

    @property
    def is_sharded(self) -> bool:
        return is_dtensor(self.codes)

    def local(self) -> "QuantizedState":
        """This rank's rows (the state itself when it is not sharded): views of the same memory."""
        if not self.is_sharded:
            return self
        codes = self.codes.to_local()
        rows = codes.shape[0] if len(self.shape) >= 2 else None
        shape = torch.Size([rows, *self.shape[1:]]) if rows is not None else self.shape
        return QuantizedState(codes, self.absmax.to_local(), self.fmt, shape)

    def sharded_like(self, param) -> "QuantizedState":
        """This rank's local state (of ``param``'s local rows) as one state sharded like the DTensor ``param``:
        codes and absmax are DTensors with its mesh and placements and their global shapes."""
        from torch.distributed.tensor import DTensor

        if any(pl.is_shard() and pl.dim != 0 for pl in param.placements):
            raise ValueError(f"8/4-bit state needs params sharded on dim 0 (FSDP2's Shard(0)); this param has "
                             f"placements {tuple(param.placements)}: give its group state_bits=16 or 32")

        def wrap(local: Tensor, shape: tuple) -> Tensor:
            stride = torch.empty(shape, device="meta").stride()
            return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                      shape=torch.Size(shape), stride=stride)

        shapes = [shape for _, shape in registry.of(self.fmt).parts(param.shape, self.fmt)]
        return QuantizedState(*(wrap(t, shape) for t, shape in zip(self.tensors(), shapes)), self.fmt, param.shape)

    def tensors(self) -> tuple[Tensor, Tensor]:
        """The tensors the state is kept in, in its codec's ``parts`` order."""
        return self.codes, self.absmax

    def clone(self) -> "QuantizedState":
        return QuantizedState(*(t.clone() for t in self.tensors()), self.fmt, self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The values, in ``dtype`` (written span by span into the one tensor returned); a sharded state gives a
        DTensor sharded like its param."""
        if self.is_sharded:
            from torch.distributed.tensor import DTensor

            values = self.local().dequantize(dtype)
            return DTensor.from_local(values, self.codes.device_mesh, self.codes.placements, run_check=False,
                                      shape=self.shape, stride=torch.empty(self.shape, device="meta").stride())
        out = torch.empty(self.shape, dtype=dtype, device=self.device)
        convert(self, out)
        return out

    def store(self, values: Tensor) -> None:
        """``values`` (of the state's shape, any float dtype and device) quantized into its own tensors."""
        if self.is_sharded:
            return self.local().store(values.to_local() if is_dtensor(values) else values)
        convert(values, self)

    def copy_(self, src: "QuantizedState") -> None:
        """``src``'s values into this state's own tensors (byte for byte where the formats match; else
        converted span by span)."""
        if src.fmt == self.fmt and src.shape == self.shape and not (src.is_sharded or self.is_sharded):
            self.codes.copy_(src.codes)
            self.absmax.copy_(src.absmax)
        elif src.is_sharded != self.is_sharded:
            raise ValueError("a sharded state is copied into a sharded one only (and a local one into a local one)")
        else:
            self.store(src.local() if src.is_sharded else src)

    def fill_(self, value: float) -> None:
        """Every element ``value``, as ``make`` starts a state."""
        registry.of(self.fmt).fill(self.local(), value)

    # --- moving between devices, as code that walks optimizer.state moves tensors ---------------------

    def to(self, *args, **kwargs) -> "QuantizedState":
        """The state on another device, byte for byte, as ``Tensor.to`` moves a tensor: itself where it is
        there already (unless ``copy=True``). Devices only: the codes and absmax keep their dtypes
        (``dequantize(dtype)`` gives the values in another)."""
        copy = kwargs.pop("copy", False)
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None or memory_format not in (None, torch.preserve_format):
            raise TypeError(f"QuantizedState.to moves a quantized state between devices; its codes (uint8) and "
                            f"absmax (float32) keep their dtypes and layouts (got dtype={dtype}, "
                            f"memory_format={memory_format}): use dequantize(dtype) for its values")
        return self._moved(lambda t: t.to(device, non_blocking=non_blocking, copy=copy))

    def cpu(self) -> "QuantizedState":
        return self._moved(Tensor.cpu)

    def cuda(self, device=None, non_blocking: bool = False) -> "QuantizedState":
        return self._moved(lambda t: t.cuda(device, non_blocking=non_blocking))

    def _moved(self, move) -> "QuantizedState":
        codes, absmax = move(self.codes), move(self.absmax)
        if codes is self.codes and absmax is self.absmax:
            return self
        return QuantizedState(codes, absmax, self.fmt, self.shape)

    def layout_error(self) -> str | None:
        """What is wrong with the codes and absmax for this state's format and shape (None: nothing), such as
        a walk that cast every tensor it found."""
        return registry.of(self.fmt).layout_error(self)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes held here (this rank's when sharded)."""
        local = self.local()
        return local.codes.nbytes + local.absmax.nbytes

    def __repr__(self) -> str:
        return f"QuantizedState({self.fmt.tag}, shape={tuple(self.shape)}, device={self.device})"

    def __getstate__(self) -> dict:
        """What pickle and deepcopy keep: codes and absmax of their own bytes (flat mode's are views of one pool
        per state, which pickle would write whole for every state)."""
        return {k: _own_bytes(v) if isinstance(v, Tensor) else v for k, v in self.__dict__.items()}


def _own_bytes(t: Tensor) -> Tensor:
    """``t``, or a copy of it where it is a view of a larger storage."""
    if is_dtensor(t) or t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone()


def is_dtensor(t) -> bool:
    """A sharded tensor (FSDP2 / tensor parallel), told apart without importing torch.distributed."""
    return type(t) is not Tensor and type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def convert(src, dst, through: torch.dtype | None = None) -> None:
    """The values of ``src`` into ``dst`` (each a tensor or a local ``QuantizedState`` of one shape, on any devices),
    span by span (``quant.spans``): a conversion's temporaries are a span's, never the whole tensor's. ``through``:
    each span is first rounded to that dtype."""
    shape = src.shape
    if tuple(shape) != tuple(dst.shape):
        raise ValueError(f"values of shape {tuple(shape)} for a state of shape {tuple(dst.shape)}")
    if is_dtensor(src) or is_dtensor(dst) or any(isinstance(x, QuantizedState) and x.is_sharded for x in (src, dst)):
        raise ValueError("a conversion runs on local tensors: convert a sharded state's local() into a local one")
    block = math.lcm(_span_block(src), _span_block(dst))
    read, write = _reader(src), _writer(dst)
    for rs, cs in quant.spans(shape, block):
        values = read(rs, cs)
        write(rs, cs, values if through is None else values.to(through))


def _span_block(x) -> int:
    return registry.of(x.fmt).span_block(x.fmt) if isinstance(x, QuantizedState) else 1


def _reader(x):
    if isinstance(x, QuantizedState):
        codec = registry.of(x.fmt)
        return lambda rs, cs: codec.read_span(x, rs, cs)
    rows = quant.rows_view(x, x.shape)  # (a view, but for a tensor laid out otherwise: then one copy of it)
    return lambda rs, cs: rows[rs, cs]


def _writer(x):
    if isinstance(x, QuantizedState):
        codec = registry.of(x.fmt)
        return lambda rs, cs, values: codec.write_span(x, rs, cs, values.to(x.device))
    rows = quant.rows_view(x, x.shape)
    if rows.data_ptr() != x.data_ptr() or not x.is_contiguous():
        raise ValueError("a conversion writes into a contiguous tensor")

    def write(rs, cs, values):
        rows[rs, cs] = values

    return write
