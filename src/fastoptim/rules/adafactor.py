r"""Adafactor (Shazeer & Stern 2018, with the step-size and decay of Zhai et al. 2022), torch.optim.Adafactor's
semantics: second moments factored into row and column means for params with >= 2 dims.

    g <- -g                                    if maximize
    beta2_t = 1 - t^beta2_decay;   rho_t = min(lr, 1 / sqrt(t));   alpha = max(eps2, rms(p)) rho_t
    p <- p (1 - lr wd)
    >= 2 dims:  R <- beta2_t R + (1 - beta2_t) mean(g^2, last dim)       (rows)
                C <- beta2_t C + (1 - beta2_t) mean(g^2, next-to-last)   (columns)
                V = R C / max(mean(R), eps1)
    else:       V <- beta2_t V + (1 - beta2_t) g^2
    u = g / sqrt(max(V, eps1^2));   p <- p - alpha / max(1, rms(u) / d) u

eps1 None is the param dtype's machine epsilon. ``alpha`` and the clipping denominator are per-tensor numbers,
computed in float64 from fp32 norms as torch computes them on the host (here with no host sync).
"""

from __future__ import annotations

import math

import torch

from .base import PerTensor, Rule, _number, check_bool, check_nonnegative, nonzero, register


def _rms(x):
    """Each tensor's root mean square over its own dims, in float64: (n, 1, ..., 1)."""
    flat = x.reshape(x.shape[0], -1)
    norm = flat.norm(dim=1).double() / math.sqrt(max(flat.shape[1], 1))
    return norm.reshape((-1,) + (1,) * (x.dim() - 1))


def _norm_squared(squares, dim: int, dtype):
    """torch's ``g.norm(dim=dim, keepdim=True).square_()`` in ``dtype``, from ``g``'s squares in fp32 (or fp64),
    summed in another order than torch's norm sums them: to an ulp in fp32 and fp64, exact in 16 bits."""
    return squares.sum(dim=dim, keepdim=True).sqrt_().to(dtype).square_()


def adafactor_step(param, grad, row_var, col_var, variance,
                   lr, decay_factor, one_minus_beta2_t, rho_t, eps1, eps2, d,
                   MAXIMIZE, WEIGHT_DECAY, DTYPE_EPS1):
    """One step, written in place into ``param`` and the states, as torch's loop writes them."""
    g = -grad if MAXIMIZE else grad
    if DTYPE_EPS1 is not None:  # eps1 None: the stored param dtype's epsilon (bf16's, though the math is fp32)
        eps1 = DTYPE_EPS1
    alpha = torch.clamp(_rms(param), min=eps2) * rho_t
    if WEIGHT_DECAY:
        param.mul_(decay_factor)
    if variance is None:  # factored over the last two dims
        # mean(g^2) over each dim as torch takes it, the norm squared in the param's dtype, the norms from sums of
        # squares in fp32 or fp64 (a column sum is faster than a column norm); torch's norm sums in an
        # order of its own, so fp32 and fp64 states may differ from torch's by an ulp (16-bit ones are torch's)
        squares = g.to(torch.promote_types(g.dtype, torch.float32)).square()
        row_var.lerp_(_norm_squared(squares, -1, g.dtype).div_(g.shape[-1]), one_minus_beta2_t)
        col_var.lerp_(_norm_squared(squares, -2, g.dtype).div_(g.shape[-2]), one_minus_beta2_t)
        # the outer product R C by broadcasting (each entry is one rounded product, as the K=1 matmul gives it)
        var_estimate = (row_var * col_var).div_(row_var.mean(dim=-2, keepdim=True).clamp(min=eps1))
        var_estimate.clamp_(min=eps1 * eps1)
    else:
        variance.lerp_(g * g, one_minus_beta2_t)
        var_estimate = variance.clamp(min=eps1 * eps1)
    update = var_estimate.rsqrt_().mul_(g)  # (this function's own temporary)
    denom = torch.clamp(_rms(update) / d, min=1.0)
    param.add_(update.mul_((-alpha / denom).to(param.dtype)))


@register
class AdafactorRule(Rule):
    name = "adafactor"
    class_name = "Adafactor"
    oracle = "torch.optim.Adafactor"
    signature = ("lr", "beta2_decay", "eps", "d", "weight_decay", "*", "foreach", "maximize")
    option_sets = (
        dict(lr=1e-2),
        dict(lr=1e-2, weight_decay=0.1, beta2_decay=-0.5, eps=(1e-4, 1e-3), d=2.0),
        dict(lr=1e-2, maximize=True, weight_decay=0.05),
    )
    curves_options = dict(lr=1e-2)
    # lr is read on the host as torch reads it (a tensor's value, with .item())
    tensor_hypers = ("lr", "weight_decay", "beta2_decay", "d")
    defaults = dict(lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0, maximize=False)
    state_names = ("row_var", "col_var", "variance")
    unsigned_states = frozenset(state_names)
    stages = (PerTensor(adafactor_step, ("param", "grad", "row_var", "col_var", "variance"),
                        ("param", "row_var", "col_var", "variance"), in_place=True),)

    def validate(self, group):
        check_nonnegative(group, "lr", "weight_decay")
        beta2_decay = _number("beta2_decay", group["beta2_decay"])
        if beta2_decay is not None and beta2_decay > 0:
            raise ValueError(f"Invalid beta2_decay: {beta2_decay} (must be <= 0)")
        eps = group["eps"]
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise ValueError(f"Invalid eps: {eps!r} (must be a pair (eps1 or None, eps2))")
        if eps[0] is not None:
            check_nonnegative({"eps1 (eps[0])": eps[0]}, "eps1 (eps[0])")
        check_nonnegative({"eps2 (eps[1])": eps[1]}, "eps2 (eps[1])")
        d = _number("d", group["d"])
        if d is not None and d < 1.0:
            raise ValueError(f"Invalid d: {d} (the clipping threshold must be >= 1)")
        check_bool(group, "maximize")

    def check_stepped_param(self, p, group):
        # (torch.optim.Adafactor takes complex params and refuses them at its step, only those with a grad)
        return "Adafactor does not support complex parameters" if p.is_complex() else None

    def state_shape(self, name, p):
        factored = p.dim() >= 2
        if name == "variance":
            return tuple(p.shape) if not factored else None
        if not factored:
            return None
        shape = list(p.shape)
        shape[-1 if name == "row_var" else -2] = 1
        return tuple(shape)

    def named_flags(self, group):
        # (True: eps1 is the stored dtype's epsilon; bucket_flags puts that number in its place)
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]),
                    DTYPE_EPS1=group["eps"][0] is None)

    def bucket_flags(self, flags, dtype):
        maximize, weight_decay, eps1_from_dtype = flags
        return maximize, weight_decay, torch.finfo(dtype).eps if eps1_from_dtype else None

    def named_scalars(self, group, step):
        lr = float(group["lr"])  # torch reads it on the host too (rho_t = min(lr, ...))
        eps1, eps2 = group["eps"]
        return dict(lr=lr, decay_factor=1 - lr * group["weight_decay"],
                    one_minus_beta2_t=float(step) ** group["beta2_decay"], rho_t=min(lr, 1 / math.sqrt(step)),
                    eps1=0.0 if eps1 is None else eps1, eps2=eps2, d=group["d"])
