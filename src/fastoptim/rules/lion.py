r"""Lion, EvoLved Sign Momentum (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    g <- -g                         if maximize
    p <- p * (1 - lr * wd)          decoupled weight decay
    p <- p - lr * sign(b1 m + (1 - b1) g)
    m <- b2 m + (1 - b2) g
"""

from __future__ import annotations

from .base import Rule, nonzero, register, check_betas, check_bool, check_nonnegative
from .common import maximize_and_decay
from .prims import sign


def lion_update(p, g, exp_avg,
                lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay_factor,
                MAXIMIZE, WEIGHT_DECAY):
    p, g = maximize_and_decay(p, g, None, decay_factor, MAXIMIZE, WEIGHT_DECAY, DECOUPLED=True)
    p = p - lr * sign(exp_avg * beta1 + g * one_minus_beta1)
    exp_avg = exp_avg * beta2 + g * one_minus_beta2
    return p, exp_avg


@register
class LionRule(Rule):
    name = "lion"
    class_name = "Lion"
    oracle = "fastoptim.reference.ReferenceLion"
    option_sets = (
        dict(lr=1e-3),
        dict(lr=1e-3, betas=(0.95, 0.98), weight_decay=0.5),
        dict(lr=1e-3, maximize=True, weight_decay=0.1),
    )
    curves_options = dict(lr=3e-4)
    curves_note = ("That gap is fp32 arithmetic, not a level: where b1*m + (1-b1)*g is within a rounding of 0, a "
                   "last-bit difference in the state or the param flips its sign and moves that weight by 2*lr.")
    tensor_hypers = ("lr", "betas")
    low_precision_options = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=2.0)
    defaults = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False)
    state_names = ("exp_avg",)
    exports_step = False
    update = staticmethod(lion_update)

    def validate(self, group):
        check_nonnegative(group, "lr", "weight_decay")
        check_betas(group)
        check_bool(group, "maximize")

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]))

    def named_scalars(self, group, step):
        lr = group["lr"]
        beta1, beta2 = group["betas"]
        return dict(lr=lr, beta1=beta1, one_minus_beta1=1 - beta1, beta2=beta2, one_minus_beta2=1 - beta2,
                    decay_factor=1 - lr * group["weight_decay"])
