"""The public optimizer classes: torch.optim's signatures and defaults, plus ``impl=``.

``impl`` picks the level ("auto", "loop", "foreach", "fused", "compiled"; see ``fastoptim.IMPLS``);
``flat=True`` keeps each group's params, grads and states in one buffer per device and dtype;
``max_grad_norm=`` clips the global grad norm inside the step (``last_grad_norm`` holds the norm);
``state_bits=`` 32, 16 (bf16), 8 or 4 (block-wise quantized, for params with >= 2 dims and
``min_quant_size`` elements) says how the state is kept (``fastoptim.storage``), as does ``state_format=``
"fp32", "bf16", "dynamic8" or "dynamic4" (the codecs' names, ``storage.codecs``; an alias of the same);
``rounding=`` "nearest",
"stochastic" or "kahan" says how bf16/fp16 params are rounded after an fp32 step (no fp32 master copy);
a param group may set its own of either.
torch.optim's ``foreach=True`` / ``fused=True`` are accepted as spellings of ``impl=``.
"""

from __future__ import annotations

from .optimizer import FastOptimizer
from .rules import (AdadeltaRule, AdafactorRule, AdagradRule, ASGDRule, AdamaxRule, AdamRule, LionRule, MuonRule, NAdamRule,
                    RAdamRule, RMSpropRule, RpropRule, SGDRule)


def _impl(impl: str, foreach: bool | None, fused: bool | None) -> str:
    if fused and foreach:
        raise ValueError("foreach=True and fused=True cannot both be set")
    if impl == "auto":
        return "fused" if fused else "foreach" if foreach else "auto"
    return impl


class SGD(FastOptimizer):
    rule = SGDRule()

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, impl="auto", flat=False, max_grad_norm=None, state_bits=None, state_format=None,
                 min_quant_size=4096, rounding="nearest", foreach=None, fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format, lr=lr, momentum=momentum,
                         dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)


class Adam(FastOptimizer):
    rule = AdamRule(decoupled=False)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, impl="auto", flat=False, max_grad_norm=None, state_bits=None, state_format=None,
                 min_quant_size=4096, rounding="nearest", foreach=None, fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)


class AdamW(FastOptimizer):
    rule = AdamRule(decoupled=True)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, impl="auto", flat=False, max_grad_norm=None, state_bits=None, state_format=None,
                 min_quant_size=4096, rounding="nearest", foreach=None, fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)


class RMSprop(FastOptimizer):
    rule = RMSpropRule()

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False, *,
                 maximize=False, impl="auto", flat=False, max_grad_norm=None, state_bits=None, state_format=None,
                 min_quant_size=4096, rounding="nearest", foreach=None, fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format, lr=lr, alpha=alpha, eps=eps,
                         weight_decay=weight_decay, momentum=momentum, centered=centered, maximize=maximize)


class Adagrad(FastOptimizer):
    rule = AdagradRule()

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0,
                 eps=1e-10, *, maximize=False, impl="auto", flat=False, max_grad_norm=None, state_bits=None, state_format=None,
                 min_quant_size=4096, rounding="nearest", foreach=None, fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format, lr=lr, lr_decay=lr_decay,
                         weight_decay=weight_decay, initial_accumulator_value=initial_accumulator_value,
                         eps=eps, maximize=maximize)


class Lion(FastOptimizer):
    rule = LionRule()

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 maximize=False, impl="auto", flat=False, max_grad_norm=None, state_bits=None, state_format=None,
                 min_quant_size=4096, rounding="nearest", foreach=None, fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format, lr=lr, betas=betas,
                         weight_decay=weight_decay,
                         maximize=maximize)


class Adamax(FastOptimizer):
    rule = AdamaxRule()

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=None, *,
                 maximize=False, impl="auto", flat=False, max_grad_norm=None, state_bits=None, state_format=None,
                 min_quant_size=4096, rounding="nearest", fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format,
                         lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)


class Adadelta(FastOptimizer):
    rule = AdadeltaRule()

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, foreach=None, *,
                 maximize=False, impl="auto", flat=False, max_grad_norm=None, state_bits=None, state_format=None,
                 min_quant_size=4096, rounding="nearest", fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format,
                         lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize)


class RAdam(FastOptimizer):
    rule = RAdamRule()

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 decoupled_weight_decay=False, *, maximize=False, impl="auto", flat=False, max_grad_norm=None,
                 state_bits=None, state_format=None, min_quant_size=4096, rounding="nearest", foreach=None, fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format,
                         lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=decoupled_weight_decay, maximize=maximize)


class NAdam(FastOptimizer):
    rule = NAdamRule()

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
                 decoupled_weight_decay=False, *, maximize=False, impl="auto", flat=False, max_grad_norm=None,
                 state_bits=None, state_format=None, min_quant_size=4096, rounding="nearest", foreach=None, fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format,
                         lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay,
                         decoupled_weight_decay=decoupled_weight_decay, maximize=maximize)


class Rprop(FastOptimizer):
    rule = RpropRule()

    def __init__(self, params, lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), *,
                 maximize=False, impl="auto", flat=False, max_grad_norm=None, state_bits=None, state_format=None,
                 min_quant_size=4096, rounding="nearest", foreach=None, fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format,
                         lr=lr, etas=etas, step_sizes=step_sizes, maximize=maximize)


class ASGD(FastOptimizer):
    rule = ASGDRule()

    def __init__(self, params, lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0.0, foreach=None,
                 maximize=False, *, impl="auto", flat=False, max_grad_norm=None, state_bits=None, state_format=None, min_quant_size=4096,
                 rounding="nearest", fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format,
                         lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay, maximize=maximize)


class Adafactor(FastOptimizer):
    rule = AdafactorRule()

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0, *,
                 foreach=None, maximize=False, impl="auto", flat=False, max_grad_norm=None, state_bits=None, state_format=None,
                 min_quant_size=4096, rounding="nearest", fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format,
                         lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay, maximize=maximize)


class Muon(FastOptimizer):
    """torch.optim.Muon, plus: every level (Newton-Schulz batched over same-shape matrices), ``ns_dtype``
    (None: bf16 on CUDA, fp32 elsewhere), and param groups with ``use_muon=False`` stepped by AdamW (their
    ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``), so one optimizer covers a whole
    model: ``fastoptim.create(model, "muon")``."""
    rule = MuonRule()

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 ns_dtype=None, use_muon=True, betas=(0.9, 0.95), amsgrad=False, maximize=False, impl="auto",
                 flat=False, max_grad_norm=None, state_bits=None, state_format=None, min_quant_size=4096, rounding="nearest",
                 foreach=None, fused=None):
        super().__init__(params, _impl(impl, foreach, fused), flat, max_grad_norm, state_bits, min_quant_size, rounding, state_format=state_format,
                         lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                         ns_dtype=ns_dtype, use_muon=use_muon, betas=betas, amsgrad=amsgrad, maximize=maximize)
