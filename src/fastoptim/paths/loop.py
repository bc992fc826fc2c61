"""The loop level: the rule runs on one tensor at a time. The reference every other level must match."""

from __future__ import annotations

from typing import Callable, Sequence

from torch import Tensor

from .base import Bucket, Path, StepContext
from .blocking import BLOCK_NUMEL, _pieces


def apply(update: Callable, params: list[Tensor], grads: list[Tensor], states: Sequence[list[Tensor] | None],
          scalars: tuple, flags: tuple) -> None:
    cpu = params[0].device.type == "cpu"
    for i, (p, g) in enumerate(zip(params, grads)):
        per_param = [None if s is None else s[i] for s in states]
        pieces = _pieces(p, g, per_param, BLOCK_NUMEL) if cpu else [(p, g, per_param)]
        for piece_p, piece_g, piece_states in pieces:
            new_p, *new_states = update(piece_p, piece_g, *piece_states, *scalars, *flags)
            piece_p.copy_(new_p)
            for s, new in zip(piece_states, new_states):
                if s is not None:
                    s.copy_(new)


class Loop(Path):
    """The reference: one tensor at a time (cache-sized pieces on the CPU)."""
    name = "loop"

    def run(self, part: Bucket, ctx: StepContext) -> None:
        apply(ctx.rule.update, part.params, part.grads, part.states, ctx.scalars, ctx.flags)


LOOP = Loop()
