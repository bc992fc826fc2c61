"""Global-norm gradient clipping: ``clip_grad_norm_`` (torch.nn.utils.clip_grad_norm_'s semantics) and the
norm the optimizers' ``max_grad_norm=`` folds into their step.

The norm is one multi-tensor reduction per (device, dtype) (``torch._foreach_norm``), combined on the first
device; nothing is read back to the host (unless ``error_if_nonfinite`` asks, as torch's does).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

from .storage.state import is_dtensor


def grad_norm(grads: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of all ``grads`` taken together, as a 0-d tensor on the first grad's device."""
    norm_type = float(norm_type)
    by_key: dict[tuple, list[Tensor]] = {}
    for g in grads:
        if g.numel():  # an empty tensor adds nothing (and has no inf-norm)
            by_key.setdefault((g.device, g.dtype), []).append(g)
    keyed = [(key, n) for key, gs in by_key.items() for n in torch._foreach_norm(gs, norm_type)]
    return total_norm(keyed, grads[0].device if grads else None, norm_type)


def tensor_norm(grad: Tensor, norm_type: float = 2.0) -> tuple[tuple, Tensor] | None:
    """One grad's ``(key, norm)`` for ``total_norm`` (None for an empty grad), the value ``grad_norm`` takes for it
    (on the CPU a multi-tensor norm is each tensor's own norm)."""
    return None if not grad.numel() else ((grad.device, grad.dtype), torch._foreach_norm([grad], float(norm_type))[0])


def total_norm(keyed: list[tuple[tuple, Tensor]], first: torch.device | None, norm_type: float = 2.0) -> Tensor:
    """The norm of per-tensor norms ``keyed`` ((device, dtype), norm), taken as ``grad_norm`` takes them: by
    (device, dtype) in the order each first appears, combined on ``first``, the first grad's device."""
    if not keyed:
        return torch.tensor(0.0, device=first)
    by_key: dict[tuple, list[Tensor]] = {}
    for key, n in keyed:
        by_key.setdefault(key, []).append(n)
    norms = [n.to(first) for ns in by_key.values() for n in ns]
    return torch.linalg.vector_norm(torch.stack(norms), float(norm_type))


def clip_factor(total_norm: Tensor, max_norm: float) -> Tensor:
    """What the grads are multiplied by: ``max_norm / (norm + 1e-6)``, at most 1 (torch's formula)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """Scale the grads of ``parameters`` in place so their global norm is at most ``max_norm``; return the
    norm before clipping (a tensor: no host sync)."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    max_norm = float(max_norm)
    total = grad_norm(grads, norm_type)
    if is_dtensor(total):  # sharded grads: reduce the partial norm across ranks
        total = total.full_tensor()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    if not grads:
        return total
    factor = clip_factor(total, max_norm)
    by_key: dict[tuple, list[Tensor]] = {}
    for g in grads:
        by_key.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), gs in by_key.items():
        local = [g.to_local() if is_dtensor(g) else g for g in gs]
        torch._foreach_mul_(local, factor.to(device))
    return total
