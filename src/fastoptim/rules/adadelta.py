r"""Adadelta (Zeiler 2012, "ADADELTA: An Adaptive Learning Rate Method"), torch.optim.Adadelta's semantics.

    g <- -g                         if maximize
    g <- g + wd * p                 if weight_decay != 0
    s <- rho s + (1 - rho) g^2
    d <- sqrt(a + eps) / sqrt(s + eps) * g
    a <- rho a + (1 - rho) d^2
    p <- p - lr d
"""

from __future__ import annotations

from .base import Rule, _number, check_bool, check_nonnegative, nonzero, register
from .common import maximize_and_decay
from .prims import sqrt


def adadelta_update(p, g, square_avg, acc_delta,
                    lr, rho, one_minus_rho, eps, weight_decay,
                    MAXIMIZE, WEIGHT_DECAY):
    p, g = maximize_and_decay(p, g, weight_decay, None, MAXIMIZE, WEIGHT_DECAY, DECOUPLED=False)
    square_avg = square_avg * rho + g * g * one_minus_rho
    delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * g
    acc_delta = acc_delta * rho + delta * delta * one_minus_rho
    p = p - lr * delta
    return p, square_avg, acc_delta


@register
class AdadeltaRule(Rule):
    class_name = "Adadelta"
    oracle = "torch.optim.Adadelta"
    signature = ("lr", "rho", "eps", "weight_decay", "foreach", "*", "maximize")
    option_sets = (
        dict(lr=1.0),
        dict(lr=0.5, rho=0.8, weight_decay=0.1, eps=1e-4),
        dict(lr=1.0, maximize=True, weight_decay=0.05),
    )
    curves_options = dict(lr=1.0)
    tensor_hypers = ("lr", "rho")
    low_precision_options = dict(lr=1.0, rho=0.8, weight_decay=0.5, eps=1e-4)
    name = "adadelta"
    defaults = dict(lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, maximize=False)
    state_names = ("square_avg", "acc_delta")
    unsigned_states = frozenset({"square_avg", "acc_delta"})
    update = staticmethod(adadelta_update)

    def validate(self, group):
        check_nonnegative(group, "lr", "eps", "weight_decay")
        rho = _number("rho", group["rho"])
        if rho is not None and not 0.0 <= rho <= 1.0:
            raise ValueError(f"Invalid rho: {rho} (must be in [0, 1])")
        check_bool(group, "maximize")

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]))

    def named_scalars(self, group, step):
        rho = group["rho"]
        return dict(lr=group["lr"], rho=rho, one_minus_rho=1 - rho, eps=group["eps"],
                    weight_decay=group["weight_decay"])
