r"""RAdam, Adam with the variance of the adaptive step rectified (Liu et al. 2020, "On the Variance of the
Adaptive Learning Rate and Beyond"), torch.optim.RAdam's semantics.

    g <- -g                         if maximize
    g <- g + wd * p                 if weight_decay != 0 (p <- p (1 - lr wd) if decoupled_weight_decay)
    m <- m + (1 - b1) (g - m)
    v <- b2 v + (1 - b2) g^2
    rho_inf = 2 / (1 - b2) - 1,   rho_t = rho_inf - 2 t b2^t / (1 - b2^t)
    r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))
    p <- p - lr / (1 - b1^t) * m * r_t sqrt(1 - b2^t) / (sqrt(v) + eps)    if rho_t > 5
    p <- p - lr / (1 - b1^t) * m                                          otherwise
"""

from __future__ import annotations

from .base import Rule, check_betas, check_bool, check_nonnegative, nonzero, register
from .common import adam_moments, maximize_and_decay
from .prims import sqrt


def radam_update(p, g, exp_avg, exp_avg_sq,
                 step_size, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor,
                 rectified, plain,
                 MAXIMIZE, WEIGHT_DECAY, DECOUPLED):
    p, g = maximize_and_decay(p, g, weight_decay, decay_factor, MAXIMIZE, WEIGHT_DECAY, DECOUPLED)
    exp_avg, exp_avg_sq = adam_moments(g, exp_avg, exp_avg_sq, one_minus_beta1, beta2, one_minus_beta2)
    # one source for both phases, chosen by the host per step: rectified = r_t sqrt(1 - b2^t) and plain = 0 once
    # rho_t > 5; before that rectified = 0 and plain = 1, which gives m exactly (and a divisor >= 1: no 0/0 at eps = 0)
    p = p - step_size * exp_avg * (rectified / (sqrt(exp_avg_sq) + eps + plain) + plain)
    return p, exp_avg, exp_avg_sq


@register
class RAdamRule(Rule):
    class_name = "RAdam"
    oracle = "torch.optim.RAdam"
    option_sets = (
        dict(lr=1e-2),
        dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, eps=1e-6),
        dict(lr=1e-2, weight_decay=0.3, decoupled_weight_decay=True, maximize=True),
    )
    curves_options = dict(lr=3e-3)
    tensor_hypers = ("lr", "betas")
    low_precision_options = dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=2.0, decoupled_weight_decay=True)
    name = "radam"
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False,
                    maximize=False)
    state_names = ("exp_avg", "exp_avg_sq")
    unsigned_states = frozenset({"exp_avg_sq"})
    update = staticmethod(radam_update)

    def validate(self, group):
        check_nonnegative(group, "lr", "eps", "weight_decay")
        check_betas(group)
        check_bool(group, "decoupled_weight_decay", "maximize")

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]),
                    DECOUPLED=group["decoupled_weight_decay"])

    def named_scalars(self, group, step):
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        bias_correction2 = 1 - beta2 ** step
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * (beta2 ** step) / bias_correction2
        if rho_t > 5.0:  # (a tensor beta2 is read here, as torch.optim's single-tensor step reads it)
            rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
            rectified, plain = rect * bias_correction2 ** 0.5, 0.0
        else:
            rectified, plain = 0.0, 1.0
        return dict(step_size=lr / (1 - beta1 ** step), one_minus_beta1=1 - beta1, beta2=beta2,
                    one_minus_beta2=1 - beta2, eps=group["eps"], weight_decay=wd, decay_factor=1 - lr * wd,
                    rectified=rectified, plain=plain)
