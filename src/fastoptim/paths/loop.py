"""The loop level: the rule runs on one tensor at a time. The reference every other level must match."""

from __future__ import annotations

from typing import Callable, Sequence

from torch import Tensor

from .base import Bucket, scaled_grads, took
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


def run(rule, bucket: Bucket, group: dict, step: int, scalars: tuple, flags: tuple, grad_mul=None) -> None:
    took("loop")
    apply(rule.update, bucket.params, scaled_grads(bucket.grads, grad_mul), bucket.states, scalars, flags)
