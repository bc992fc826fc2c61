"""What a codec is: the ``Codec`` interface and ``CppPieces`` (``storage.codecs`` lists the codecs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..state import Format

PIECE = 256  # elements per kernel work item of a format without blocks of its own (the flat tensor's pieces)


@dataclass
class CppPieces:
    """One state's part of the CPU kernel's source: file-scope ``constants``, the ``codec`` line made once per
    call, the ``load`` of a block into the fp32 array ``S<k>`` and its ``store`` back, and the codec's ``probe``
    (its test hook). Lines of C++; empty where the format has none.

    A format whose elements decode on their own gives ``lanes``, an expression for the values from element
    ``i`` on (one register's lanes), read in the update's loop, and ``tail``, the load of elements ``[i, n)``
    into ``S<k> + i`` (the block's last few, run one at a time); its ``load`` then only prepares them (no pass
    of its own). One whose elements also encode on their own gives ``put``, a statement that stores ``{x}``
    (lanes or one float) at element ``i`` as the update computes it, and no ``store``. A block-scaled one
    gives ``deferred`` instead of ``store``: its codes are written while the update runs over the next block."""
    load: str
    store: str = ""
    lanes: str = ""
    tail: str = ""
    put: str = ""
    deferred: "Deferred | None" = None
    constants: list[str] = field(default_factory=list)
    codec: str = ""
    probe: str = ""
    top: bool = False  # the kernel keeps ``top<k>``, the largest magnitude written, for ``store`` (a block's absmax)


@dataclass
class Deferred:
    """A block-scaled state's store, put off by one block: its encode (which needs the block's absmax, so the
    update's whole pass first) runs a register's lanes at a time inside the next block's update loop, where the
    update's divisions leave the vector units idle. The kernel keeps the last block's new values in
    ``last<k>`` (``n_last`` of them) and runs ``finish`` after each block's update (its absmax written, the
    codec's own ``last_*`` variables set for that block), ``lanes`` for elements ``[i, i + LANES)`` of the last
    block, ``rest`` for its elements ``[i, n_last)``. ``decls``: the codec's ``last_*`` variables."""
    decls: str
    finish: str
    lanes: str
    rest: str


class Codec:
    """One state format. Subclasses fill in what their format does; ``Format`` stays the small immutable value a
    state, a checkpoint tag and a kernel's cache key carry (``of`` finds its codec)."""
    name: str
    aliases: tuple = ()
    bits: int
    quantized = False
    key: int | str  # what ``state_bits`` holds for it; ``format_name``: its formats' ``codec`` (``register``)
    format_name: str | None = None

    def format(self, signed: bool = True) -> Format:
        """A format of this codec's (of its width's own, or naming it where it is registered beside that)."""
        return Format(self.bits, signed, self.format_name)

    def format_for(self, p: Tensor, state: str, min_quant_size: int, unsigned_states: frozenset) -> Format:
        raise NotImplementedError

    def tensor_dtype(self, param_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype of a state kept as one tensor of the param's shape (flat mode keeps it in a view of one
        buffer of that dtype), or None: it is kept otherwise (``parts``), and flat mode keeps it apart."""
        return param_dtype

    def adopt(self, value: Tensor, p: Tensor, fmt: Format) -> Any:
        """A tensor of the param's shape and device (a torch.optim checkpoint's, a user's) as a state in ``fmt``:
        converted to ``tensor_dtype`` (rounded to nearest). ValueError naming what does not fit."""
        wanted = self.tensor_dtype(p.dtype)
        return value if value.dtype == wanted else value.to(wanted)

    # --- a state kept as several tensors (``tensor_dtype`` None) -------------------------------------------

    def parts(self, shape: torch.Size, fmt: Format) -> list[tuple[torch.dtype, tuple]]:
        """(dtype, shape) of each tensor a state of a param of ``shape`` is kept in, in ``tensors`` order."""
        raise NotImplementedError(f"{self.name} keeps a state as one tensor")

    def assemble(self, tensors: list[Tensor], fmt: Format, shape: torch.Size) -> Any:
        """The state whose tensors (``parts``) are ``tensors``: views, not copies (flat mode's pooled states)."""
        raise NotImplementedError(f"{self.name} keeps a state as one tensor")

    # conversions of a state kept as several tensors, span by span (``state.convert``: never the whole tensor)

    def span_block(self, fmt: Format) -> int:
        """Spans of a conversion start at multiples of this (a block of the codec's own)."""
        raise NotImplementedError(f"{self.name} keeps a state as one tensor")

    def read_span(self, state: Any, rows: slice, columns: slice) -> Tensor:
        """The values (rows, columns) of a local ``state`` read as rows (``quant.rows_of``), any float dtype."""
        raise NotImplementedError(f"{self.name} keeps a state as one tensor")

    def write_span(self, state: Any, rows: slice, columns: slice, values: Tensor) -> None:
        """``values`` (on the state's device) into the span (rows, columns) of a local ``state``."""
        raise NotImplementedError(f"{self.name} keeps a state as one tensor")

    def fill(self, state: Any, value: float) -> None:
        """Every element of a local ``state`` ``value``, written directly."""
        raise NotImplementedError(f"{self.name} keeps a state as one tensor")

    def layout_error(self, state: Any) -> str | None:
        """What is wrong with the tensors of ``state`` for its format and shape (None: nothing)."""
        return None

    def tensors(self, state: Any) -> list[Tensor]:
        """The tensors a state is kept in: the kernels' table holds one address per tensor, in this order."""
        return [state]

    def kernel_format(self, state: Any, p: Tensor) -> Format | None:
        """``state``'s format where a kernel can load and store it in place (local, contiguous, laid out as this
        codec lays it out), else None: not this codec's, or not so laid out."""
        return None

    def make(self, p: Tensor, fmt: Format, value: float) -> Any:
        raise NotImplementedError

    def load(self, state: Any, p: Tensor) -> Tensor:
        return state.to(p.dtype)

    def store(self, state: Any, values: Tensor) -> None:
        state.copy_(values)

    def tag(self, fmt: Format) -> str:
        """What a checkpoint records of ``fmt`` (``Format.tag``: a quantized format's map and block)."""
        return f"bits{fmt.bits}" if fmt.codec is None else fmt.codec

    def formats(self) -> list[Format]:
        """The formats a checkpoint may name (``codecs.from_id``, by their tag's id): those of states kept as
        several tensors, which ``state_dict()`` writes with that id."""
        return []

    def qmap(self, fmt: Format) -> Any:
        """A quantized format's map (``quant.QuantMap``)."""
        raise ValueError(f"a {self.name} state has no quantization map")

    def block(self, fmt: Format) -> int:
        """A quantized format's elements per absmax block."""
        raise ValueError(f"a {self.name} state has no quantization blocks")

    def entries(self, name: str, value: Any) -> dict:
        """What ``state_dict()`` holds for state ``name``: the state itself for tensors."""
        return {name: value}

    # --- the kernels' walk over a param (CPU and Triton) ---------------------------------------------------

    def kernel_block(self, fmt: Format) -> int:
        """Elements per work block: a block of the codec's own, or a piece of the flat tensor."""
        return PIECE

    def walk(self, p: Tensor, fmt: Format) -> tuple[int, int, int]:
        """(rows, row length, blocks) a kernel walks for ``p``: blocks of ``kernel_block`` never cross a row.
        One row, the flat tensor, by default."""
        return 1, p.numel(), -(-p.numel() // self.kernel_block(fmt))

    def tables(self, fmt: Format, device: torch.device = torch.device("cpu")) -> tuple[Tensor, ...]:
        """Tables a kernel reads for ``fmt`` (a map's values, an encoder's), on ``device``; () for none."""
        return ()

    def columns(self, k: int, fmt: Format) -> list[str]:
        """The names of state ``k``'s columns in the CPU kernel's table (one per ``tensors``)."""
        return [f"s{k}"]

    def cpp(self, k: int, fmt: Format, col: dict) -> CppPieces | None:
        """State ``k``'s pieces of the CPU kernel (``col``: the table's column of each address), or None: the
        kernel does not take this format."""
        return None

    def triton_pointers(self, i: int, fmt: Format) -> list[tuple[str, str, bool]]:
        """State ``i``'s pointers in the Triton kernel, one per ``tensors``: (name, element type, whether it
        lies where the values do, so it takes the whole-rows branch's alignment hint)."""
        raise NotImplementedError(f"no Triton kernel hook for {self.name}")

    def triton_tables(self, i: int, fmt: Format) -> list[tuple[str, str]]:
        """The Triton kernel's arguments for ``tables`` (name, type), in that order."""
        return []

    def triton_prelude(self, whole: bool) -> list[str]:
        """Lines a tile's body needs once before any state of this codec loads (offsets of its own)."""
        return []

    def triton_load(self, i: int, fmt: Format, whole: bool) -> list[str]:
        raise NotImplementedError(f"no Triton kernel hook for {self.name}")

    def triton_store(self, i: int, fmt: Format, out: str) -> list[str]:
        raise NotImplementedError(f"no Triton kernel hook for {self.name}")
