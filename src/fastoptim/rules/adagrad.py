r"""Adagrad (Duchi et al. 2011), torch.optim.Adagrad's semantics.

    g <- -g                         if maximize
    g <- g + wd * p                 if weight_decay != 0
    s <- s + g^2                    (s starts at initial_accumulator_value)
    p <- p - lr / (1 + (t - 1) lr_decay) * g / (sqrt(s) + eps)
"""

from __future__ import annotations

import torch

from .base import Rule, check_bool, check_nonnegative, nonzero, register, steps_list
from .common import maximize_and_decay
from .prims import sqrt


def adagrad_update(p, g, state_sum,
                   clr, eps, weight_decay,
                   MAXIMIZE, WEIGHT_DECAY):
    p, g = maximize_and_decay(p, g, weight_decay, None, MAXIMIZE, WEIGHT_DECAY, DECOUPLED=False)
    state_sum = state_sum + g * g
    p = p - clr * (g / (sqrt(state_sum) + eps))
    return p, state_sum


@register
class AdagradRule(Rule):
    class_name = "Adagrad"
    oracle = "torch.optim.Adagrad"
    option_sets = (
        dict(lr=1e-1),
        dict(lr=1e-1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1),
        dict(lr=1e-1, maximize=True, eps=1e-6),
    )
    curves_options = dict(lr=0.05)
    low_precision_options = dict(lr=0.1, lr_decay=0.1, weight_decay=0.1, initial_accumulator_value=0.1)
    name = "adagrad"
    defaults = dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                    maximize=False)
    state_names = ("sum",)
    unsigned_states = frozenset({"sum"})
    eager_state = True
    update = staticmethod(adagrad_update)

    def validate(self, group):
        check_nonnegative(group, "lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")
        check_bool(group, "maximize")

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]))

    def torch_fused(self, params, grads, states, group, step, grad_scale=None, found_inf=None):
        """torch's own fused kernel for this math (the fused level uses it on the CPU)."""
        (state_sum,) = states
        torch._fused_adagrad_(params, grads, state_sum, steps_list(step, params), lr=float(group["lr"]),
                              lr_decay=float(group["lr_decay"]), weight_decay=float(group["weight_decay"]),
                              eps=float(group["eps"]), maximize=group["maximize"], grad_scale=grad_scale,
                              found_inf=found_inf)

    def named_scalars(self, group, step):
        clr = group["lr"] / (1 + (step - 1) * group["lr_decay"])
        return dict(clr=clr, eps=group["eps"], weight_decay=group["weight_decay"])

    def initial_value(self, name, group):
        return float(group["initial_accumulator_value"])
