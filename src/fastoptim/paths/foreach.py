"""The foreach level: the rule runs once over whole tensor lists through ``torch._foreach_*`` kernels.

``TensorList`` gives a list of tensors the arithmetic operators a rule uses, so the rule's single source
runs here unchanged; each operator is one horizontal-fusion call over the list.
"""

from __future__ import annotations

from numbers import Number
from typing import Callable, Sequence

import torch
from torch import Tensor

from .base import Bucket, Path, StepContext
from .blocking import blocks

# a CPU block of at least this many tensors runs gathered into one tensor per role (``_apply_gathered``)
GATHER_MIN_TENSORS = 4


class TensorList:
    __slots__ = ("tensors",)

    def __init__(self, tensors: list[Tensor]):
        self.tensors = tensors

    @staticmethod
    def _binary(op, a, b):
        return TensorList(op(a.tensors, b.tensors if isinstance(b, TensorList) else b))

    def __add__(self, other):
        return self._binary(torch._foreach_add, self, other)

    __radd__ = __add__

    def __sub__(self, other):
        return self._binary(torch._foreach_sub, self, other)

    def __rsub__(self, other: Number):
        return TensorList(torch._foreach_add(torch._foreach_neg(self.tensors), other))

    def __mul__(self, other):
        return self._binary(torch._foreach_mul, self, other)

    __rmul__ = __mul__

    def __truediv__(self, other):
        return self._binary(torch._foreach_div, self, other)

    def __rtruediv__(self, other: Number):
        return TensorList(torch._foreach_mul(torch._foreach_reciprocal(self.tensors), other))

    def __neg__(self):
        return TensorList(torch._foreach_neg(self.tensors))

    def sqrt(self):
        return TensorList(torch._foreach_sqrt(self.tensors))

    def sign(self):
        return TensorList(torch._foreach_sign(self.tensors))

    def maximum(self, other):
        return self._binary(torch._foreach_maximum, self, other)

    def clamp(self, lo, hi):
        return TensorList(torch._foreach_clamp_max(torch._foreach_clamp_min(self.tensors, lo), hi))


def apply(update: Callable, params: list[Tensor], grads: list[Tensor], states: Sequence[list[Tensor] | None],
          scalars: tuple, flags: tuple) -> None:
    cpu = params[0].device.type == "cpu"
    parts = blocks(params, grads, states) if cpu else [(params, grads, states)]
    for ps, gs, ss in parts:
        if cpu and len(ps) >= GATHER_MIN_TENSORS:
            _apply_gathered(update, ps, gs, ss, scalars, flags)
            continue
        wrapped = [None if s is None else TensorList(s) for s in ss]
        new_p, *new_states = update(TensorList(ps), TensorList(gs), *wrapped, *scalars, *flags)
        torch._foreach_copy_(ps, new_p.tensors)
        for s, new in zip(ss, new_states):
            if s is not None:
                torch._foreach_copy_(s, new.tensors)


def _apply_gathered(update: Callable, ps: list[Tensor], gs: list[Tensor], ss: Sequence[list[Tensor] | None],
                    scalars: tuple, flags: tuple) -> None:
    """A cache-sized block of many small tensors: each role gathered into one contiguous tensor, the rule
    run once on those, the results scattered back. Elementwise math on the same values in the same
    dtype: the numbers are the ones the per-list path gives, without a temporary per tensor per operator."""
    flatten, unflatten = torch._C._nn.flatten_dense_tensors, torch._C._nn.unflatten_dense_tensors
    new_p, *new_states = update(flatten(ps), flatten(gs), *[None if s is None else flatten(s) for s in ss],
                                *scalars, *flags)
    for targets, new in zip([ps, *ss], [new_p, *new_states]):
        if targets is not None:
            torch._foreach_copy_(targets, unflatten(new, targets))


class Foreach(Path):
    """Whole tensor lists through ``torch._foreach_*`` kernels (cache-blocked, and gathered, on the CPU)."""
    name = "foreach"

    def run(self, part: Bucket, ctx: StepContext) -> None:
        apply(ctx.rule.update, part.params, part.grads, part.states, ctx.scalars, ctx.flags)


FOREACH = Foreach()
