"""The loop level: the rule runs on one tensor at a time. The reference every other level must match."""

from __future__ import annotations

from typing import Callable, Sequence

from torch import Tensor


def run(update: Callable, params: list[Tensor], grads: list[Tensor], states: Sequence[list[Tensor] | None],
        scalars: tuple, flags: tuple) -> None:
    for i, (p, g) in enumerate(zip(params, grads)):
        per_param = [None if s is None else s[i] for s in states]
        new_p, *new_states = update(p, g, *per_param, *scalars, *flags)
        p.copy_(new_p)
        for s, new in zip(per_param, new_states):
            if s is not None:
                s.copy_(new)
