"""How a step meets torch.amp.GradScaler.

torch.amp.GradScaler hands the step ``grad_scale`` and ``found_inf`` only where the kernels read ``found_inf``
themselves (``_step_supports_amp_scaling``, as torch sets it only for ``fused=True``): the fused Triton
kernels on CUDA, for every param of the optimizer, in groups without per-tensor stages. There grads are
unscaled inside the update, together with the clip factor of ``max_grad_norm`` (global norm of the unscaled
grads, one multi-tensor reduction), with no host sync: the step is counted optimistically and taken back when
the flag is read, at the next step or when ``state`` is read. Everywhere else GradScaler unscales the grads
itself and calls ``step`` only when they are finite, as it does for torch.optim: so Lightning allows
``gradient_clip_val`` and accelerate sees a skipped step as skipped. ``grad_scale``/``found_inf`` set by hand
are still honoured on every level (the flag is then read on the host first).
"""

from __future__ import annotations

from . import dispatch


def scales_in_kernel(opt) -> bool:
    """GradScaler's question (``_step_supports_amp_scaling``): may it hand ``opt.step`` grad_scale/found_inf
    instead of unscaling the grads itself? Only where every param steps in a kernel that reads found_inf on the
    device (``dispatch.skips_in_kernel``); elsewhere the flag would be read on the host anyway (on the CPU that
    costs nothing), and claiming it makes Lightning refuse gradient clipping and accelerate count a skipped step
    as taken. Asked at every GradScaler step, so params moved to another device are seen."""
    if not dispatch.may_skip_in_kernel(opt.impl):
        return False
    devices = set()
    for group in opt.param_groups:  # per-tensor stages and stochastic rounding read found_inf on the host
        if opt.rule.for_group(group).stages or opt._storage_settings(group)[2] == "stochastic":
            return False
        devices.update(p.device for p in group["params"])
    return bool(devices) and all(dispatch.skips_in_kernel(opt.impl, d) for d in devices)
