r"""RMSprop (Hinton 2012; centered variant Graves 2013), torch.optim.RMSprop's semantics.

    g <- -g                         if maximize
    g <- g + wd * p                 if weight_decay != 0
    s <- a s + (1 - a) g^2
    c <- c + (1 - a) (g - c)        if centered;  d = sqrt(s - c^2) + eps,  else d = sqrt(s) + eps
    b <- mu b + g / d;  p <- p - lr b    if momentum > 0
    p <- p - lr g / d                    otherwise
"""

from __future__ import annotations

from .base import Rule, nonzero, check_bool, check_nonnegative, check_unit_interval, register
from .common import maximize_and_decay
from .prims import sqrt


def rmsprop_update(p, g, square_avg, momentum_buffer, grad_avg,
                   lr, alpha, one_minus_alpha, eps, weight_decay, momentum,
                   MAXIMIZE, WEIGHT_DECAY, MOMENTUM, CENTERED):
    p, g = maximize_and_decay(p, g, weight_decay, None, MAXIMIZE, WEIGHT_DECAY, DECOUPLED=False)
    square_avg = square_avg * alpha + g * g * one_minus_alpha
    if CENTERED:
        grad_avg = grad_avg + (g - grad_avg) * one_minus_alpha
        avg = sqrt(square_avg - grad_avg * grad_avg) + eps
    else:
        avg = sqrt(square_avg) + eps
    if MOMENTUM:
        momentum_buffer = momentum_buffer * momentum + g / avg
        p = p - lr * momentum_buffer
    else:
        p = p - lr * (g / avg)
    return p, square_avg, momentum_buffer, grad_avg


@register
class RMSpropRule(Rule):
    name = "rmsprop"
    class_name = "RMSprop"
    oracle = "torch.optim.RMSprop"
    option_sets = (
        dict(lr=1e-2),
        dict(lr=1e-2, momentum=0.9, weight_decay=0.1),
        dict(lr=1e-2, centered=True, alpha=0.9, maximize=True),
        dict(lr=1e-2, centered=True, momentum=0.5, eps=1e-4),
    )
    tensor_hypers = ("lr", "momentum")
    low_precision_options = dict(lr=1e-2, alpha=0.9, momentum=0.5, centered=True)
    fp16_options = dict(eps=1e-3)
    defaults = dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False,
                    maximize=False)
    state_names = ("square_avg", "momentum_buffer", "grad_avg")
    unsigned_states = frozenset({"square_avg"})
    update = staticmethod(rmsprop_update)

    def validate(self, group):
        check_nonnegative(group, "lr", "eps", "weight_decay", "momentum")
        check_unit_interval("alpha", group["alpha"])
        check_bool(group, "centered", "maximize")

    def refuses_quantized_state(self, group):
        if group["centered"]:
            return ("centered=True takes sqrt(square_avg - grad_avg**2): with the two quantized apart the "
                    "difference goes negative and the step turns NaN; use state_bits=16 or 32")
        return None

    def active(self, group):
        return (True, nonzero(group["momentum"]), group["centered"])

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]),
                    MOMENTUM=nonzero(group["momentum"]), CENTERED=group["centered"])

    def named_scalars(self, group, step):
        alpha = group["alpha"]
        return dict(lr=group["lr"], alpha=alpha, one_minus_alpha=1 - alpha, eps=group["eps"],
                    weight_decay=group["weight_decay"], momentum=group["momentum"])
