"""What the block-scaled formats share: a state kept as ``codes`` (uint8, the param's rows) and one fp32 ``absmax``
per block of a row, in a ``QuantizedState`` (``state``), and everything that follows from that layout alone:
which params take it, making, adopting, checking, checkpoint entries, conversions span by span (``quant.spans``),
the kernels' walk. A format of this kind (``dynamic``, ``fp8``) adds its numbers: how a span of values becomes
codes and absmax and back (``encode_span``/``decode_span``), its tag, and its kernel hooks."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .. import quant
from ..state import PLAIN, Format, QuantizedState, is_dtensor
from .base import Codec


class BlockScaled(Codec):
    quantized = True

    def block(self, fmt: Format) -> int:
        return quant.BLOCK[fmt.bits]

    def format_for(self, p: Tensor, state: str, min_quant_size: int, unsigned_states: frozenset) -> Format:
        if p.is_complex() or not p.is_floating_point() or p.dim() < 2 or p.numel() < min_quant_size:
            return PLAIN
        return self.format(signed=state not in unsigned_states)

    def formats(self) -> list[Format]:
        return [self.format(signed=True), self.format(signed=False)]

    def tensor_dtype(self, param_dtype: torch.dtype) -> None:
        return None  # codes and absmax (``parts``)

    # --- a span's numbers: the format's own ----------------------------------------------------------------

    def encode_span(self, values: Tensor, fmt: Format) -> tuple[Tensor, Tensor]:
        """Codes (uint8, one a value, not packed) and absmax (rows, blocks) of ``values`` (rows, n: whole blocks
        but a row's last), any float dtype read as fp32."""
        raise NotImplementedError

    def decode_span(self, codes: Tensor, absmax: Tensor, fmt: Format) -> Tensor:
        """fp32 values (rows, n) of unpacked ``codes`` (rows, n) and their blocks' ``absmax``."""
        raise NotImplementedError

    # --- making, adopting, converting ----------------------------------------------------------------------

    def make(self, p: Tensor, fmt: Format, value: float) -> QuantizedState:
        return QuantizedState.full(p, fmt, value)

    def adopt(self, value: Tensor, p: Tensor, fmt: Format) -> QuantizedState:
        if not value.is_floating_point():
            raise ValueError(f"has dtype {value.dtype}; a state must be floating point")
        return QuantizedState.of(value, fmt, p.device, through=p.dtype)  # (as torch's loader casts it first)

    def parts(self, shape: torch.Size, fmt: Format) -> list[tuple[torch.dtype, tuple]]:
        return [(torch.uint8, quant.codes_shape(shape, fmt.bits)),
                (torch.float32, quant.absmax_shape(shape, fmt.block))]

    def assemble(self, tensors: list[Tensor], fmt: Format, shape: torch.Size) -> QuantizedState:
        codes, absmax = tensors
        return QuantizedState(codes, absmax, fmt, torch.Size(shape))

    def tensors(self, state: QuantizedState) -> list[Tensor]:
        return [state.codes, state.absmax]

    def span_block(self, fmt: Format) -> int:
        return fmt.block

    def read_span(self, state: QuantizedState, rows: slice, columns: slice) -> Tensor:
        fmt = state.fmt
        codes, absmax = quant.read_span(state.codes, state.absmax, state.shape, fmt.bits, fmt.block, rows, columns)
        return self.decode_span(codes, absmax, fmt)

    def write_span(self, state: QuantizedState, rows: slice, columns: slice, values: Tensor) -> None:
        fmt = state.fmt
        quant.write_span(state.codes, state.absmax, state.shape, fmt.bits, fmt.block, rows, columns,
                         *self.encode_span(values, fmt))

    def fill(self, state: QuantizedState, value: float) -> None:
        """Each block of a constant state quantizes as one element does: that element's code and absmax."""
        quant.fill(state.codes, state.absmax, state.shape, state.fmt.bits, *self.constant(state.fmt, float(value)))

    @functools.lru_cache(maxsize=256)  # (a first step makes two states for each of thousands of params)
    def constant(self, fmt: Format, value: float) -> tuple[int, float]:
        """The code and absmax of an element ``value`` on its own."""
        codes, absmax = self.encode_span(torch.tensor([[value]], dtype=torch.float32), fmt)
        return int(codes), float(absmax)

    def layout_error(self, state: QuantizedState) -> str | None:
        codes_shape = quant.codes_shape(state.shape, state.fmt.bits)
        absmax_shape = quant.absmax_shape(state.shape, state.fmt.block)
        codes, absmax = state.codes, state.absmax
        if codes.dtype != torch.uint8 or tuple(codes.shape) != codes_shape or absmax.dtype != torch.float32 \
                or tuple(absmax.shape) != absmax_shape or absmax.device != codes.device:
            return (f"is a {state.fmt.tag} state of shape {tuple(state.shape)} with codes {codes.dtype} "
                    f"{tuple(codes.shape)} on {codes.device} and absmax {absmax.dtype} {tuple(absmax.shape)} on "
                    f"{absmax.device}; it needs uint8 codes {codes_shape} and float32 absmax {absmax_shape} on one "
                    f"device")
        return None

    def kernel_format(self, state, p: Tensor) -> Format | None:
        if not isinstance(state, QuantizedState) or state.fmt != self.format(state.fmt.signed):  # not ours
            return None
        if is_dtensor(state.codes) or state.shape != p.shape or state.device != p.device:
            return None
        ok = (state.codes.is_contiguous() and state.absmax.is_contiguous() and self.layout_error(state) is None)
        return state.fmt if ok else None

    def load(self, state: QuantizedState, p: Tensor) -> Tensor:
        return state.dequantize(p.dtype)

    def store(self, state: QuantizedState, values: Tensor) -> None:
        state.store(values)

    def entries(self, name: str, value: QuantizedState) -> dict:
        # no entry keeps the name itself: torch.optim fails loudly on such a checkpoint instead of reading codes
        return {name + ".codes": value.codes, name + ".absmax": value.absmax, name + ".format": value.fmt.id,
                name + ".shape": torch.tensor(list(value.shape), dtype=torch.int64)}

    # --- the kernels' walk: blocks of the format's own, along each row ----------------------------------

    def kernel_block(self, fmt: Format) -> int:
        return fmt.block

    def walk(self, p: Tensor, fmt: Format) -> tuple[int, int, int]:
        rows, length = quant.rows_of(p.shape)
        return rows, length, rows * -(-length // fmt.block)

    def columns(self, k: int, fmt: Format) -> list[str]:
        return [f"s{k}_codes", f"s{k}_absmax"]

    def triton_pointers(self, i: int, fmt: Format) -> list[tuple[str, str, bool]]:
        return [(f"s{i}_codes", "tl.uint8", True), (f"s{i}_absmax", "tl.float32", False)]
