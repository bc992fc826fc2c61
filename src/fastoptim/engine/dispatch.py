"""The dispatcher: the one place that decides how a bucket runs.

For each bucket of a step plan it picks a chain of paths (``paths``) by the level the user asked for (``impl``),
the device, the dtype, the tensors' sizes and each state's format, and runs it: each path takes the params it
declares it can (``Path.takes``), and the part it leaves runs on the next path of the chain. The dispatcher alone
  * reads GradScaler's found_inf on the host before any path that cannot skip in its kernel (``engine.amp`` says
    when a step's kernels read it themselves);
  * hands a path the grad multiplier, in the dtype the bucket steps in, or grads already scaled
    (``Path.takes_grad_mul_of``);
  * counts a step as an in-place write to each param a path writes behind autograd's back, and to the params
    the user holds where the plan stepped views of them (flat buffers, shards, real views): collected in
    ``ctx.written``, counted by the caller in one pass a step;
  * reports what ran (``record_paths``).

The routes (``ROUTING`` on; ``own_paths`` turns it off, to compare the levels themselves):
  * loop: the loop path, always (the reference the others are tested against);
  * foreach: on the CPU the fused level's route (``ROUTE_FOREACH_ON_CPU``: never slower there, and the foreach
    path's pure expressions take twice the passes over memory of torch's in-place foreach kernels);
  * compiled: tensors of at least ``COMPILED_MIN_NUMEL`` elements compiled, the smaller ones the fused level's route;
  * fused and auto: Triton on CUDA and under ``TRITON_INTERPRET=1`` (what it leaves: foreach); on another GPU,
    foreach; on the CPU torch's fused kernel where the rule names one (strided tensors: foreach), else the rule
    compiled for tensors of at least ``COMPILED_MIN_NUMEL`` elements (a rule that fails to compile: foreach, with a
    warning), and foreach for the smaller ones.
Sizes route each tensor by its own size, never by the bucket's mix: a param's path, and so its bits, must not depend
on which params share its bucket (gradient release steps subsets of the step's buckets, to the same bits).
State kept at 16/8/4 bits first meets the path that loads and stores it in its own kernel (``stored_path``: the
fused level's, and the foreach and compiled levels' on the CPU, where they take the fused level's route); what it
leaves runs staged (``paths.staged``) through the plain route. Per-tensor stages run as ``paths.stages``.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import Tensor

from .. import storage
from ..paths.base import Bucket, Path, StepContext, scaled_grads, subset
from ..paths.environment import caller_stacklevel, uses_triton
from ..paths.record import took
from ..paths.compiled import COMPILED, COMPILED_LARGE, COMPILED_OR_NEXT, MIN_NUMEL as COMPILED_MIN_NUMEL, large_tensors
from ..paths.cpu_kernel import CPU_KERNEL
from ..paths.foreach import FOREACH
from ..paths.loop import LOOP
from ..paths.stages import STAGES
from ..paths.staged import STAGED
from ..paths.torch_fused import TORCH_FUSED, TorchFused
from ..paths.triton import TRITON, TRITON_STORED
from .amp import StepAmp
from .plan import Plan

IMPLS = ("auto", "loop", "foreach", "fused", "compiled")
LEVELS = IMPLS[1:]  # the concrete levels ("auto" picks one of them)
ROUTE_FOREACH_ON_CPU = True
# The master switch: False makes every level run its own path (`fastoptim bench --own-paths`, the tests).
ROUTING = True
_said: set = set()
_not_compilable: set = set()  # rules whose compiling for the CPU failed: the fused level runs them foreach


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"Unknown impl {impl!r}; valid values: {', '.join(repr(i) for i in IMPLS)}")
    return impl


@contextmanager
def own_paths(on: bool = True) -> Iterator[None]:
    """While the block runs, every level runs its own path (``ROUTING`` off): for comparing the levels
    themselves (``fastoptim curves``, ``fastoptim bench --own-paths``)."""
    global ROUTING
    outer = ROUTING
    ROUTING = outer and not on
    try:
        yield
    finally:
        ROUTING = outer


def say_routed(impl: str, to: str, why: str) -> None:
    """One warning per process and level: a level the user picked runs another one's path."""
    if impl in _said:
        return
    _said.add(impl)
    warnings.warn(f"fastoptim: impl={impl!r} runs the {to} level's path here: {why}", RuntimeWarning,
                  stacklevel=caller_stacklevel())


# --- routes ------------------------------------------------------------------------------------------------

def plain_route(impl: str, bucket: Bucket, rule) -> tuple[Path, ...]:
    """The chain of paths for ``bucket`` with plain state, at level ``impl``."""
    if rule.stages:
        return (STAGES,)
    device = bucket.device
    if impl == "loop":
        return (LOOP,)
    if impl == "foreach":
        if not (device.type == "cpu" and ROUTING and ROUTE_FOREACH_ON_CPU):
            return (FOREACH,)
        say_routed("foreach", "fused", "on the CPU it is never slower, and the foreach level's pure expressions "
                   "take twice the passes over memory of torch's in-place foreach kernels")
    elif impl == "compiled":
        if not ROUTING:
            return (COMPILED,)
        n, large = len(bucket.params), len(large_tensors(bucket))
        if large == n:
            return (COMPILED_LARGE,)
        say_routed("compiled", "fused", f"for tensors under {COMPILED_MIN_NUMEL} elements ({n - large} of {n} in a "
                   "bucket here) one compiled call per tensor would cost more than its step; flat=True compiles one "
                   "call over the whole buffer")
        # the large ones compiled, the small ones (what COMPILED_LARGE leaves) on the fused route for small tensors
        return ((COMPILED_LARGE,) if large else ()) + _fused_route(bucket, rule, compile_large=False)
    return _fused_route(bucket, rule, compile_large=True)


def _fused_route(bucket: Bucket, rule, compile_large: bool) -> tuple[Path, ...]:
    """The fused level's chain; ``compile_large``: the CPU compiles the rule for large tensors where torch has no
    fused kernel for it (False: the compiled level took those already)."""
    device = bucket.device
    if uses_triton(device):  # CUDA, or CPU tensors under TRITON_INTERPRET=1: what Triton leaves runs foreach
        return (TRITON, FOREACH)
    if device.type != "cpu":  # a GPU without Triton installed: the foreach path is exact there
        return (FOREACH,)
    if TorchFused.declared(rule, bucket.params[0].dtype):
        return (TORCH_FUSED, FOREACH)
    if compile_large and rule.update not in _not_compilable and large_tensors(bucket):
        return (COMPILED_OR_NEXT, FOREACH)  # (it takes the large tensors; foreach the rest, if any)
    return (FOREACH,)


def stored_path(impl: str, device: torch.device, rounding: str = "nearest") -> Path | None:
    """The one place that says which path may see 16/8/4-bit state as it is stored: the path that loads and
    stores it inside its own kernel for ``impl`` on ``device``, or None. Every other path, torch's own fused
    kernels among them, gets plain temporaries (``paths.staged``), so a storage option no path declares can
    never be silently ignored.

    Declared: the fused level (and "auto"; and foreach, and compiled on the CPU, where they run the fused
    level's path) with fp32 params whose active states are all bf16, or all 8-bit, or all 4-bit: on CUDA and
    under ``TRITON_INTERPRET=1`` the Triton kernel (``TRITON_STORED``), on the CPU otherwise the C++ kernel
    (``CPU_KERNEL``). ``rounding`` is how the bucket's 16-bit params are rounded back when they step through
    fp32 ("nearest": fp32 params, or rounded as the path does): the Triton kernel also takes bf16 params
    rounded "stochastic" or "kahan"; fp16 params and strided tensors run staged."""
    if impl == "foreach" and device.type == "cpu" and ROUTING and ROUTE_FOREACH_ON_CPU:
        impl = "fused"
    if impl == "compiled" and device.type == "cpu" and ROUTING and not uses_triton(device) and rounding == "nearest":
        say_routed("compiled", "fused", "for state kept at 16/8/4 bits the fused level's CPU kernel loads and "
                   "stores it in one pass; the compiled level would step dequantized temporaries, ~40x slower")
        impl = "fused"
    if impl not in ("auto", "fused"):
        return None
    if uses_triton(device):
        return TRITON_STORED
    if device.type == "cpu" and rounding == "nearest":
        return CPU_KERNEL
    return None


# --- running -----------------------------------------------------------------------------------------------

def run_chain(chain: tuple[Path, ...], bucket: Bucket, ctx: StepContext) -> None:
    """``bucket`` over ``chain``: each path runs what it takes, the next one what is left."""
    for path in chain:
        taken = path.takes(bucket, ctx)
        if taken is not None and not taken:
            continue
        if ctx.found_inf is not None and not path.skips_in_kernel(ctx) and _inf_found(ctx):
            return  # GradScaler saw inf/NaN grads: read on the host, as this path cannot skip by itself
        n = len(bucket.params)
        if taken is None:
            part = bucket
        else:
            part = subset(bucket, taken, bucket.cache.setdefault((path.name, tuple(taken)), {})
                          if path.stable_split else None)
        left = _run(path, part, ctx)
        if taken is None and left is None:
            return
        rest = set(range(n)).difference(range(n) if taken is None else taken)
        rest.update(i if taken is None else taken[i] for i in left or ())
        if not rest:
            return
        rest = sorted(rest)  # its own cache where the split is the bucket's (what the paths work out once)
        bucket = subset(bucket, rest, bucket.cache.setdefault(("rest", tuple(rest)), {})
                        if path.stable_split else None)


def _inf_found(ctx: StepContext) -> bool:
    if ctx.inf_read is None:  # (one sync per bucket, only where a path cannot skip in its kernel)
        ctx.inf_read = ctx.found_inf.item() != 0
    return ctx.inf_read


def _run(path: Path, part: Bucket, ctx: StepContext) -> list[int] | None:
    if ctx.grad_mul is not None and not path.takes_grad_mul_of(ctx):
        part = Bucket(part.params, scaled_grads(part.grads, ctx.grad_mul), part.states, part.cache, part.sharded,
                      part.transient)
        ctx = ctx.but(grad_mul=None)
    if path.records:
        took(path.name)
    try:
        left = path.run(part, ctx)
    except Exception as e:
        if not path.fallible:
            raise
        _not_compilable.add(ctx.rule.update)  # no C++ compiler, or Inductor unavailable: the next path is exact
        warnings.warn(f"fastoptim: compiling {ctx.rule.name} for the CPU failed ({type(e).__name__}: {e}); "
                      "impl='fused' uses the foreach level for it instead", RuntimeWarning,
                      stacklevel=caller_stacklevel())
        return list(range(len(part.params)))
    if not path.counted:  # written in place behind autograd's back: counted as torch.optim's steps count it
        skipped = set(left or ())  # (what it left is counted by the path that steps it)
        ctx.written.extend([p for i, p in enumerate(part.params) if i not in skipped] if skipped else part.params)
    return left


def run_plan(*, impl: str, rule, step_plan: Plan, group: dict, grads: list[Tensor] | None, step_amp: StepAmp,
             bits: int, rounding: str, entry_of: Callable[[Tensor], tuple], dense_grads: bool,
             written: list[Tensor]) -> None:
    """One step of ``rule`` over every bucket of a committed plan. ``entry_of(param)``: the param's state dict,
    its index in the optimizer and the param (for the roundings' own state); ``dense_grads``: every grad is of
    its param's dtype and shape, contiguous; ``written``: gets the tensors to count an in-place write to (the
    caller counts them all at once, ``bulk.bump_versions``)."""
    taken = step_plan.advance(rule, group)
    if step_amp.found_inf is not None:
        step_amp.taken.extend(taken)
    group = hyper_view(group)
    flags = rule.flags(group)

    def run_plain(bucket: Bucket, ctx: StepContext) -> None:
        run_chain(plain_route(impl, bucket, ctx.rule), bucket, ctx)

    for bucket in step_plan.buckets:
        part = Bucket(bucket.params, bucket.grads(grads), bucket.states, bucket.cache,
                      bucket.owners if rule.stages and bucket.convert else None)
        dtype = bucket.params[0].dtype
        rounded = storage.rounding.rounds_in_fp32(dtype, rounding)
        if bucket.staged is None:  # plain formats are checked to be the param's dtype: never staged
            bucket.staged = rounded or bits != 32 and storage.needs_staging(bucket.params, bucket.states)
        grad_mul = step_amp.grad_mul
        if grad_mul is not None:  # in the dtype the bucket's math runs in: fp64 (its own or a complex128's real
            # view), else fp32 (16-bit params, fp32 temporaries), as torch's foreach_mul_ casts a 0-d factor;
            # max_grad_norm's factor is fp64 wherever some grad is
            grad_mul = grad_mul.to(torch.float64 if dtype == torch.float64 else torch.float32)
        ctx = StepContext(impl=impl, rule=rule, group=group, step=bucket.step,
                          scalars=rule.scalars(group, bucket.step, *bucket.host_before),
                          flags=rule.bucket_flags(flags, dtype), grad_mul=grad_mul, found_inf=step_amp.found_inf,
                          rounding=rounding if rounded else "nearest", run_plain=run_plain, dense_grads=dense_grads,
                          written=written)
        if not bucket.staged:
            run_plain(part, ctx)
            continue
        # 16/8/4-bit state, and 16-bit params rounded stochastically or with Kahan: loaded and stored in the
        # kernel where a path declares it can; the rest through fp32 temporaries
        owners = bucket.owners
        ctx.entries = lambda i, owners=owners: entry_of(owners[i])
        stored = None if rule.stages else stored_path(impl, part.device, ctx.rounding)
        run_chain((STAGED,) if stored is None else (stored, STAGED), part, ctx)
    # flat buffers and sharded params' local shards were written, not the params the user holds: each counts an
    # in-place write, as torch.optim's step counts one (autograd then refuses a backward through a param changed
    # since its forward)
    for bucket in step_plan.buckets:
        if bucket.flat_grad is not None or bucket.convert:
            written.extend(bucket.owners)


def hyper_view(group: dict) -> dict:
    """The group with one-element tensor hyper-parameters of shape (1,) as 0-d views (torch.optim takes
    both; the paths' scalar arithmetic wants 0-d). Views: a schedule writing the tensor in place is seen."""
    if not any(_is_shaped(v) or isinstance(v, tuple) and any(map(_is_shaped, v)) for v in group.values()):
        return group
    return {k: tuple(map(_scalar_view, v)) if isinstance(v, tuple) else _scalar_view(v) for k, v in group.items()}


def _is_shaped(value) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0


def _scalar_view(value):
    return value.view(()) if isinstance(value, Tensor) and value.dim() else value
