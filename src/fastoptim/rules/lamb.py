r"""LAMB, layer-wise adaptive moments (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT
in 76 minutes", Algorithm 2): Adam's direction, rescaled per tensor so that a step moves each tensor by lr times
its own norm.

    g <- -g                                     if maximize
    m <- b1 m + (1 - b1) g
    v <- b2 v + (1 - b2) g^2
    r <- (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps) + wd p
    ratio = ||p|| / ||r||   per tensor; 1 where either norm is 0
    ratio <- min(ratio, max_trust_ratio)        if max_trust_ratio is not None
    p <- p - lr * ratio * r

Defaults are the paper's and NVIDIA apex's FusedLAMB's: eps 1e-6, weight decay 0 (inside ``r``, so it takes part
in the norm, as the paper writes it), no clamp of the ratio (the paper's phi is the identity). ``max_trust_ratio=1``
never lets the ratio grow a step: timm's ``trust_clip``, and what bitsandbytes' LAMB does with its default
``max_unorm=1.0`` (bitsandbytes' LAMB differs otherwise: its norm leaves out the weight decay and the bias
corrections' ratio, and it decays decoupled, so it is compared with this one only where those coincide:
tests/rules/test_lamb.py). torch.optim has no LAMB; the oracle is ``fastoptim.reference.ReferenceLAMB``.
"""

from __future__ import annotations

import math

import torch

from .base import Elementwise, PerTensor, Rule, _number, check_betas, check_bool, check_nonnegative, nonzero, register
from .common import adam_moments
from .prims import sqrt


def lamb_direction(p, g, exp_avg, exp_avg_sq, update,
                   lr, one_minus_beta1, beta2, one_minus_beta2, bias_correction1, bias_correction2_sqrt, eps,
                   weight_decay,
                   MAXIMIZE, WEIGHT_DECAY, MAX_TRUST_RATIO):
    """Adam's bias-corrected direction, plus the weight decay, into ``update``."""
    if MAXIMIZE:
        g = -g
    exp_avg, exp_avg_sq = adam_moments(g, exp_avg, exp_avg_sq, one_minus_beta1, beta2, one_minus_beta2)
    update = (exp_avg / bias_correction1) / (sqrt(exp_avg_sq) / bias_correction2_sqrt + eps)
    if WEIGHT_DECAY:
        update = update + weight_decay * p
    return p, exp_avg, exp_avg_sq, update


def _norms(x):
    """The norm of each tensor of the batch ``x`` (n, ...), in fp32 at least."""
    flat = x.reshape(x.shape[0], math.prod(x.shape[1:]))
    return torch.linalg.vector_norm(flat, dim=1, dtype=torch.promote_types(x.dtype, torch.float32))


def lamb_trust_ratio(param, update,
                     lr, one_minus_beta1, beta2, one_minus_beta2, bias_correction1, bias_correction2_sqrt, eps,
                     weight_decay,
                     MAXIMIZE, WEIGHT_DECAY, MAX_TRUST_RATIO):
    """``update`` times each tensor's trust ratio ||p|| / ||update||."""
    param_norm, update_norm = _norms(param), _norms(update)
    ratio = torch.where((param_norm > 0) & (update_norm > 0), param_norm / update_norm, torch.ones_like(param_norm))
    if MAX_TRUST_RATIO is not None:
        ratio = ratio.clamp(max=MAX_TRUST_RATIO)
    return (update * ratio.to(update.dtype).reshape((-1,) + (1,) * (update.dim() - 1)),)


def lamb_apply(p, g, update,
               lr, one_minus_beta1, beta2, one_minus_beta2, bias_correction1, bias_correction2_sqrt, eps,
               weight_decay,
               MAXIMIZE, WEIGHT_DECAY, MAX_TRUST_RATIO):
    p = p - lr * update
    return p, update


@register
class LAMBRule(Rule):
    name = "lamb"
    class_name = "LAMB"
    oracle = "fastoptim.reference.ReferenceLAMB"
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, max_trust_ratio=None, maximize=False)
    state_names = ("exp_avg", "exp_avg_sq")
    unsigned_states = frozenset({"exp_avg_sq"})
    scratch = ("update",)
    stages = (Elementwise(lamb_direction, ("exp_avg", "exp_avg_sq", "update")),
              PerTensor(lamb_trust_ratio, ("param", "update"), ("update",), flat=True),
              Elementwise(lamb_apply, ("update",)))
    option_sets = (
        dict(lr=1e-2),
        dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, eps=1e-4),
        dict(lr=1e-2, max_trust_ratio=1.0, maximize=True, weight_decay=0.05),
    )
    curves_options = dict(lr=1e-2)

    def validate(self, group):
        check_nonnegative(group, "lr", "eps", "weight_decay")
        check_betas(group)
        check_bool(group, "maximize")
        limit = group["max_trust_ratio"]
        if limit is not None:
            value = _number("max_trust_ratio", limit)
            if isinstance(limit, torch.Tensor) or not value > 0:
                raise ValueError(f"Invalid max_trust_ratio: {limit!r} (must be None or a number > 0)")

    def named_flags(self, group):
        limit = group["max_trust_ratio"]
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]),
                    MAX_TRUST_RATIO=None if limit is None else float(limit))

    def named_scalars(self, group, step):
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], one_minus_beta1=1 - beta1, beta2=beta2, one_minus_beta2=1 - beta2,
                    bias_correction1=1 - beta1 ** step, bias_correction2_sqrt=(1 - beta2 ** step) ** 0.5,
                    eps=group["eps"], weight_decay=group["weight_decay"])
