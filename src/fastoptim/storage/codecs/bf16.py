"""bf16 state: the param's shape, stored rounded to nearest even (``state_format="bf16"``, ``state_bits=16``).

The kernels widen it exactly (the top half of an fp32 pattern) and round back on the bits, as torch rounds, so
every path stores the same bytes."""

from __future__ import annotations

import torch
from torch import Tensor

from ..state import PLAIN, Format, is_dtensor
from .base import Codec, CppPieces


class BF16(Codec):
    name, bits = "bf16", 16

    def format_for(self, p: Tensor, state: str, min_quant_size: int, unsigned_states: frozenset) -> Format:
        return PLAIN if p.is_complex() or not p.is_floating_point() else self.format()

    def make(self, p: Tensor, fmt: Format, value: float) -> Tensor:
        return torch.full_like(p, value, dtype=torch.bfloat16, memory_format=torch.contiguous_format)

    def tensor_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16

    def kernel_format(self, state, p: Tensor) -> Format | None:
        if isinstance(state, Tensor) and not is_dtensor(state) and state.dtype == torch.bfloat16 \
                and state.is_contiguous() and state.shape == p.shape and state.device == p.device:
            return self.format()
        return None

    def cpp(self, k: int, fmt: Format, col: dict) -> CppPieces:
        ptr = f"reinterpret_cast<uint16_t*>(row[{col[f's{k}']}]) + at"
        return CppPieces(load="", lanes=f"bf16_lanes({ptr} + i)", tail=f"bf16_load({ptr} + i, n - i, S{k} + i);",
                         put=f"bf16_put({ptr} + i, {{x}});")

    def triton_pointers(self, i: int, fmt: Format) -> list[tuple[str, str, bool]]:
        return [(f"s{i}_ptr", "tl.int16", True)]

    def triton_load(self, i: int, fmt: Format, whole: bool) -> list[str]:
        # bf16 bits widened exactly: the top half of the fp32 pattern
        return [f"s{i} = (tl.load(s{i}_ptr + offs, mask=mask, other=0).to(tl.int32) << 16)"
                f".to(tl.float32, bitcast=True)"]

    def triton_store(self, i: int, fmt: Format, out: str) -> list[str]:
        # round to nearest even on the bits, as torch does; a NaN is stored as 0x7FC0
        return [f"s{i}_bits = {out}.to(tl.int32, bitcast=True)",
                f"s{i}_bf16 = (s{i}_bits + 0x7FFF + ((s{i}_bits >> 16) & 1)) >> 16",
                f"s{i}_bf16 = tl.where({out} != {out}, 0x7FC0, s{i}_bf16)",
                f"tl.store(s{i}_ptr + offs, s{i}_bf16.to(tl.int16), mask=mask)"]


BF16_CODEC = BF16()
