"""A pytest plugin that registers a tiny test-only optimizer before the tests are collected
(``pytest -p registry_plugin``): tests/surface/test_registry.py checks that the whole matrix collects it and that it runs.

Its rule is an EMA of the grads as the step (``p <- p - lr m``, ``m <- m + (1 - b)(g - m)``), with decoupled
weight decay and maximize; its oracle a plain loop of the same, written here."""

import torch

from fastoptim.registry import add
from fastoptim.rules.base import Rule, check_bool, check_nonnegative, check_unit_interval, nonzero

NAME = "tinyema"


def tiny_update(p, g, exp_avg, lr, one_minus_beta, decay_factor, MAXIMIZE, WEIGHT_DECAY):
    if MAXIMIZE:
        g = -g
    if WEIGHT_DECAY:
        p = p * decay_factor
    exp_avg = exp_avg + (g - exp_avg) * one_minus_beta
    p = p - lr * exp_avg
    return p, exp_avg


class TinyEMARule(Rule):
    name = NAME
    class_name = "TinyEMA"
    oracle = "registry_plugin.ReferenceTinyEMA"
    defaults = dict(lr=1e-2, beta=0.9, weight_decay=0.0, maximize=False)
    state_names = ("exp_avg",)
    exports_step = False
    option_sets = (dict(lr=1e-2), dict(lr=1e-2, beta=0.5, weight_decay=0.3, maximize=True))
    update = staticmethod(tiny_update)

    def validate(self, group):
        check_nonnegative(group, "lr", "weight_decay")
        check_unit_interval("beta", group["beta"])
        check_bool(group, "maximize")

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]))

    def named_scalars(self, group, step):
        return dict(lr=group["lr"], one_minus_beta=1 - group["beta"],
                    decay_factor=1 - group["lr"] * group["weight_decay"])


class ReferenceTinyEMA(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, beta=0.9, weight_decay=0.0, maximize=False, compute_dtype=torch.float64):
        super().__init__(params, dict(lr=lr, beta=beta, weight_decay=weight_decay, maximize=maximize))
        self.compute_dtype = compute_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                dtype = self.compute_dtype or p.dtype
                g = -p.grad.to(dtype) if group["maximize"] else p.grad.to(dtype)
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"].to(dtype)
                x = p.to(dtype) * (1 - group["lr"] * group["weight_decay"])
                m = m + (g - m) * (1 - group["beta"])
                p.copy_(x - group["lr"] * m)
                state["exp_avg"].copy_(m)


if __name__ == "registry_plugin" and NAME not in __import__("fastoptim").OPTIMIZERS:
    add(TinyEMARule())  # on import: ``-p`` plugins are imported before conftest.py builds the matrix from the registry
