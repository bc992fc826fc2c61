"""The fused level: one pass over memory per bucket, no full-size temporaries.

* CUDA (and CPU tensors under ``TRITON_INTERPRET=1``): the generated multi-tensor Triton kernel, one
  launch per bucket (``triton_kernels``) for fp32, bf16 and fp16 (complex64 through its real view);
  tensors the kernel cannot take (misaligned, non-contiguous) and buckets of a dtype it does not take
  (fp64, complex128) go through the foreach level, and so does everything on a GPU machine without
  Triton installed.
* CPU: torch's own fused kernel where the rule names one (Adam, AdamW, SGD, Adagrad); otherwise the
  rule compiled by Inductor into one in-place loop, when the bucket's tensors are large enough to
  amortise a call each (flat buffers always are); otherwise the cache-blocked foreach level.
* CPU, 16/8/4-bit state (``run_stored``): the rule's C++ twin loads, updates and stores the state in one
  pass (``cpu_kernels``); what it does not take runs staged, as on every other level.
* CUDA (and the interpreter), 16/8/4-bit state and bf16 params rounded stochastically or with Kahan
  (``run_stored_triton``): the Triton kernel of ``triton_stored`` does the same in registers, one launch per
  bucket and state formats.
"""

from __future__ import annotations

import operator
import warnings

import torch
from torch import Tensor

from .. import bulk
from ..engine.flat import GradViews
from . import compiled, foreach
from .base import Bucket, caller_stacklevel, is_dtensor, pack_scalars, took, uses_triton

# torch 2.13's fused CPU SGD is wrong for fp16/bf16 (0.26 off its own single-tensor SGD after 3 steps),
# so low-precision buckets take our own paths
TORCH_FUSED_DTYPES = (torch.float32, torch.float64)
# below this mean size per tensor, one compiled call per tensor costs more than it saves
COMPILED_MIN_MEAN_NUMEL = 1 << 14
_not_compilable: set = set()


def run(rule, bucket: Bucket, group: dict, step: int, scalars: tuple, flags: tuple, grad_mul=None,
        found_inf=None) -> None:
    """``found_inf`` comes only where ``skips_in_kernel`` holds: the kernel leaves everything as it was
    when it is set."""
    if uses_triton(bucket.device):
        return _run_triton(rule, bucket, group, step, scalars, flags, grad_mul, found_inf)
    if bucket.device.type != "cpu":  # a GPU without Triton installed: the foreach level is exact there
        return foreach.run(rule, bucket, group, step, scalars, flags, grad_mul)
    if found_inf is not None:  # a CPU bucket beside GPU ones: read the flag here, where it costs a copy
        if found_inf.item() != 0:
            return
    if rule.torch_fused is not None and bucket.params[0].dtype in TORCH_FUSED_DTYPES:
        # torch's kernels walk p, g and states as one linear layout: strided tensors go the foreach way
        # (params and states keep their layout while the bucket's cache lives: the step plan makes a new
        # bucket when a state tensor is replaced or a param's address, strides or shape change)
        fixed = bucket.cache.get("strided_params_or_states")
        if fixed is None:
            fixed = bucket.cache["strided_params_or_states"] = {
                i for i, p in enumerate(bucket.params)
                if not (p.is_contiguous() and all(s is None or s[i].is_contiguous() for s in bucket.states))}
        strided = [i for i, g in enumerate(bucket.grads) if i in fixed or not g.is_contiguous()]
        skip = set(strided)
        dense = bucket if not strided else _subset(bucket, [i for i in range(len(bucket.params)) if i not in skip])
        if dense.params:
            took("torch_fused")
            # torch's kernels divide by a grad scale: hand them the reciprocal of our multiplier
            rule.torch_fused(dense.params, dense.grads, dense.states, group, step,
                             grad_scale=None if grad_mul is None else grad_mul.reciprocal())
            # written in place, as torch's loop and foreach steps count it (its fused kernels do not): autograd then
            # refuses a backward through a param changed since its forward
            bulk.bump_versions(dense.params)
        if strided:
            foreach.run(rule, _subset(bucket, strided), group, step, scalars, flags, grad_mul)
        return
    mean_numel = sum(p.numel() for p in bucket.params) / len(bucket.params)
    if mean_numel >= COMPILED_MIN_MEAN_NUMEL and rule.update not in _not_compilable:
        try:
            return compiled.run(rule, bucket, group, step, scalars, flags, grad_mul)
        except Exception as e:  # no C++ compiler, or Inductor unavailable: the blocked foreach level is exact
            _not_compilable.add(rule.update)
            warnings.warn(f"fastoptim: compiling {rule.name} for the CPU failed ({type(e).__name__}: {e}); "
                          "impl='fused' uses the foreach level for it instead", RuntimeWarning,
                          stacklevel=caller_stacklevel())
    return foreach.run(rule, bucket, group, step, scalars, flags, grad_mul)


def _run_triton(rule, bucket: Bucket, group, step, scalars, flags, grad_mul, found_inf) -> None:
    from . import triton_kernels

    if not triton_kernels.takes(bucket.params[0].dtype):  # fp64, complex128's real view: the foreach level
        return _safe_path(rule, bucket, group, step, scalars, flags, grad_mul, found_inf)
    table = bucket.cache.get("triton_table")
    if table is None:
        table = bucket.cache["triton_table"] = triton_kernels.TensorTable()
    fallback = triton_kernels.run(rule.update, rule.state_names, bucket.params, bucket.grads, bucket.states,
                                  scalars, flags, table, grad_mul=grad_mul, found_inf=found_inf)
    # written in place through their addresses: counted as torch.optim's steps count it (a step the kernel skips
    # for found_inf is counted too: the flag is on the device, and a count too many only refuses a backward)
    bulk.bump_versions(bucket.params)
    if fallback:
        _safe_path(rule, _subset(bucket, fallback), group, step, scalars, flags, grad_mul, found_inf)


def _safe_path(rule, bucket: Bucket, group, step, scalars, flags, grad_mul, found_inf) -> None:
    """The foreach level for what the kernel does not take; it cannot skip by itself, so found_inf is read
    on the host here (one sync, only for such tensors)."""
    if found_inf is not None and found_inf.item() != 0:
        return
    foreach.run(rule, bucket, group, step, scalars, flags, grad_mul)


def _subset(bucket: Bucket, indices: list[int], cache: dict | None = None) -> Bucket:
    """The params at ``indices`` of ``bucket``, with their grads and states; ``cache``: one that lives as long as
    ``bucket.cache`` and was made for these very indices (else the subset's cache starts empty)."""
    return Bucket([bucket.params[i] for i in indices], [bucket.grads[i] for i in indices],
                  [None if s is None else [s[i] for i in indices] for s in bucket.states],
                  {} if cache is None else cache, pools=bucket.pools)


_kernel_warned: set = set()
_dtype = operator.attrgetter("dtype")


def _warn_staged(why: str) -> None:
    if why not in _kernel_warned:
        _kernel_warned.add(why)
        warnings.warn(f"fastoptim: 16/8/4-bit state runs staged on the CPU (slower, the same math): {why}",
                      RuntimeWarning, stacklevel=caller_stacklevel())


def run_stored(rule, bucket: Bucket, group: dict, step: int, scalars: tuple, flags: tuple, grad_mul=None,
               found_inf=None) -> Bucket | None:
    """Step the params of ``bucket`` whose 16/8/4-bit state the CPU kernel loads and stores in place; return
    the rest (plain state, other dtypes, strided tensors), for the staged path, or None when nothing is left."""
    from ..levels import cpu_kernels

    if found_inf is not None and found_inf.item() != 0:
        return None
    why = cpu_kernels.available()
    if why is not None:
        _warn_staged(why)
        return bucket
    # which params the kernel takes, and its tables: made once per bucket (its params and states are fixed
    # while the step plan holds it) and again when a grad's dtype or contiguity changes (new grads each step
    # may differ: torch takes a grad of another dtype where ``p.grad_dtype`` allows it) or a state's storage
    # moved in place. Flat mode's grad views come as one list (``FlatBucket.head_grads``) that holds the same
    # tensors where they were for as long as it is the same list object; other grads are the user's, new each
    # step, and only their layouts are kept (holding the list would keep last step's grads alive).
    cached = bucket.cache.get("cpu_kernel")
    if cached is not None and any(table.states_moved() for table, _ in cached[1]):
        cached = None
    same_grads = cached is not None and cached[3] is bucket.grads
    grads_seen = None if same_grads else list(zip(map(_dtype, bucket.grads), map(Tensor.is_contiguous, bucket.grads)))
    if cached is None or not same_grads and cached[0] != grads_seen:
        by_formats: dict[tuple, list[int]] = {}
        rest = []
        for i in range(len(bucket.params)):
            formats = cpu_kernels.signature(bucket.params, bucket.grads, bucket.states, i)
            (rest if formats is None else by_formats.setdefault(formats, [])).append(i)
        tables = []
        for formats, indices in by_formats.items():
            part = _subset(bucket, indices)
            tables.append((cpu_kernels.Table(part.params, part.grads, part.states, formats, bucket.pools), indices))
        cached = (grads_seen, tables, rest, None)
    bucket.cache["cpu_kernel"] = cached = cached[:3] + (bucket.grads if isinstance(bucket.grads, GradViews) else None,)
    _, tables, rest, _ = cached
    packed = pack_scalars(scalars, bucket.device)
    mul = None if grad_mul is None else grad_mul.to(bucket.device, torch.float32).reshape(())
    failed = []
    for table, indices in tables:
        params = [bucket.params[i] for i in indices] if len(tables) > 1 or rest else bucket.params
        if not same_grads:
            table.point_at([bucket.grads[i] for i in indices])
        try:
            cpu_kernels.run(rule.update, table, packed, flags, mul)
        except cpu_kernels.KernelUnavailable as e:  # this kernel would not build: its params run staged
            _warn_staged(str(e))
            failed += indices
            continue
        took("cpu_kernel")
        bulk.bump_versions(params)  # written in place, as torch's own kernels count
    if not rest and not failed:
        return None
    rest = tuple(sorted(rest + failed))  # its own cache, kept with the bucket's (what the levels work out once)
    return _subset(bucket, list(rest), bucket.cache.setdefault(("rest", rest), {}))


def run_stored_triton(rule, bucket: Bucket, group: dict, step: int, scalars: tuple, flags: tuple, grad_mul=None,
                      found_inf=None, rounding: str = "nearest", entries=None) -> Bucket | None:
    """Step the params of ``bucket`` whose 16/8/4-bit state the Triton kernel loads and stores in registers
    (found_inf read inside it); return the rest for the staged path, or None when nothing is left.

    ``rounding`` "stochastic" or "kahan": the bucket's bf16 params are rounded as ``storage.round_into`` rounds
    them, with their rounding state (random stream, compensation) from ``entries(i)`` (as
    ``storage.run_staged`` takes it). The kernel then takes the whole bucket or none of it (the staged path
    finds each param's rounding state by its index in the bucket). A stochastic step reads found_inf here: a
    skipped step must not count a draw."""
    from . import triton_stored
    from .. import storage

    by_formats: dict[tuple, list[int]] = {}
    rest = []
    for i in range(len(bucket.params)):
        formats = triton_stored.signature(bucket.params, bucket.grads, bucket.states, i, rounding)
        (rest if formats is None else by_formats.setdefault(formats, [])).append(i)
    own = None
    if rounding != "nearest":
        if rest:
            return bucket
        owners = [entries(i) for i in range(len(bucket.params))]
        if rounding == "stochastic" and any(is_dtensor(param) for _, _, param in owners):
            return bucket  # a shard draws by each element's index in the whole param: the staged path knows it
        own = [storage.rounding_state(*entry, rounding) for entry in owners]
        if rounding == "kahan" and not all(c.dtype == torch.bfloat16 and c.is_contiguous() and c.shape == p.shape
                                           for c, p in zip(own, bucket.params)):
            return bucket
        if rounding == "stochastic":
            if found_inf is not None and found_inf.item() != 0:
                return None
            found_inf = None
    tables = bucket.cache.setdefault("triton_stored_tables", {})
    for formats, indices in by_formats.items():
        part = bucket if len(indices) == len(bucket.params) else _subset(bucket, indices)
        table = tables.get((formats, rounding))
        if table is None:
            table = tables[formats, rounding] = triton_stored.StoredTable()
        keys = storage.rounding_keys([own[i] for i in indices]) if rounding == "stochastic" else None
        comps = [own[i] for i in indices] if rounding == "kahan" else None
        triton_stored.run(rule.update, part.params, part.grads, part.states, formats, scalars, flags, table,
                          grad_mul=grad_mul, found_inf=found_inf, rounding_keys=keys, comps=comps)
        bulk.bump_versions(part.params)  # written in place, as torch's own kernels count
    if rounding == "stochastic":
        for stream in own:
            stream[1] += 1  # one draw per step, as ``storage.round_into`` counts
    return _subset(bucket, rest) if rest else None
