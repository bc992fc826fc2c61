"""Plain state: the param's dtype and shape, what torch.optim keeps (``state_format="fp32"``, ``state_bits=32``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..state import PLAIN, Format
from .base import Codec


class Plain(Codec):
    name, aliases, bits = "fp32", ("plain",), 32

    def format_for(self, p: Tensor, state: str, min_quant_size: int, unsigned_states: frozenset) -> Format:
        return PLAIN

    def make(self, p: Tensor, fmt: Format, value: float) -> Tensor:
        if p.is_complex():  # the update runs on the real view: both halves start at the value
            value = complex(value, value)
        return torch.full_like(p, value, memory_format=torch.preserve_format)

    def adopt(self, value: Tensor, p: Tensor, fmt: Format) -> Tensor:
        if value.dtype == p.dtype:
            return value
        if value.dtype == torch.bfloat16 and p.is_floating_point():  # kept at 16 bits before
            return value.to(p.dtype)
        raise ValueError(f"has dtype {value.dtype}; the param has dtype {p.dtype}")


PLAIN_CODEC = Plain()
