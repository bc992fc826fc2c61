r"""SGD with momentum, dampening and Nesterov (Sutskever et al. 2013), torch.optim.SGD's semantics.

    g <- -g                      if maximize
    g <- g + wd * p              if weight_decay != 0
    b <- g                       first step, if momentum != 0
    b <- mu * b + (1 - tau) * g  later steps
    g <- g + mu * b  (nesterov)  or  g <- b
    p <- p - lr * g
"""

from __future__ import annotations

import torch

from .base import Rule, _number, register, check_bool, check_nonnegative, nonzero
from .common import maximize_and_decay


def sgd_update(p, g, momentum_buffer,
               lr, momentum, weight_decay, buffer_decay, grad_weight,
               MAXIMIZE, WEIGHT_DECAY, MOMENTUM, NESTEROV):
    p, g = maximize_and_decay(p, g, weight_decay, None, MAXIMIZE, WEIGHT_DECAY, DECOUPLED=False)
    if MOMENTUM:
        # first step: buffer_decay = 0 and grad_weight = 1 turn the zero-initialised buffer into g
        momentum_buffer = momentum_buffer * buffer_decay + g * grad_weight
        if NESTEROV:
            g = g + momentum * momentum_buffer
        else:
            g = momentum_buffer
    p = p - lr * g
    return p, momentum_buffer


@register
class SGDRule(Rule):
    name = "sgd"
    class_name = "SGD"
    oracle = "torch.optim.SGD"
    option_sets = (
        dict(lr=0.1),
        dict(lr=0.05, momentum=0.9),
        dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1),
        dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.05, maximize=True),
    )
    curves_options = dict(lr=0.1, momentum=0.9)
    tensor_hypers = ("lr", "momentum")
    low_precision_options = dict(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.5)
    defaults = dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
    state_names = ("momentum_buffer",)
    exports_step = False
    update = staticmethod(sgd_update)

    def validate(self, group):
        check_nonnegative(group, "lr", "momentum", "weight_decay")
        _number("dampening", group["dampening"])
        check_bool(group, "nesterov", "maximize")
        momentum = _number("momentum", group["momentum"])
        if group["nesterov"] and ((momentum is not None and momentum <= 0) or group["dampening"] != 0):
            raise ValueError("nesterov=True requires momentum > 0 and dampening = 0 "
                             f"(got momentum={group['momentum']}, dampening={group['dampening']})")

    def active(self, group):
        return (nonzero(group["momentum"]),)

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]),
                    MOMENTUM=nonzero(group["momentum"]), NESTEROV=group["nesterov"])

    def torch_fused(self, params, grads, states, group, step, grad_scale=None, found_inf=None):
        """torch's own fused kernel for this math (the fused level uses it on the CPU)."""
        (momentum_buffer,) = states
        torch._fused_sgd_(params, grads, momentum_buffer or [], weight_decay=float(group["weight_decay"]),
                          momentum=float(group["momentum"]), lr=float(group["lr"]),
                          dampening=float(group["dampening"]), nesterov=group["nesterov"],
                          maximize=group["maximize"], is_first_step=step == 1,
                          grad_scale=grad_scale, found_inf=found_inf)

    def named_scalars(self, group, step):
        first = step == 1
        return dict(lr=group["lr"], momentum=group["momentum"], weight_decay=group["weight_decay"],
                    buffer_decay=0.0 if first else group["momentum"],
                    grad_weight=1.0 if first else 1.0 - group["dampening"])
