"""How a rule runs: the levels, and the bucket of tensors they run over.

Every level is ``run(rule, bucket, group, step, scalars, flags, grad_mul)``: one step of ``rule`` over
one bucket (params of one device and dtype, at one step count). ``grad_mul`` is a 0-d tensor the grads
are multiplied by before the update (GradScaler's 1/scale times the clip factor of ``max_grad_norm``):
the fused and compiled levels apply it inside their kernels, loop and foreach into temporaries.
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterator

import torch
from torch import Tensor

from ..storage.state import is_dtensor

IMPLS = ("auto", "loop", "foreach", "fused", "compiled")
LEVELS = IMPLS[1:]  # the concrete levels ("auto" picks one of them)


@dataclass
class Bucket:
    params: list[Tensor]
    grads: list[Tensor]
    states: list[list[Tensor] | None]  # one list per rule.state_names entry, None where inactive
    cache: dict = field(default_factory=dict)  # survives across steps: tensor tables, compiled fns
    # the DTensors whose local shards ``params`` are (None: every param is whole here): per-tensor stages gather
    # each whole tensor on one rank (``sharded``); elementwise math runs on the shards as they are
    sharded: list | None = None
    # flat mode's buffers that many of the states are views of (``storage.pooled``): a kernel's table watches each
    # such storage once (they move whole), every other state tensor on its own
    pools: tuple = ()

    @property
    def device(self) -> torch.device:
        return self.params[0].device


# --- which path ran: tests of a fast path assert that it ran -------------------------------------------

PATHS = ("loop", "foreach", "compiled", "triton", "triton_stored", "torch_fused", "cpu_kernel",
         "stage_loop", "stage_batched", "stage_compiled")  # (the last three: per-tensor stages, ``stages``)
_path_log: list[str] | None = None


@contextmanager
def record_paths() -> Iterator[list[str]]:
    """Collect the name of every path the levels take while the block runs (one entry per bucket run;
    a bucket split between two paths gives both). Costs one global read per bucket when not recording."""
    global _path_log
    outer, _path_log = _path_log, []
    try:
        yield _path_log
    finally:
        _path_log = outer


def took(path: str) -> None:
    if _path_log is not None:
        _path_log.append(path)


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"Unknown impl {impl!r}; valid values: {', '.join(repr(i) for i in IMPLS)}")
    return impl


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


@lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def uses_triton(device: torch.device) -> bool:
    """Whether the fused level runs its Triton kernel here: CUDA tensors, or CPU tensors while Triton's
    interpreter is on (``TRITON_INTERPRET=1``, how the kernels are tested without a GPU)."""
    wanted = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return wanted and triton_available()


def skips_in_kernel(impl: str, device: torch.device) -> bool:
    """Whether ``impl`` on ``device`` reads GradScaler's found_inf inside its kernels (no host sync)."""
    return impl in ("auto", "fused") and uses_triton(device)


def may_skip_in_kernel(impl: str) -> bool:
    """Whether ``skips_in_kernel`` can hold for ``impl`` on any device here: a quick answer before looking at
    every param's device (no Triton, or neither CUDA nor Triton's interpreter: never)."""
    return (impl in ("auto", "fused") and triton_available()
            and (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()))


@lru_cache(maxsize=None)
def _runs() -> dict[str, Callable]:
    from . import compiled, foreach, fused, loop  # imported late: they import Bucket from here

    return {"auto": fused.run, "fused": fused.run, "compiled": compiled.run, "foreach": foreach.run,
            "loop": loop.run}


# On the CPU the foreach level runs the fused level's path instead: its pure expressions take about twice
# the passes over memory of torch's own in-place foreach ops, and the fused path (torch's fused kernels, the
# rule compiled into one loop, or the foreach level itself where nothing is faster) is never slower.
# Measured, AdamW ms/step on gpt 25M (`fastoptim bench -w gpt --own-paths`): foreach 175, torch foreach 130, fused 19.
ROUTE_FOREACH_ON_CPU = True
# The master switch: False makes every level run its own path (`fastoptim bench --own-paths`, the tests).
ROUTING = True
_said: set = set()


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


_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside fastoptim and torch (the user's
    ``opt.step()``), however deep inside the step it is raised."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def level(impl: str, device: torch.device) -> Callable:
    """The run function for ``impl`` on ``device``; "auto" is the fused level, the fastest everywhere
    (each level picks its path by device itself). The loop level always runs as it says: it is the
    reference the other levels are tested against."""
    if impl == "foreach" and device.type == "cpu" and ROUTING and ROUTE_FOREACH_ON_CPU:
        say_routed("foreach", "fused", "on the CPU it is never slower, and the foreach level's pure expressions "
                   "take twice the passes over memory of torch's in-place foreach kernels")
        impl = "fused"
    return _runs()[impl]


def stored_level(impl: str, device: torch.device, rounding: str = "nearest") -> Callable | None:
    """The one place that says which path may see 16/8/4-bit state as it is stored: the run function that
    loads and stores it inside its own kernel for ``impl`` on ``device`` (it returns the part of the bucket
    it leaves), or None. Every other path, torch's own fused kernels among them, gets plain temporaries
    (``storage.run_staged``), so a storage option no path declares can never be silently ignored.

    Declared: the fused level (and "auto"; and foreach, and compiled on the CPU, where they run the fused
    level's path) with fp32
    params whose active states are all bf16, or all 8-bit, or all 4-bit (``QuantizedState``, not sharded):
    on CUDA and under ``TRITON_INTERPRET=1`` the Triton kernel (``triton_stored``), on the CPU otherwise the
    C++ kernel (``cpu_kernels``). ``rounding`` is how the bucket's 16-bit params are rounded back when they
    step through fp32 ("nearest": fp32 params, or rounded as the level does): the Triton kernel also takes
    bf16 params rounded "stochastic" (drawing the bits ``storage.stochastic_round`` draws) or "kahan" (the
    compensation loaded and stored in the kernel); fp16 params and strided tensors run staged."""
    if impl == "foreach" and device.type == "cpu" and ROUTING and ROUTE_FOREACH_ON_CPU:
        impl = "fused"
    if impl == "compiled" and device.type == "cpu" and ROUTING and not uses_triton(device) and rounding == "nearest":
        # measured (`fastoptim bench -w gpt --params 4M --impl compiled --state-bits 8`): 175 ms/step on its own
        # path (dequantized temporaries), 8 ms routed
        say_routed("compiled", "fused", "for state kept at 16/8/4 bits the fused level's CPU kernel loads and "
                   "stores it in one pass; the compiled level would step dequantized temporaries, ~40x slower")
        impl = "fused"
    if impl not in ("auto", "fused"):
        return None
    from . import fused
    if uses_triton(device):  # CUDA, or CPU tensors under TRITON_INTERPRET=1: the Triton kernel
        return fused.run_stored_triton
    if device.type == "cpu" and rounding == "nearest":
        return fused.run_stored
    return None


__all__ = ["IMPLS", "LEVELS", "PATHS", "Bucket", "check_impl", "is_dtensor", "level", "own_paths", "pack_scalars",
           "record_paths", "say_routed", "stored_level", "scaled_grads", "may_skip_in_kernel", "skips_in_kernel", "took", "triton_available", "uses_triton"]
