"""How a rule runs: the levels, and the bucket of tensors they run over.

Every level is ``run(rule, bucket, group, step, scalars, flags, grad_scale)``: one step of ``rule`` over
one bucket (params of one device and dtype, at one step count). ``grad_scale`` (from torch.amp's
GradScaler) is unscaled inside the fused kernels; the other levels unscale into temporaries first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

IMPLS = ("auto", "loop", "foreach", "fused", "compiled")
LEVELS = IMPLS[1:]  # the concrete levels ("auto" picks one of them)


@dataclass
class Bucket:
    params: list[Tensor]
    grads: list[Tensor]
    states: list[list[Tensor] | None]  # one list per rule.state_names entry, None where inactive
    cache: dict = field(default_factory=dict)  # survives across steps: tensor tables, compiled fns

    @property
    def device(self) -> torch.device:
        return self.params[0].device


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"Unknown impl {impl!r}; valid values: {', '.join(repr(i) for i in IMPLS)}")
    return impl


def unscaled(grads: list[Tensor], grad_scale: Tensor | None) -> list[Tensor]:
    """Grads divided by the AMP scale as GradScaler.unscale_ does (times the fp32 reciprocal), as new tensors."""
    if grad_scale is None:
        return grads
    inv_scale = grad_scale.double().reciprocal().float()
    return torch._foreach_mul(grads, inv_scale)


def pack_scalars(scalars: tuple, device: torch.device) -> Tensor:
    """The step's scalars as one float32 tensor on ``device``; tensor-valued ones (an lr kept on the device)
    are gathered there without a trip through the host."""
    if not any(isinstance(s, Tensor) for s in scalars):
        return torch.tensor(scalars, dtype=torch.float32).to(device, non_blocking=True)
    return torch.stack([torch.as_tensor(s, dtype=torch.float32, device=device).reshape(()) for s in scalars])


def skips_in_kernel(impl: str, device: torch.device) -> bool:
    """Whether ``impl`` on ``device`` reads GradScaler's found_inf inside its kernels (no host sync)."""
    import os
    return impl in ("auto", "fused") and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def level(impl: str, device: torch.device) -> Callable:
    """The run function for ``impl`` on ``device``; "auto" is the fused level, the fastest everywhere."""
    from . import compiled, foreach, fused, loop

    return {"auto": fused.run, "fused": fused.run, "compiled": compiled.run, "foreach": foreach.run,
            "loop": loop.run}[impl]


__all__ = ["IMPLS", "LEVELS", "Bucket", "check_impl", "level", "pack_scalars", "skips_in_kernel", "unscaled", "Sequence"]
