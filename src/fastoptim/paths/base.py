"""What every path shares: the bucket it runs on, the step context, the ``Path`` interface and the scalars'
packing (which path ran: ``record``; where Triton runs and where a warning points: ``environment``).

A *path* is one way a bucket can run (the loop, foreach, compiled, torch's fused kernel, the CPU kernel, Triton,
Triton on stored formats, staged, per-tensor stages). It declares which params of a bucket it takes
(``Path.takes``) and what it does itself (reads found_inf, applies the grad multiplier, counts its writes); it
runs those params with one ``StepContext`` (``Path.run``). Which path runs which params is decided in one place,
the dispatcher (``fastoptim.engine.dispatch``), which also does what a path declares it does not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from ..storage.state import is_dtensor  # noqa: F401 (the paths' import of it)


@dataclass
class Bucket:
    params: list[Tensor]
    grads: list[Tensor]
    states: list[list[Tensor] | None]  # one list per rule.state_names entry, None where inactive
    cache: dict = field(default_factory=dict)  # survives across steps: tensor tables, compiled fns
    # the DTensors whose local shards ``params`` are (None: every param is whole here): per-tensor stages gather
    # each whole tensor on one rank (``sharded``); elementwise math runs on the shards as they are
    sharded: list | None = None
    # its params or states are new tensors each step (the staged path's temporaries), in the same layouts: a part
    # keeps its cache across steps (``subset``), but not its lists of params and states
    transient: bool = False

    @property
    def device(self) -> torch.device:
        return self.params[0].device


class GradViews(list):
    """Grad views of a flat buffer, one list object for as long as they stay the same views (a path may keep
    what it worked out from them while it gets this very object; holding it keeps nothing else alive)."""


def subset(bucket: Bucket, indices: list[int], cache: dict | None = None) -> Bucket:
    """The params at ``indices`` of ``bucket``, with their grads and states; ``cache``: one that lives as long as
    ``bucket.cache`` and was made for these very indices (else the subset's cache starts empty). It keeps the
    subset's params and states too: they are fixed while the bucket's cache lives (only grads are new each step),
    unless the bucket is ``transient``."""
    if cache is None or bucket.transient:
        return Bucket([bucket.params[i] for i in indices], [bucket.grads[i] for i in indices],
                      [None if s is None else [s[i] for i in indices] for s in bucket.states],
                      {} if cache is None else cache, transient=bucket.transient)
    members = cache.get("subset_members")
    if members is None:
        members = cache["subset_members"] = ([bucket.params[i] for i in indices],
                                             [None if s is None else [s[i] for i in indices] for s in bucket.states])
    return Bucket(members[0], [bucket.grads[i] for i in indices], members[1], cache)


@dataclass
class StepContext:
    """One bucket's step, as every path gets it."""
    impl: str                           # the level the user picked ("auto", "loop", ...)
    rule: Any
    group: dict
    step: int
    scalars: tuple                      # ``rule.scalars(...)``: the update's host scalars, in its order
    flags: tuple                        # ``rule.bucket_flags(...)``
    grad_mul: Tensor | None = None      # what grads are multiplied by (1/scale times the clip factor)
    found_inf: Tensor | None = None     # GradScaler's flag, only where paths may read it in their kernels
    rounding: str = "nearest"           # how 16-bit params step through fp32 ("nearest": as the path does)
    entries: Callable | None = None     # i -> (state dict, optimizer index, param) of the bucket's i-th param
    run_plain: Callable | None = None   # (bucket, ctx) -> None: the dispatcher's route for plain-state buckets
    inf_read: bool | None = None        # found_inf as the dispatcher read it on the host (once per bucket)
    dense_grads: bool = False           # every grad is of its param's dtype and shape, contiguous (``with_grads``)
    written: list | None = None         # the params paths wrote uncounted, for one count a step (``dispatch``)

    def but(self, **changes) -> StepContext:
        return dataclasses.replace(self, **changes)


class Path:
    """One way a bucket can run. Class attributes declare what it does itself; the dispatcher does the rest."""
    name = ""                 # what ``record_paths`` reports
    records = True            # False: it reports itself (once per kernel launch, or per stage)
    takes_grad_mul = False    # it multiplies grads inside its kernel (else it gets scaled grads, and no multiplier)
    counted = True            # its writes count as in-place writes to autograd (else the dispatcher bumps versions)
    fallible = False          # it may fail to build: the dispatcher then runs its params on the next path
    stable_split = False      # what it takes follows from the bucket (and its grads' layouts): its parts keep caches

    def skips_in_kernel(self, ctx: StepContext) -> bool:
        """Whether it reads ``ctx.found_inf`` on the device (else the dispatcher reads it on the host first)."""
        return False

    def takes_grad_mul_of(self, ctx: StepContext) -> bool:
        """Whether it multiplies grads by ``ctx.grad_mul`` itself, in that dtype (else the dispatcher hands it
        grads already scaled, and no multiplier)."""
        return self.takes_grad_mul

    def takes(self, bucket: Bucket, ctx: StepContext) -> list[int] | None:
        """The indices of the params it runs; None: all of them."""
        return None

    def run(self, part: Bucket, ctx: StepContext) -> list[int] | None:
        """One step over ``part``; returns the indices (in ``part``) of params it left after all, or None."""
        raise NotImplementedError


def scaled_grads(grads: list[Tensor], grad_mul: Tensor | None) -> list[Tensor]:
    """Grads times ``grad_mul``, as new tensors (the user's ``.grad`` stays as it is)."""
    if grad_mul is None:
        return grads
    return torch._foreach_mul(grads, grad_mul)


def pack_scalars(scalars: tuple, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """The step's scalars as one tensor on ``device`` (float32; float64 for float64 buckets, so they keep
    their precision); tensor-valued ones (an lr kept on the device) are gathered there without a trip
    through the host."""
    if not any(isinstance(s, Tensor) for s in scalars):
        return torch.tensor(scalars, dtype=dtype).to(device, non_blocking=True)
    return torch.stack([torch.as_tensor(s, dtype=dtype, device=device).reshape(()) for s in scalars])


def compiled_scalars(scalars: tuple, device: torch.device, param_dtype: torch.dtype) -> Tensor:
    """The scalars tensor a compiled function takes: float64 for float64 params, else float32. Its length is
    static: dynamic, it would be "duck-sized" as one with a param's size of the same value, and unbinding it
    would then make that size static (a param of that size, a graph of its own)."""
    packed = pack_scalars(scalars, device, torch.float64 if param_dtype == torch.float64 else torch.float32)
    torch._dynamo.mark_static(packed, 0)
    return packed
