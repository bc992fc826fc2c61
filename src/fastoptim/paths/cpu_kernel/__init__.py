"""The CPU kernel for 16/8/4-bit state: the rule's C++ twin loads, updates and stores each state in one pass
(``kernels``: the generated source, its build, the kernel's table of tensors; ``cpp_twin``: the rule's update
in C++), the fused level's path for stored state on the CPU. It takes fp32 params
whose grads are fp32 and contiguous and whose active states are all bf16, or all 8-bit, or all 4-bit (laid out
as the codec lays them out); the dispatcher runs the rest staged, as on every other level."""

from __future__ import annotations

import warnings

import torch

from . import kernels as cpu_kernels
from ...native import bulk
from ..base import Bucket, GradViews, Path, StepContext, pack_scalars, subset
from ..environment import caller_stacklevel
from ..record import took

_kernel_warned: set = set()


def _warn_staged(why: str) -> None:
    if why not in _kernel_warned:
        _kernel_warned.add(why)
        warnings.warn(f"fastoptim: 16/8/4-bit state runs staged on the CPU (slower, the same math): {why}",
                      RuntimeWarning, stacklevel=caller_stacklevel())


class CpuKernel(Path):
    """Which params it takes, and its tables, are worked out once per bucket (its params and states are fixed
    while the step plan holds it, which also checks that no state tensor moved) and again when a grad's dtype,
    contiguity or shape changes (new grads each step may differ: torch takes a grad of another dtype where
    ``p.grad_dtype`` allows it). Where the step's grads are *dense* (``StepContext.dense_grads``: each of its
    param's dtype and shape, contiguous) they are known without a look at each. Flat mode's grad views come as
    one list (``FlatBucket.head_grads``) that holds the same tensors for as long as it is the same list object;
    other grads are the user's, new each step, and only their kinds are kept (holding the list would keep last
    step's grads alive)."""
    name = "cpu_kernel"
    records = False  # one entry per kernel run (a part whose kernel will not build runs staged)
    takes_grad_mul = True
    counted = False
    stable_split = True

    def takes(self, bucket: Bucket, ctx: StepContext) -> list[int] | None:
        why = cpu_kernels.available()
        if why is not None:
            _warn_staged(why)
            return []
        seen = bucket.cache.get("cpu_kernel_takes")
        kinds = _grad_kinds(bucket.grads, ctx, seen)
        if seen is None or kinds is not SAME and seen[0] != kinds:
            n = len(bucket.params)
            taken = [i for i in range(n) if cpu_kernels.signature(bucket.params, bucket.grads, bucket.states, i)]
            seen = (kinds, None if len(taken) == n else taken)
        bucket.cache["cpu_kernel_takes"] = (seen[0], seen[1], _kept(bucket.grads))
        return seen[1]

    def run(self, part: Bucket, ctx: StepContext) -> list[int] | None:
        cached = part.cache.get("cpu_kernel")
        kinds = _grad_kinds(part.grads, ctx, cached)
        same_grads = kinds is SAME
        if cached is None or not same_grads and cached[0] != kinds:
            by_formats: dict[tuple, list[int]] = {}
            rest = []
            for i in range(len(part.params)):
                formats = cpu_kernels.signature(part.params, part.grads, part.states, i)
                (rest if formats is None else by_formats.setdefault(formats, [])).append(i)
            tables = []
            for formats, indices in by_formats.items():
                one = subset(part, indices)
                tables.append((cpu_kernels.Table(one.params, one.grads, one.states, formats), indices))
            cached = (kinds, tables, rest, None)
        part.cache["cpu_kernel"] = cached = (cached[0] if same_grads else kinds,) + cached[1:3] + (_kept(part.grads),)
        _, tables, rest, _ = cached
        packed = pack_scalars(ctx.scalars, part.device)
        mul = None if ctx.grad_mul is None else ctx.grad_mul.to(part.device, torch.float32).reshape(())
        failed = list(rest)
        for table, indices in tables:
            if not same_grads:
                table.point_at([part.grads[i] for i in indices])
            try:
                cpu_kernels.run(ctx.rule.update, table, packed, ctx.flags, mul)
            except cpu_kernels.KernelUnavailable as e:  # this kernel would not build: its params run staged
                _warn_staged(str(e))
                failed += indices
                continue
            took("cpu_kernel")
        return sorted(failed) or None


CPU_KERNEL = CpuKernel()


SAME = object()  # the very grads the cache was made with (flat mode's views)
DENSE = "dense"  # grads of their params' dtype and shape, contiguous: what the params' kinds say


def _grad_kinds(grads, ctx: StepContext, cached: tuple | None):
    """What a cached answer depends on of this step's grads: ``SAME``, ``DENSE``, or each grad's kind."""
    if cached is not None and cached[-1] is grads:
        return SAME
    return DENSE if ctx.dense_grads else bulk.kinds(grads)


def _kept(grads):
    """The grads a cache may hold: flat mode's views (the same list while they stay the same), no others."""
    return grads if isinstance(grads, GradViews) else None
