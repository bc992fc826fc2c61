r"""Adamax, Adam with the infinity norm (Kingma & Ba 2015, section 7.1), torch.optim.Adamax's semantics.

    g <- -g                         if maximize
    g <- g + wd * p                 if weight_decay != 0
    m <- m + (1 - b1) (g - m)
    u <- max(b2 u, |g| + eps)
    p <- p - lr / (1 - b1^t) * m / u
"""

from __future__ import annotations

from .base import Rule, check_betas, check_bool, check_nonnegative, nonzero, register
from .common import maximize_and_decay
from .prims import maximum


def adamax_update(p, g, exp_avg, exp_inf,
                  clr, one_minus_beta1, beta2, eps, weight_decay,
                  MAXIMIZE, WEIGHT_DECAY):
    p, g = maximize_and_decay(p, g, weight_decay, None, MAXIMIZE, WEIGHT_DECAY, DECOUPLED=False)
    exp_avg = exp_avg + (g - exp_avg) * one_minus_beta1
    exp_inf = maximum(exp_inf * beta2, maximum(g, -g) + eps)  # max(g, -g) is |g| exactly (NaN stays NaN)
    p = p - clr * (exp_avg / exp_inf)
    return p, exp_avg, exp_inf


@register
class AdamaxRule(Rule):
    name = "adamax"
    class_name = "Adamax"
    oracle = "torch.optim.Adamax"
    signature = ("lr", "betas", "eps", "weight_decay", "foreach", "*", "maximize")
    option_sets = (
        dict(lr=1e-2),
        dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, eps=1e-6),
        dict(lr=1e-2, maximize=True, weight_decay=0.05),
    )
    curves_options = dict(lr=3e-3)
    tensor_hypers = ("lr", "betas")
    low_precision_options = dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.5)
    defaults = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False)
    state_names = ("exp_avg", "exp_inf")
    unsigned_states = frozenset({"exp_inf"})
    update = staticmethod(adamax_update)

    def validate(self, group):
        check_nonnegative(group, "lr", "eps", "weight_decay")
        check_betas(group)
        check_bool(group, "maximize")

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]))

    def named_scalars(self, group, step):
        beta1, beta2 = group["betas"]
        return dict(clr=group["lr"] / (1 - beta1 ** step), one_minus_beta1=1 - beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"])
