"""How a step meets torch.amp.GradScaler: the one module that knows.

torch.amp.GradScaler hands the step ``grad_scale`` and ``found_inf`` only where the kernels read ``found_inf``
themselves (``_step_supports_amp_scaling``, as torch sets it only for ``fused=True``): the fused Triton
kernels on CUDA, for every param of the optimizer, in groups without per-tensor stages. There grads are
unscaled inside the update, together with the clip factor of ``max_grad_norm`` (global norm of the unscaled
grads, one multi-tensor reduction), with no host sync: the step is counted optimistically and taken back when
the flag is read, at the next step or when ``state`` is read (``StepAmp``, ``resolve_skips``). Everywhere else
GradScaler unscales the grads itself and calls ``step`` only when they are finite, as it does for torch.optim:
so Lightning allows ``gradient_clip_val`` and accelerate sees a skipped step as skipped. ``grad_scale``/
``found_inf`` set by hand are still honoured on every level (the flag is then read on the host first: by
``begin_step`` for a step no kernel can skip by itself, by the dispatcher before a path that cannot).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..paths.environment import triton_available, uses_triton
from .plan import take_back


def skips_in_kernel(impl: str, device: torch.device) -> bool:
    """Whether ``impl`` on ``device`` reads GradScaler's found_inf inside its kernels (no host sync)."""
    return impl in ("auto", "fused") and uses_triton(device)


def may_skip_in_kernel(impl: str) -> bool:
    """Whether ``skips_in_kernel`` can hold for ``impl`` on any device here: a quick answer before looking at
    every param's device (no Triton, or neither CUDA nor Triton's interpreter: never)."""
    return (impl in ("auto", "fused") and triton_available()
            and (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()))


def scales_in_kernel(*, impl: str, rule, groups: list[dict], settings) -> bool:
    """GradScaler's question (``_step_supports_amp_scaling``): may it hand the step grad_scale/found_inf
    instead of unscaling the grads itself? Only where every param steps in a kernel that reads found_inf on the
    device (``skips_in_kernel``); elsewhere the flag would be read on the host anyway (on the CPU that costs
    nothing), and claiming it makes Lightning refuse gradient clipping and accelerate count a skipped step as
    taken. Asked at every GradScaler step, so params moved to another device are seen."""
    if not may_skip_in_kernel(impl):
        return False
    devices = set()
    for group in groups:  # per-tensor stages and stochastic rounding read found_inf on the host
        if rule.for_group(group).stages or settings.storage_of(group).rounding == "stochastic":
            return False
        devices.update(p.device for p in group["params"])
    return bool(devices) and all(skips_in_kernel(impl, d) for d in devices)


@dataclass
class StepAmp:
    """What this step multiplies the grads by, and GradScaler's found_inf when the kernels skip by themselves."""
    grad_mul: Tensor | None
    found_inf: Tensor | None
    taken: list = field(default_factory=list)  # what plan.take_back needs if the kernels skipped the step

    def pending(self) -> tuple:
        """The flag copied to host memory without waiting, and an event that says when it is there."""
        if self.found_inf.device.type == "cuda":
            flag = torch.empty((), dtype=self.found_inf.dtype, pin_memory=True)
            flag.copy_(self.found_inf, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return flag, done, self.taken
        return self.found_inf.clone(), None, self.taken


def begin_step(*, impl: str, found_inf, rules: list) -> StepAmp | None:
    """The step's ``StepAmp`` (its ``grad_mul`` for the caller to set), or None where GradScaler saw inf/NaN grads
    and no kernel can skip the step by itself (read on the host here: the step changes nothing)."""
    if found_inf is not None and not isinstance(found_inf, Tensor):  # GradScaler's sum over no grads: 0
        found_inf = torch.tensor(float(found_inf))
    in_kernel = (found_inf is not None and skips_in_kernel(impl, found_inf.device)
                 and not any(rule.stages for rule in rules))
    if found_inf is not None and not in_kernel and found_inf.item() != 0:
        return None
    return StepAmp(None, found_inf if in_kernel else None)


def resolve_skips(pending: list[tuple], state_map) -> None:
    """Steps the kernels skipped (found_inf) were counted optimistically; take them back now, reading the flag a
    step later, when the kernel that set it has long finished."""
    for flag, done, taken in pending:
        if done is not None:
            done.synchronize()
        if flag.item() != 0:
            take_back(state_map, taken)
