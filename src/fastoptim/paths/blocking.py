"""Cache blocking for the CPU: run the elementwise rule over pieces that fit in cache.

A rule written as pure expressions allocates a temporary per operator. On the CPU a temporary the size
of a whole large tensor costs an mmap, page faults and a munmap per operator per step, and streams
memory once per operator; pieces of ~BLOCK_NUMEL elements stay in cache and reuse the allocator's
memory. The rule is elementwise, so running it piece by piece gives the same numbers.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from torch import Tensor

BLOCK_NUMEL = 1 << 16


def _pieces(p: Tensor, g: Tensor, states: Sequence[Tensor | None], block: int):
    """(p, g, *states) split into flat views of ``block`` elements when all are contiguous."""
    n = p.numel()
    if n <= block or not (p.is_contiguous() and g.is_contiguous()
                          and all(s is None or s.is_contiguous() for s in states)):
        yield p, g, list(states)
        return
    flat = [t.view(-1).split(block) for t in (p, g)]
    flat_states = [None if s is None else s.view(-1).split(block) for s in states]
    for i in range(len(flat[0])):
        yield flat[0][i], flat[1][i], [None if s is None else s[i] for s in flat_states]


def blocks(params: list[Tensor], grads: list[Tensor], states: Sequence[list[Tensor] | None],
           block: int = BLOCK_NUMEL) -> Iterator[tuple[list[Tensor], list[Tensor], list[list[Tensor] | None]]]:
    """Lists of (param, grad, state) pieces with about ``block`` elements in all per yield."""
    ps, gs, ss, size = [], [], [[] if s is not None else None for s in states], 0
    for i, (p, g) in enumerate(zip(params, grads)):
        for piece_p, piece_g, piece_states in _pieces(p, g, [None if s is None else s[i] for s in states], block):
            ps.append(piece_p)
            gs.append(piece_g)
            for lst, t in zip(ss, piece_states):
                if lst is not None:
                    lst.append(t)
            size += piece_p.numel()
            if size >= block:
                yield ps, gs, ss
                ps, gs, ss, size = [], [], [[] if s is not None else None for s in states], 0
    if ps:
        yield ps, gs, ss
