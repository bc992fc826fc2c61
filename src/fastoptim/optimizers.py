"""The public optimizer classes, one per registered rule (``fastoptim.rules``): torch.optim's signatures and
defaults (the rule's ``defaults`` in its ``signature`` order), plus fastoptim's own options.

``impl`` picks the level ("auto", "loop", "foreach", "fused", "compiled"; see ``fastoptim.IMPLS``);
``flat=True`` keeps each group's params, grads and states in one buffer per device and dtype;
``max_grad_norm=`` clips the global grad norm inside the step (``last_grad_norm`` holds the norm);
``state_bits=`` 32, 16 (bf16), 8 or 4 (block-wise quantized, for params with >= 2 dims and
``min_quant_size`` elements) says how the state is kept (``fastoptim.storage``); ``rounding=`` "nearest",
"stochastic" or "kahan" says how bf16/fp16 params are rounded after an fp32 step (no fp32 master copy);
a param group may set its own of either.
torch.optim's ``foreach=True`` / ``fused=True`` are accepted as spellings of ``impl=``.
"""

from __future__ import annotations

import inspect
import sys

from .optimizer import FastOptimizer
from .rules import RULES, Rule

# fastoptim's own constructor options, keyword-only, after torch's (``foreach`` and ``fused`` stay where a torch
# class has them among its positional parameters)
OWN_OPTIONS = dict(impl="auto", flat=False, max_grad_norm=None, state_bits=None, state_format=None,
                   min_quant_size=4096, rounding="nearest", gradient_release=False,
                   release_bucket_mb=None, foreach=None, fused=None)


def _impl(impl: str, foreach: bool | None, fused: bool | None) -> str:
    if fused and foreach:
        raise ValueError("foreach=True and fused=True cannot both be set")
    if impl == "auto":
        return "fused" if fused else "foreach" if foreach else "auto"
    return impl


def signature(rule: Rule) -> inspect.Signature:
    """``__init__(self, params, <torch's parameters>, *, <the rest>)`` with the rule's defaults."""
    names = rule.signature or tuple(n for n in rule.defaults if n != "maximize") + ("*", "maximize")
    unknown = [n for n in names if n != "*" and n not in rule.defaults and n not in OWN_OPTIONS]
    if unknown or set(rule.defaults) - set(names):
        raise TypeError(f"{type(rule).__name__}.signature {names} must name each of its defaults "
                        f"{tuple(rule.defaults)} once (unknown: {unknown})")
    default = {**OWN_OPTIONS, **rule.defaults}
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD), P("params", P.POSITIONAL_OR_KEYWORD)]
    kind = P.POSITIONAL_OR_KEYWORD
    for name in names + tuple(n for n in OWN_OPTIONS if n not in names):
        if name == "*":
            kind = P.KEYWORD_ONLY
            continue
        params.append(P(name, P.KEYWORD_ONLY if name in OWN_OPTIONS and name not in names else kind,
                        default=default[name]))
    return inspect.Signature(params)


def public_class(rule: Rule, module: str = __name__) -> type[FastOptimizer]:
    """The torch.optim-style class of ``rule``: its constructor binds torch's arguments by ``signature(rule)``."""
    sig = signature(rule)
    hyper = tuple(rule.defaults)

    def __init__(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        FastOptimizer.__init__(self, a["params"], _impl(a["impl"], a["foreach"], a["fused"]), a["flat"],
                               a["max_grad_norm"], a["state_bits"], a["min_quant_size"], a["rounding"],
                               state_format=a["state_format"], gradient_release=a["gradient_release"],
                               release_bucket_mb=a["release_bucket_mb"], **{name: a[name] for name in hyper})

    __init__.__signature__ = sig
    __init__.__qualname__ = f"{rule.class_name}.__init__"
    doc = type(rule).__doc__ or sys.modules[type(rule).__module__].__doc__
    return type(rule.class_name, (FastOptimizer,), {"rule": rule, "__init__": __init__, "__doc__": doc,
                                                     "__module__": module, "__qualname__": rule.class_name})


CLASSES: dict[str, type[FastOptimizer]] = {name: public_class(rule) for name, rule in RULES.items()}
__all__ = [cls.__name__ for cls in CLASSES.values()]
globals().update({cls.__name__: cls for cls in CLASSES.values()})
