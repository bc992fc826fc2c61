r"""NorMuon (Li et al. 2025, "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491): Muon whose
orthogonalised update is normalised per neuron (per row) by a running second moment, with the defaults of the
authors' ``normuon.py`` (github.com/zichongli5/NorMuon).

    B <- mu B + (1 - mu) g                          (Muon's momentum stage)
    U <- g + mu (B - g)  if nesterov, else B
    O <- NewtonSchulz(U)                            (Muon's, with ns_coefficients, ns_steps, eps, ns_dtype)
    v <- b2 v + (1 - b2) mean over columns of O*O   (one number per row: v has shape (rows, 1))
    N <- O / (sqrt(v) + norm_eps)
    "original" (None):    S = N ||O||_F / (||N||_F + norm_eps) * sqrt(max(1, rows/cols))
    "match_rms_adamw":    S = N 0.2 sqrt(rows cols) / (||N||_F + norm_eps)
    p <- p (1 - lr wd) - lr S

``adjust_lr_fn`` None or "original" is the authors' code: the normalised update keeps the Frobenius norm of O,
then Muon's shape ratio. "match_rms_adamw" is the paper's Algorithm 1: an update of RMS 0.2, for AdamW's lr (for an
exactly orthogonal O the two differ by the factor 0.2 sqrt(max(rows, cols)), as Muon's two settings do). The
normalisation runs in fp32 at least (v in the param's dtype between steps); Newton-Schulz in ``ns_dtype``.

As Muon here: 2-D params only, and a param group with ``use_muon=False`` is stepped by AdamW (the authors'
``NorMuonWithAuxAdam`` steps such groups with Adam and decoupled decay). Unlike the authors' loop, a param without a
grad is skipped (they step it with a zero grad to keep their ranks in step), and the grad is left as it was.
"""

from __future__ import annotations

import math

import torch

from .base import Elementwise, PerTensor, check_nonnegative, check_unit_interval, register
from .declared import ReferenceLoop, reference_newton_schulz
from .muon import MuonRule, lr_ratio, muon_apply, muon_momentum, newton_schulz, ns_dtype_for

ORIGINAL_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the authors' (Muon's quintic)


def orthogonalised(x, coefficients, eps, method, dtype):
    """Muon's Newton-Schulz of the batch ``x`` (n, rows, cols): NorMuon's one call into it."""
    return newton_schulz(x, coefficients, eps, dtype, method)


def normuon_momentum(p, g, momentum_buffer, update,
                     eps, lr, decay_factor, one_minus_momentum, momentum, one_minus_beta2, norm_eps,
                     NESTEROV, NS_COEFFICIENTS, NS_METHOD, NS_DTYPE, ADJUST_LR_FN, MAXIMIZE):
    # Muon's stage as it is (every stage of a rule takes the same scalars: NorMuon's has two more)
    return muon_momentum(p, g, momentum_buffer, update, eps, lr, decay_factor, one_minus_momentum, momentum,
                         NESTEROV, NS_COEFFICIENTS, NS_METHOD, NS_DTYPE, ADJUST_LR_FN, MAXIMIZE, "auto", None)


def _frobenius(x):
    return x.norm(dim=(-2, -1), keepdim=True)


def normuon_normalise(update, second_momentum_buffer,
                      eps, lr, decay_factor, one_minus_momentum, momentum, one_minus_beta2, norm_eps,
                      NESTEROV, NS_COEFFICIENTS, NS_METHOD, NS_DTYPE, ADJUST_LR_FN, MAXIMIZE):
    """The update orthogonalised, normalised per row and scaled, and the new per-row second moment."""
    rows, cols = update.shape[-2:]
    dtype = torch.promote_types(update.dtype, torch.float32)  # a 16-bit v would round eps and small rows to 0
    o = orthogonalised(update, NS_COEFFICIENTS, eps, NS_METHOD, NS_DTYPE).to(dtype)
    v = second_momentum_buffer.to(dtype)
    # the mean over the columns as a sum over max(cols, 1): an empty row has second moment 0, not NaN
    v = v + ((o * o).sum(dim=-1, keepdim=True) / max(cols, 1) - v) * one_minus_beta2
    normed = o / (v.sqrt() + norm_eps)
    if ADJUST_LR_FN == "match_rms_adamw":
        scale = 0.2 * math.sqrt(rows * cols) / (_frobenius(normed) + norm_eps)
    else:
        scale = _frobenius(o) * lr_ratio(rows, cols, ADJUST_LR_FN) / (_frobenius(normed) + norm_eps)
    return (normed * scale).to(update.dtype), v.to(second_momentum_buffer.dtype)


def normuon_apply(p, g, update,
                  eps, lr, decay_factor, one_minus_momentum, momentum, one_minus_beta2, norm_eps,
                  NESTEROV, NS_COEFFICIENTS, NS_METHOD, NS_DTYPE, ADJUST_LR_FN, MAXIMIZE):
    return muon_apply(p, g, update, eps, lr, decay_factor, one_minus_momentum, momentum,
                      NESTEROV, NS_COEFFICIENTS, NS_METHOD, NS_DTYPE, ADJUST_LR_FN, MAXIMIZE, "auto", None)


@register
class NorMuonRule(MuonRule):
    """NorMuon: Muon with each row of its orthogonalised update normalised by a running second moment (one
    number per row), at every level, with 16/8/4-bit momentum; param groups with ``use_muon=False`` are stepped
    by AdamW (their ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``), so one optimizer
    covers a whole model: ``fastoptim.create(model, "normuon")``.

    ``beta2``: the second moment's decay; ``norm_eps``: the eps of ``O / (sqrt(v) + eps)`` and of the rescaling;
    ``adjust_lr_fn``: None or "original" (the authors' code: O's Frobenius norm kept, then Muon's shape ratio) or
    "match_rms_adamw" (the paper's: RMS 0.2); the Newton-Schulz options are Muon's."""
    name = "normuon"
    class_name = "NorMuon"
    oracle = "fastoptim.rules.normuon.ReferenceNorMuon"
    torch_class = None
    # the authors' order (lr, weight_decay, momentum, beta2), then Muon's
    signature = ("lr", "weight_decay", "momentum", "beta2", "nesterov", "ns_coefficients", "eps", "ns_steps",
                 "adjust_lr_fn", "norm_eps", "*", "ns_method", "ns_dtype", "use_muon", "betas", "amsgrad", "maximize")
    batched_matrices = False  # 2-D params only: the recipe leaves filters and expert stacks to AdamW
    option_sets = (
        dict(lr=2e-2),
        dict(lr=2e-2, nesterov=False, momentum=0.9, beta2=0.8, weight_decay=0.3, adjust_lr_fn="match_rms_adamw",
             ns_dtype="float32", maximize=True),
        dict(lr=2e-2, ns_steps=3, ns_coefficients=(2.0, -1.5, 0.5), eps=1e-5, adjust_lr_fn="original",
             norm_eps=1e-3, beta2=0.0, ns_dtype="float32"),
        # (Gram iterations are Muon's: its option sets run them; a per-row second moment of tiny updates would
        # read their rounding apart from the oracle's as a state mismatch)
        dict(lr=2e-2, ns_coefficients="polar_express", ns_method="standard", ns_dtype="float32"),
    )
    curves_options = dict(lr=0.02)
    tensor_hypers = ("lr", "momentum", "weight_decay", "beta2")
    # the authors' defaults (theirs have no nesterov, adjust_lr_fn, ns_* or eps options: these are Muon's)
    defaults = dict(lr=0.02, weight_decay=0.0, momentum=0.95, beta2=0.95, nesterov=True,
                    ns_coefficients=ORIGINAL_COEFFICIENTS, eps=1e-7, ns_steps=5, adjust_lr_fn=None, norm_eps=1e-10,
                    ns_method="auto", ns_dtype=None, use_muon=True, betas=(0.9, 0.95), amsgrad=False, maximize=False)
    state_names = ("momentum_buffer", "second_momentum_buffer")  # the authors' names
    unsigned_states = frozenset({"second_momentum_buffer"})
    stages = (Elementwise(normuon_momentum, ("momentum_buffer", "update")),
              PerTensor(normuon_normalise, ("update", "second_momentum_buffer"), ("update", "second_momentum_buffer")),
              Elementwise(normuon_apply, ("update",)))

    def validate(self, group):
        super().validate(group)  # (Muon's checks; AdamW's for a use_muon=False group)
        if group["use_muon"]:
            check_unit_interval("beta2", group["beta2"])
            check_nonnegative(group, "norm_eps")

    def validate_layout(self, group):
        pass  # (no ``matrices`` or ``split``: 2-D params only)

    def named_flags(self, group):
        flags = super().named_flags(dict(group, matrices="auto", split=None))
        del flags["MATRICES"], flags["SPLIT"]
        return flags

    def check_param(self, p, group):
        if group.get("use_muon", True) and p.dim() != 2:
            return (f"NorMuon steps 2-D matrices only, got a param of shape {tuple(p.shape)}: put it in a group "
                    "with use_muon=False (AdamW), as fastoptim.create(model, 'normuon') does")
        return None

    def check_stepped_param(self, p, group):
        return "NorMuon does not support complex parameters" if p.is_complex() else None

    def planned_settings(self, group):
        return ()  # (no ``matrices`` or ``split``)

    def state_shape(self, name, p):
        # the second moment is one number per row, as the authors keep it (``p[..., 0:1]``)
        return tuple(p.shape[:-1]) + (1,) if name == "second_momentum_buffer" else tuple(p.shape)

    def named_scalars(self, group, step):
        return dict(super().named_scalars(group, step), one_minus_beta2=1 - group["beta2"], norm_eps=group["norm_eps"])


class ReferenceNorMuon(ReferenceLoop):
    """The oracle: NorMuon as published, one matrix at a time, with torch's Newton-Schulz loop (a tall matrix
    iterated as its transpose) in ``ns_dtype`` and the rest in ``compute_dtype`` (float64 by default; None: the
    param's dtype). Groups of matrices only (no ``use_muon``)."""
    batched_matrices = False

    def __init__(self, params, lr=0.02, weight_decay=0.0, momentum=0.95, beta2=0.95, nesterov=True,
                 ns_coefficients=ORIGINAL_COEFFICIENTS, eps=1e-7, ns_steps=5, adjust_lr_fn=None, norm_eps=1e-10,
                 ns_method="auto", ns_dtype=None, maximize=False, compute_dtype: torch.dtype | None = torch.float64):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, beta2=beta2,
                                      nesterov=nesterov, ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn, norm_eps=norm_eps, maximize=maximize),
                         compute_dtype)
        self.ns_dtype = ns_dtype_for(ns_dtype)
        self.ns_method = ns_method

    def _newton_schulz(self, u, group):
        return reference_newton_schulz(u, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype,
                                       self.ns_method)

    @torch.no_grad()
    def step(self, closure=None):  # (torch.optim's signature: trainers pass closure=None; none is taken here)
        for group, p, state, dtype, _ in self.stepping("momentum_buffer", counted=False):
            if "second_momentum_buffer" not in state:
                state["second_momentum_buffer"] = torch.zeros_like(p[..., 0:1])
            mu, lr = group["momentum"], group["lr"]
            g = p.grad.to(dtype)
            if group["maximize"]:
                g = -g
            m = mu * state["momentum_buffer"].to(dtype) + (1 - mu) * g
            u = (1 - mu) * g + mu * m if group["nesterov"] else m
            o = self._newton_schulz(u, group).to(dtype)
            rows, cols = p.shape
            mean_square = (o * o).sum(dim=1, keepdim=True) / max(cols, 1)
            v = group["beta2"] * state["second_momentum_buffer"].to(dtype) + (1 - group["beta2"]) * mean_square
            n = o / (v.sqrt() + group["norm_eps"])
            if group["adjust_lr_fn"] == "match_rms_adamw":
                step_size = lr * 0.2 * math.sqrt(rows * cols) / (n.norm() + group["norm_eps"])
            else:
                shape_ratio = math.sqrt(max(1, rows / cols)) if cols else 1.0
                step_size = lr * o.norm() * shape_ratio / (n.norm() + group["norm_eps"])
            p.copy_(p.to(dtype) * (1 - lr * group["weight_decay"]) - step_size * n)
            state["momentum_buffer"].copy_(m)
            state["second_momentum_buffer"].copy_(v)

