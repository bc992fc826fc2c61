r"""ASGD, averaged stochastic gradient descent (Polyak & Juditsky 1992; the step-size schedule of Bottou 2012,
"Stochastic Gradient Descent Tricks"), torch.optim.ASGD's semantics.

    g <- -g                         if maximize
    g <- g + wd * p                 if weight_decay != 0
    p <- p (1 - lambd eta_t) - eta_t g
    ax <- p                         while mu_t = 1, else ax <- ax + mu_t (p - ax)
    eta_{t+1} = lr / (1 + lambd lr t)^alpha,   mu_{t+1} = 1 / max(1, t - t0)      (eta_1 = lr, mu_1 = 1)
"""

from __future__ import annotations

import struct

import torch

from .base import Rule, _number, check_bool, check_nonnegative, nonzero, register
from .common import maximize_and_decay


def asgd_update(p, g, ax,
                decay, eta, mu, keep, weight_decay,
                MAXIMIZE, WEIGHT_DECAY):
    p, g = maximize_and_decay(p, g, weight_decay, None, MAXIMIZE, WEIGHT_DECAY, DECOUPLED=False)
    p = p * decay
    p = p - eta * g
    # keep = 0 while mu = 1 (torch copies p into ax then): 0 + (p - 0) * 1 is p exactly
    ax_kept = ax * keep
    ax = ax_kept + (p - ax_kept) * mu
    return p, ax


def _in_scalar_dtype(value: float) -> float:
    """``value`` as torch keeps it in a 0-d state tensor: float32 unless the default dtype is float64."""
    if torch.get_default_dtype() == torch.float64:
        return value
    return struct.unpack("f", struct.pack("f", value))[0]


@register
class ASGDRule(Rule):
    class_name = "ASGD"
    oracle = "torch.optim.ASGD"
    signature = ("lr", "lambd", "alpha", "t0", "weight_decay", "foreach", "maximize", "*")
    option_sets = (
        dict(lr=1e-2),
        dict(lr=5e-2, lambd=0.1, alpha=0.5, t0=5, weight_decay=0.1),
        dict(lr=1e-2, t0=2, maximize=True),
    )
    curves_options = dict(lr=0.05)
    tensor_hypers = ("lr", "lambd", "alpha", "t0")
    low_precision_options = dict(lr=5e-2, lambd=0.5, t0=3, weight_decay=0.5)
    name = "asgd"
    defaults = dict(lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0.0, maximize=False)
    state_names = ("ax",)
    # eta and mu are set at the end of each step from that step's lr and t0, and used by the next one: kept per
    # param as torch keeps them (a schedule moves lr), not recomputed from the count
    host_states = ("eta", "mu")
    update = staticmethod(asgd_update)

    def validate(self, group):
        check_nonnegative(group, "lr", "weight_decay")
        for name in ("lambd", "alpha", "t0"):
            _number(name, group[name])
        check_bool(group, "maximize")

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]))

    def host_start(self, group):
        return (_in_scalar_dtype(float(group["lr"])), 1.0)

    def host_step(self, group, step, values):
        lr = float(group["lr"])
        eta = lr / ((1 + float(group["lambd"]) * lr * step) ** float(group["alpha"]))
        mu = 1 / max(1, step - float(group["t0"]))
        return (_in_scalar_dtype(eta), _in_scalar_dtype(mu))

    def named_scalars(self, group, step, eta, mu):
        return dict(decay=1 - group["lambd"] * eta, eta=eta, mu=mu, keep=0.0 if mu == 1 else 1.0,
                    weight_decay=group["weight_decay"])
