r"""AdEMAMix (Pagliardini, Ablin & Grangier 2024, "The AdEMAMix Optimizer: Better, Faster, Older"), with the math,
defaults and warmup schedulers of ``bitsandbytes.optim.AdEMAMix``: Adam's fast EMA mixed with a slow one.

    g <- -g                                         if maximize
    p <- p * (1 - lr * wd)                          decoupled weight decay, if wd != 0
    alpha_t = min(t alpha / t_alpha, alpha)         if t_alpha, else alpha
    beta3_t = min(exp(ln b1 ln b3 / ((1 - s) ln b3 + s ln b1)), b3),  s = t / t_beta3     if t_beta3, else b3
    m1 <- b1 m1 + (1 - b1) g
    m2 <- beta3_t m2 + (1 - beta3_t) g
    nu <- b2 nu + (1 - b2) g^2
    p <- p - lr * (m1 / (1 - b1^t) + alpha_t m2) / (sqrt(nu) / sqrt(1 - b2^t) + eps)

torch.optim has no AdEMAMix; the oracle is ``ReferenceAdEMAMix`` below, the same algorithm as a plain loop
(bitsandbytes' CPU kernel, 32-bit, is checked against fastoptim in tests/rules/test_ademamix.py). State names follow
torch's Adam: ``exp_avg`` (m1), ``exp_avg_slow`` (m2), ``exp_avg_sq`` (nu); bitsandbytes stacks m1 and m2 in one
tensor. ``t_alpha``/``t_beta3`` of 0 or None turn a warmup off, as in bitsandbytes.
"""

from __future__ import annotations

import math

import torch

from .base import Rule, _number, check_bool, check_nonnegative, check_unit_interval, nonzero, register
from .common import maximize_and_decay
from .declared import ReferenceLoop
from .prims import sqrt


def ademamix_update(p, g, exp_avg, exp_avg_slow, exp_avg_sq,
                    lr, beta1, one_minus_beta1, beta2, one_minus_beta2, beta3, one_minus_beta3, alpha,
                    bias_correction1, bias_correction2_sqrt, eps, decay_factor,
                    MAXIMIZE, WEIGHT_DECAY):
    p, g = maximize_and_decay(p, g, None, decay_factor, MAXIMIZE, WEIGHT_DECAY, DECOUPLED=True)
    exp_avg = exp_avg * beta1 + g * one_minus_beta1
    exp_avg_slow = exp_avg_slow * beta3 + g * one_minus_beta3
    exp_avg_sq = exp_avg_sq * beta2 + g * g * one_minus_beta2
    denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    p = p - lr * ((exp_avg / bias_correction1 + alpha * exp_avg_slow) / denom)
    return p, exp_avg, exp_avg_slow, exp_avg_sq


def warmed_up(group: dict, step: int) -> tuple[float, float]:
    """(alpha_t, beta3_t) at ``step``: bitsandbytes' linear alpha warmup and its beta3 warmup, which moves the slow
    EMA's half-life linearly from beta1's to beta3's."""
    beta1, _, beta3 = group["betas"]
    alpha, t_alpha, t_beta3 = group["alpha"], group["t_alpha"], group["t_beta3"]
    if t_alpha:
        alpha = min(step * alpha / t_alpha, alpha)
    if t_beta3:
        ln_beta1, ln_beta3 = math.log(beta1), math.log(beta3)
        scale = step / t_beta3
        beta3 = min(math.exp(ln_beta1 * ln_beta3 / ((1 - scale) * ln_beta3 + scale * ln_beta1)), beta3)
    return alpha, beta3


@register
class AdEMAMixRule(Rule):
    name = "ademamix"
    class_name = "AdEMAMix"
    oracle = "fastoptim.rules.ademamix.ReferenceAdEMAMix"
    defaults = dict(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None, eps=1e-8,
                    weight_decay=1e-2, maximize=False)
    state_names = ("exp_avg", "exp_avg_slow", "exp_avg_sq")
    unsigned_states = frozenset({"exp_avg_sq"})
    update = staticmethod(ademamix_update)
    option_sets = (
        dict(lr=1e-2),
        dict(lr=1e-2, betas=(0.8, 0.9, 0.99), alpha=2.0, weight_decay=0.1, eps=1e-6),
        dict(lr=1e-2, t_alpha=10, t_beta3=10, maximize=True, weight_decay=0.0),
    )
    low_precision_options = dict(lr=1e-2, betas=(0.8, 0.9, 0.95), alpha=2.0, weight_decay=2.0, t_alpha=4, t_beta3=4)
    fp16_options = dict(eps=1e-3)

    def validate(self, group):
        check_nonnegative(group, "lr", "eps", "weight_decay")
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 3:
            raise ValueError(f"Invalid betas: {betas!r} (must be three numbers (beta1, beta2, beta3))")
        for i, beta in enumerate(betas):
            check_unit_interval(f"beta{i + 1} (betas[{i}])", beta)
        _number("alpha", group["alpha"])
        for name in ("t_alpha", "t_beta3"):
            value = group[name]
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"Invalid {name}: {value!r} (must be None or a whole number of steps >= 0)")
        if group["t_beta3"] and (float(betas[0]) == 0 or float(betas[2]) == 0):
            raise ValueError(f"Invalid betas: {betas!r} (the t_beta3 warmup takes logarithms: beta1 and beta3 "
                             "must be > 0)")
        check_bool(group, "maximize")

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]))

    def named_scalars(self, group, step):
        lr = group["lr"]
        beta1, beta2, _ = group["betas"]
        alpha, beta3 = warmed_up(group, step)
        return dict(lr=lr, beta1=beta1, one_minus_beta1=1 - beta1, beta2=beta2, one_minus_beta2=1 - beta2,
                    beta3=beta3, one_minus_beta3=1 - beta3, alpha=alpha, bias_correction1=1 - beta1 ** step,
                    bias_correction2_sqrt=math.sqrt(1 - beta2 ** step), eps=group["eps"],
                    decay_factor=1 - lr * group["weight_decay"])


class ReferenceAdEMAMix(ReferenceLoop):
    """The oracle: AdEMAMix as the paper writes it (Algorithm 1, with bitsandbytes' decoupled decay and warmups),
    one tensor at a time in ``compute_dtype`` (float64 by default; None: each param's own dtype)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None,
                 eps=1e-8, weight_decay=1e-2, maximize=False, compute_dtype: torch.dtype | None = torch.float64):
        super().__init__(params, dict(lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps,
                                      weight_decay=weight_decay, maximize=maximize), compute_dtype)

    @torch.no_grad()
    def step(self, closure=None):  # (torch.optim's signature: trainers pass closure=None; none is taken here)
        for group, p, state, dtype, before in self.stepping("exp_avg", "exp_avg_slow", "exp_avg_sq"):
            beta1, beta2, beta3 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            t = before + 1
            alpha = group["alpha"] if not group["t_alpha"] else min(t * group["alpha"] / group["t_alpha"],
                                                                     group["alpha"])
            beta3_t = beta3
            if group["t_beta3"]:
                s = t / group["t_beta3"]
                half_life_mix = (1 - s) * math.log(beta3) + s * math.log(beta1)
                beta3_t = min(math.exp(math.log(beta1) * math.log(beta3) / half_life_mix), beta3)
            g = p.grad.to(dtype)
            if group["maximize"]:
                g = -g
            x = p.to(dtype) * (1 - lr * wd)
            m1 = beta1 * state["exp_avg"].to(dtype) + (1 - beta1) * g
            m2 = beta3_t * state["exp_avg_slow"].to(dtype) + (1 - beta3_t) * g
            nu = beta2 * state["exp_avg_sq"].to(dtype) + (1 - beta2) * g * g
            m1_hat = m1 / (1 - beta1 ** t)
            nu_hat = nu / (1 - beta2 ** t)
            p.copy_(x - lr * (m1_hat + alpha * m2) / (nu_hat.sqrt() + eps))
            for name, value in (("exp_avg", m1), ("exp_avg_slow", m2), ("exp_avg_sq", nu)):
                state[name].copy_(value)
