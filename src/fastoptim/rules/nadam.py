r"""NAdam, Adam with Nesterov momentum (Dozat 2016, "Incorporating Nesterov Momentum into Adam"),
torch.optim.NAdam's semantics (its momentum schedule, and decoupled weight decay as in Loshchilov & Hutter 2019).

    g <- -g                         if maximize
    g <- g + wd * p                 if weight_decay != 0 (p <- p (1 - lr wd) if decoupled_weight_decay)
    mu_t = b1 (1 - 0.96^(t psi) / 2),  psi = momentum_decay;   P_t = mu_1 ... mu_t   (torch's mu_product)
    m <- m + (1 - b1) (g - m)
    v <- b2 v + (1 - b2) g^2
    d = sqrt(v / (1 - b2^t)) + eps
    p <- p - lr (1 - mu_t) / (1 - P_t) * g / d - lr mu_{t+1} / (1 - P_t mu_{t+1}) * m / d
"""

from __future__ import annotations

import struct

import torch

from .base import Rule, check_betas, check_bool, check_nonnegative, nonzero, register
from .common import adam_moments, maximize_and_decay
from .prims import sqrt


def nadam_update(p, g, exp_avg, exp_avg_sq,
                 grad_step, avg_step, one_minus_beta1, beta2, one_minus_beta2, bias_correction2, eps,
                 weight_decay, decay_factor,
                 MAXIMIZE, WEIGHT_DECAY, DECOUPLED):
    p, g = maximize_and_decay(p, g, weight_decay, decay_factor, MAXIMIZE, WEIGHT_DECAY, DECOUPLED)
    exp_avg, exp_avg_sq = adam_moments(g, exp_avg, exp_avg_sq, one_minus_beta1, beta2, one_minus_beta2)
    denom = sqrt(exp_avg_sq / bias_correction2) + eps
    p = p - grad_step * (g / denom)
    p = p - avg_step * (exp_avg / denom)
    return p, exp_avg, exp_avg_sq


def _momentum(group: dict, step: int) -> float:
    """mu_t of the momentum schedule."""
    return float(group["betas"][0] * (1.0 - 0.5 * (0.96 ** (step * group["momentum_decay"]))))


def _times_in_scalar_dtype(product: float, factor: float) -> float:
    """``product * factor`` as torch multiplies its 0-d mu_product tensor in place: in the scalar dtype (float32
    unless the default dtype is float64), the factor rounded to it first."""
    if torch.get_default_dtype() == torch.float64:
        return product * factor
    as_fp32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]  # noqa: E731
    return as_fp32(product * as_fp32(factor))


@register
class NAdamRule(Rule):
    name = "nadam"
    class_name = "NAdam"
    oracle = "torch.optim.NAdam"
    option_sets = (
        dict(lr=1e-2),
        dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, momentum_decay=0.05, eps=1e-6),
        dict(lr=1e-2, weight_decay=0.3, decoupled_weight_decay=True, maximize=True),
    )
    curves_options = dict(lr=3e-3)
    tensor_hypers = ("lr", "betas", "momentum_decay")
    low_precision_options = dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.5, momentum_decay=0.05)
    fp16_options = dict(eps=1e-3)
    defaults = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
                    decoupled_weight_decay=False, maximize=False)
    state_names = ("exp_avg", "exp_avg_sq")
    unsigned_states = frozenset({"exp_avg_sq"})
    # the product of the momentum schedule so far depends on the betas and momentum_decay of every past step
    # (a schedule may move beta1), so it is kept per param as torch keeps it, not recomputed from the count
    host_states = ("mu_product",)
    update = staticmethod(nadam_update)

    def validate(self, group):
        check_nonnegative(group, "lr", "eps", "weight_decay", "momentum_decay")
        check_betas(group)
        check_bool(group, "decoupled_weight_decay", "maximize")

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]),
                    DECOUPLED=group["decoupled_weight_decay"])

    def host_start(self, group):
        return (1.0,)

    def host_step(self, group, step, values):
        return (_times_in_scalar_dtype(values[0], _momentum(group, step)),)

    def named_scalars(self, group, step, mu_product_before):
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        mu, mu_next = _momentum(group, step), _momentum(group, step + 1)
        mu_product = _times_in_scalar_dtype(mu_product_before, mu)
        return dict(grad_step=lr * (1.0 - mu) / (1.0 - mu_product),
                    avg_step=lr * mu_next / (1.0 - mu_product * mu_next), one_minus_beta1=1 - beta1,
                    beta2=beta2, one_minus_beta2=1 - beta2, bias_correction2=1 - beta2 ** step, eps=group["eps"],
                    weight_decay=wd, decay_factor=1 - lr * wd)
