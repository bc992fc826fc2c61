r"""Rprop, resilient backpropagation (Riedmiller & Braun 1993), torch.optim.Rprop's semantics.

    g <- -g                                   if maximize
    s = sign(g * g_prev)
    d <- clamp(d * (eta+ if s > 0, eta- if s < 0, 1 if s = 0), step_min, step_max)   (d starts at lr)
    g <- 0                                    where s < 0 (no step, and no sign change seen next time)
    p <- p - sign(g) d
    g_prev <- g
"""

from __future__ import annotations

from .base import Rule, _number, check_bool, check_nonnegative, register
from .prims import clamp, sign


def rprop_update(p, g, prev, step_size,
                 etaminus, etaplus, step_size_min, step_size_max,
                 MAXIMIZE):
    if MAXIMIZE:
        g = -g
    s = sign(g * prev)
    # with s in {-1, 0, 1}: each indicator is 0 or 1 exactly, so the factor is eta+, eta- or 1 exactly
    squared = s * s
    grew = (squared + s) * 0.5
    shrank = (squared - s) * 0.5
    factor = grew * etaplus + shrank * etaminus + (1.0 - squared)
    step_size = clamp(step_size * factor, step_size_min, step_size_max)
    g = g * (1.0 - shrank)
    p = p - sign(g) * step_size
    return p, g, step_size


@register
class RpropRule(Rule):
    class_name = "Rprop"
    oracle = "torch.optim.Rprop"
    option_sets = (
        dict(lr=1e-2),
        dict(lr=1e-2, etas=(0.4, 1.5), step_sizes=(1e-3, 0.05)),
        dict(lr=1e-2, maximize=True),
    )
    tensor_hypers = ("lr", "etas", "step_sizes")
    low_precision_options = dict(lr=1e-2, etas=(0.4, 1.5), step_sizes=(1e-3, 0.05), maximize=True)
    name = "rprop"
    defaults = dict(lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), maximize=False)
    state_names = ("prev", "step_size")
    unsigned_states = frozenset({"step_size"})
    update = staticmethod(rprop_update)

    def validate(self, group):
        check_nonnegative(group, "lr")
        etas, sizes = group["etas"], group["step_sizes"]
        for name, pair in (("etas", etas), ("step_sizes", sizes)):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"Invalid {name}: {pair!r} (must be a pair)")
        etaminus, etaplus = _number("etas[0]", etas[0]), _number("etas[1]", etas[1])
        if etaminus is not None and etaplus is not None and not 0.0 < etaminus < 1.0 < etaplus:
            raise ValueError(f"Invalid etas: ({etaminus}, {etaplus}) (must be 0 < etas[0] < 1 < etas[1])")
        _number("step_sizes[0]", sizes[0])
        _number("step_sizes[1]", sizes[1])
        check_bool(group, "maximize")

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"])

    def named_scalars(self, group, step):
        etaminus, etaplus = group["etas"]
        step_size_min, step_size_max = group["step_sizes"]
        return dict(etaminus=etaminus, etaplus=etaplus, step_size_min=step_size_min, step_size_max=step_size_max)

    def initial_value(self, name, group):
        return float(group["lr"]) if name == "step_size" else 0.0
