"""Oracles: torch.optim classes, and plain reference loops of the published algorithms where torch has none.
The tests and ``fastoptim curves`` compare against these; nothing else in the package uses them."""

from __future__ import annotations

import torch

from fastoptim.registry import OptimizerSpec


class ReferenceLion(torch.optim.Optimizer):
    """Lion exactly as published (Chen et al. 2023, Algorithm 2), one tensor at a time, in float64."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = -p.grad.double() if group["maximize"] else p.grad.double()
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"].double()
                update = torch.sign(beta1 * m + (1 - beta1) * g)
                new_p = p.double() - group["lr"] * (update + group["weight_decay"] * p.double())
                p.copy_(new_p)
                state["exp_avg"].copy_(beta2 * m + (1 - beta2) * g)


def reference_class(spec: OptimizerSpec):
    if spec.reference is None:
        return {"lion": ReferenceLion}[spec.name]
    return getattr(torch.optim, spec.reference)


def reference_kwargs(spec: OptimizerSpec) -> dict:
    """torch.optim's single-tensor path: the documented oracle."""
    return {} if spec.reference is None else {"foreach": False}
