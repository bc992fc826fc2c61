r"""Adam (Kingma & Ba 2015) and AdamW (Loshchilov & Hutter 2019), torch.optim.Adam/AdamW's semantics.

    g <- -g                         if maximize
    g <- g + wd * p                 Adam, if weight_decay != 0
    p <- p * (1 - lr * wd)          AdamW (decoupled decay)
    m <- m + (1 - b1) (g - m)
    v <- b2 v + (1 - b2) g^2
    v_max <- max(v_max, v)          if amsgrad (the denominator then uses v_max)
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
"""

from __future__ import annotations

import torch

from .base import Rule, nonzero, register, steps_list, check_betas, check_bool, check_nonnegative
from .common import adam_moments, maximize_and_decay
from .prims import maximum, sqrt


def adam_update(p, g, exp_avg, exp_avg_sq, max_exp_avg_sq,
                step_size, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor,
                bias_correction2_sqrt,
                MAXIMIZE, WEIGHT_DECAY, DECOUPLED, AMSGRAD):
    p, g = maximize_and_decay(p, g, weight_decay, decay_factor, MAXIMIZE, WEIGHT_DECAY, DECOUPLED)
    exp_avg, exp_avg_sq = adam_moments(g, exp_avg, exp_avg_sq, one_minus_beta1, beta2, one_minus_beta2)
    if AMSGRAD:
        max_exp_avg_sq = maximum(max_exp_avg_sq, exp_avg_sq)
        denom = sqrt(max_exp_avg_sq) / bias_correction2_sqrt + eps
    else:
        denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    p = p - step_size * (exp_avg / denom)
    return p, exp_avg, exp_avg_sq, max_exp_avg_sq


class AdamRule(Rule):
    state_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    unsigned_states = frozenset({"exp_avg_sq", "max_exp_avg_sq"})
    curves_options = dict(lr=3e-3)
    tensor_hypers = ("lr", "betas")
    fp16_options = dict(eps=1e-3)
    update = staticmethod(adam_update)

    def __init__(self, decoupled: bool):
        self.decoupled = decoupled
        self.name = "adamw" if decoupled else "adam"
        self.class_name = "AdamW" if decoupled else "Adam"
        self.oracle = f"torch.optim.{self.class_name}"
        self.option_sets = ((
            dict(lr=1e-2),
            dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.3),
            dict(lr=1e-2, amsgrad=True, maximize=True, weight_decay=0.0),
        ) if decoupled else (
            dict(lr=1e-2),
            dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, eps=1e-6),
            dict(lr=1e-2, amsgrad=True, maximize=True, weight_decay=0.05),
        ))
        self.low_precision_options = (dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=2.0) if decoupled else
                                      dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.5, amsgrad=True))
        self.defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2 if decoupled else 0.0,
                             amsgrad=False, maximize=False)

    def validate(self, group):
        check_nonnegative(group, "lr", "eps", "weight_decay")
        check_betas(group)
        check_bool(group, "amsgrad", "maximize")

    def active(self, group):
        return (True, True, group["amsgrad"])

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]),
                    DECOUPLED=self.decoupled, AMSGRAD=group["amsgrad"])

    def torch_fused(self, params, grads, states, group, step, grad_scale=None, found_inf=None):
        """torch's own fused kernel for this math (the fused level uses it on the CPU)."""
        exp_avg, exp_avg_sq, max_exp_avg_sq = states
        fn = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        beta1, beta2 = group["betas"]
        fn(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq or [], steps_list(step, params),
           amsgrad=group["amsgrad"], lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
           weight_decay=float(group["weight_decay"]), eps=float(group["eps"]), maximize=group["maximize"],
           grad_scale=grad_scale, found_inf=found_inf)

    def named_scalars(self, group, step):
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        return dict(step_size=lr / bias_correction1, one_minus_beta1=1 - beta1, beta2=beta2,
                    one_minus_beta2=1 - beta2, eps=group["eps"], weight_decay=wd, decay_factor=1 - lr * wd,
                    bias_correction2_sqrt=bias_correction2 ** 0.5)


register(AdamRule(decoupled=False))
register(AdamRule(decoupled=True))
