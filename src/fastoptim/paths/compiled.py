"""The compiled level: ``torch.compile`` of the rule, one in-place kernel per tensor shape class.

The compiled function applies the rule and copies the results into the param and state tensors
inside the graph, so Inductor writes them in place: one pass over memory. Hyper-parameters travel as
one float32 tensor (``scalars``), unbound inside the graph, so a schedule changing lr or betas every
step never recompiles; the FLAGS (fixed for a run) are baked into one compiled function per
combination. Contiguous tensors go in as 1-D views with dynamic sizes, so one compiled kernel serves
every param of a bucket. Dynamo specialises a size of 1 (a graph of its own), so the bucket's 1-element tensors
(0-d params, biases of one) go in together, as one call on their concatenation of at least 2 elements, and are
written back after it: exact, since the update is elementwise (each element's result depends on that element and
the scalars alone; the foreach level runs the same source on tensor lists).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
from torch import Tensor

from . import loop
from .base import Bucket, Path, StepContext, compiled_scalars, scaled_grads

# Tensors smaller than this are not compiled where the dispatcher routes (they take the fused level's route): one
# compiled call per tensor costs more than it saves. Decided per tensor, never by the bucket's mix, so a param's
# path (and its bits) does not depend on which params share its bucket. Flat buffers are one large tensor.
MIN_NUMEL = 1 << 14


def large_tensors(bucket: Bucket) -> list[int]:
    """The indices of the bucket's params of at least ``MIN_NUMEL`` elements, worked out once per bucket (a param's
    shape is fixed while the bucket's cache lives: the step plan makes a new bucket when it changes)."""
    large = bucket.cache.get("compiled_large")
    if large is None:
        large = bucket.cache["compiled_large"] = [i for i, p in enumerate(bucket.params) if p.numel() >= MIN_NUMEL]
    return large


def _in_place(update: Callable, flags: tuple) -> Callable:
    def step(p: Tensor, g: Tensor, states: list, scalars: Tensor) -> None:
        values = scalars.unbind(0)
        # the grad multiplier rides last in ``scalars``, 1 where there is none (exact): steps with and without
        # clipping or unscaling share one graph
        g = g * values[-1]
        out = update(p, g, *states, *values[:-1], *flags)
        p.copy_(out[0])
        for s, new in zip(states, out[1:]):
            if s is not None:
                s.copy_(new)
    # a code object of its own: torch.compile keeps its cache (and its recompile limit) per code object
    step.__code__ = step.__code__.replace(co_name=f"{update.__name__}_step")
    return step


def _flat(t: Tensor) -> Tensor:
    """A 1-D alias that is not a view and does not require grad: torch.compile guards on a view's base
    layout and on requires_grad, which would otherwise make each param shape its own compile."""
    return t.view(-1).detach()


def _run_packed(fn: Callable, part: Bucket, grads: list, indices: list[int], scalars_t: Tensor) -> None:
    """``fn`` once over the 1-element tensors at ``indices``, concatenated (the first repeated where it is alone:
    a call of one element would compile a graph of its own), and their new values copied back."""
    rows = indices if len(indices) > 1 else indices * 2
    p = torch.cat([_flat(part.params[i]) for i in rows])
    g = torch.cat([_flat(grads[i]) for i in rows])
    states = [None if s is None else torch.cat([_flat(s[i]) for i in rows]) for s in part.states]
    fn(p, g, states, scalars_t)
    n = len(indices)
    for packed, targets in zip((p, *states), (part.params, *part.states)):
        if packed is not None:
            torch._foreach_copy_([_flat(targets[i]) for i in indices], list(packed[:n].split(1)))


@lru_cache(maxsize=None)
def compiled_step(update: Callable, flags: tuple, dtype: torch.dtype) -> Callable:
    """One compiled function per rule, FLAGS and dtype: one graph for every size of 2 and up (1-element tensors
    go in packed, ``_run_packed``)."""
    return torch.compile(_in_place(update, flags), dynamic=True, fullgraph=True)


class Compiled(Path):
    """The rule compiled by Inductor, one in-place call per tensor (strided tensors eagerly, one at a time).
    ``fallible``: where the fused level compiles on the CPU, a rule that fails to compile runs elsewhere.
    ``large_only``: it takes the tensors of at least ``MIN_NUMEL`` elements (the routed levels' compiled path), and
    leaves the others to the next path of the chain."""
    name = "compiled"
    takes_grad_mul = True
    stable_split = True  # what it takes follows from the params' sizes: the part it leaves keeps its caches

    def __init__(self, fallible: bool = False, large_only: bool = False):
        self.fallible = fallible
        self.large_only = large_only

    def takes(self, bucket: Bucket, ctx: StepContext) -> list[int] | None:
        if not self.large_only:
            return None
        large = large_tensors(bucket)
        return None if len(large) == len(bucket.params) else large

    def run(self, part: Bucket, ctx: StepContext) -> None:
        grad_mul, scalars, flags = ctx.grad_mul, ctx.scalars, ctx.flags
        dtype = part.params[0].dtype
        fn = compiled_step(ctx.rule.update, tuple(flags), dtype)
        scalars_t = compiled_scalars((*scalars, 1.0 if grad_mul is None else grad_mul), part.device, dtype)
        grads = part.grads
        strided = []  # non-contiguous tensors: each layout would be a recompile; they run eagerly instead
        singles = {}  # contiguous 1-element tensors by their tensors' dtypes: one packed call per kind (a size of 1
        # would be a graph of its own)
        for i, (p, g) in enumerate(zip(part.params, grads)):
            states = [None if s is None else s[i] for s in part.states]
            if p.numel() == 0:
                continue
            if not all(t is None or t.is_contiguous() for t in (p, g, *states)):
                strided.append(i)
                continue
            if p.numel() == 1:
                singles.setdefault(tuple(None if t is None else t.dtype for t in (g, *states)), []).append(i)
                continue
            fn(_flat(p), _flat(g), [None if s is None else _flat(s) for s in states], scalars_t)
        for indices in singles.values():
            _run_packed(fn, part, grads, indices, scalars_t)
        if strided:
            grads = scaled_grads([grads[i] for i in strided], grad_mul)
            loop.apply(ctx.rule.update, [part.params[i] for i in strided], grads,
                       [None if s is None else [s[i] for i in strided] for s in part.states], scalars, flags)


COMPILED = Compiled()  # the compiled level's own path (routing off): every tensor
COMPILED_LARGE = Compiled(large_only=True)  # the routed compiled level: large tensors; the rest, the fused route
# the fused level's CPU path for its large tensors: a rule that will not compile runs foreach
COMPILED_OR_NEXT = Compiled(fallible=True, large_only=True)
