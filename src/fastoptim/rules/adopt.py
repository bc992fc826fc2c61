r"""ADOPT (Taniguchi et al. 2024, "ADOPT: Modified Adam Can Converge with Any beta2 with the Optimal Rate"), with
the math and defaults of the authors' ``adopt.ADOPT`` (github.com/iShohei220/adopt): the grad is normalised by the
second moment of the steps before it, then averaged.

    g <- -g                                 if maximize
    g <- g + wd * p                         if weight_decay != 0 and not decouple
    first step:   v <- v + g^2              (v is 0 before it; nothing else changes)
    later steps, t the steps taken before this one (1 on the second):
      p <- p * (1 - lr * wd)                if weight_decay != 0 and decouple
      n <- g / max(sqrt(v), eps)
      n <- clamp(n, -c, c),  c = clip_lambda(t)      if clip_lambda is not None
      m <- m + (1 - b1) (n - m)
      p <- p - lr * m
      v <- b2 v + (1 - b2) g^2

``clip_lambda`` is a function of the step, as the authors' is (default ``t ** 0.25``; None: no clipping). It is
called on the host once a step, and its value reaches every level as two of the step's scalars. Being a function,
it is not saved: ``state_dict()`` leaves it out of each group (``unsaved_hypers``), and a loaded optimizer keeps
its own. torch.optim has no ADOPT; the oracle is ``ReferenceADOPT`` below.
"""

from __future__ import annotations

import math

import torch

from .base import Rule, check_betas, check_bool, check_nonnegative, nonzero, register
from .common import maximize_and_decay
from .declared import ReferenceLoop
from .prims import clamp, maximum, sqrt


def fourth_root(step):
    """The authors' default ``clip_lambda`` (``step ** 0.25``), as a named function: an optimizer holding it
    pickles, where one holding a lambda cannot."""
    return step ** 0.25


def adopt_update(p, g, exp_avg, exp_avg_sq,
                 lr, one_minus_beta1, beta2, one_minus_beta2, eps, clip_low, clip_high, weight_decay,
                 decay_factor,
                 MAXIMIZE, WEIGHT_DECAY, DECOUPLED):
    p, g = maximize_and_decay(p, g, weight_decay, decay_factor, MAXIMIZE, WEIGHT_DECAY, DECOUPLED)
    # the first step's scalars (lr = 1 - b1 = clip = 0, eps = 1, decay 1, b2 = 1 - b2 = 1) leave p and m as they
    # were and add g^2 to v (0 before a first step; the authors add to what a rewound step count left there);
    # eps = 1 and the clip at 0 keep the unused quotient finite where v and eps are 0 or g is inf
    normed = clamp(g / maximum(sqrt(exp_avg_sq), eps), clip_low, clip_high)
    exp_avg = exp_avg + (normed - exp_avg) * one_minus_beta1
    p = p - lr * exp_avg
    exp_avg_sq = exp_avg_sq * beta2 + g * g * one_minus_beta2
    return p, exp_avg, exp_avg_sq


@register
class ADOPTRule(Rule):
    name = "adopt"
    class_name = "ADOPT"
    oracle = "fastoptim.rules.adopt.ReferenceADOPT"
    defaults = dict(lr=1e-3, betas=(0.9, 0.9999), eps=1e-6, clip_lambda=fourth_root, weight_decay=0.0,
                    decouple=False, maximize=False)
    signature = ("lr", "betas", "eps", "clip_lambda", "weight_decay", "decouple", "*", "foreach", "maximize", "fused")
    unsaved_hypers = frozenset({"clip_lambda"})
    state_names = ("exp_avg", "exp_avg_sq")
    unsigned_states = frozenset({"exp_avg_sq"})
    update = staticmethod(adopt_update)
    # unclipped, the second step divides by the first grad: with coupled decay, where g + wd p nearly cancels, one
    # rounding of it moves the step by far more than fp32's tolerance, so no clip_lambda=None set decays coupled
    option_sets = (
        dict(lr=1e-2),
        dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, eps=1e-4),
        dict(lr=1e-2, weight_decay=0.3, decouple=True, maximize=True, clip_lambda=None),
    )
    curves_options = dict(lr=3e-3)
    low_precision_options = dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=2.0, decouple=True)

    def validate(self, group):
        check_nonnegative(group, "lr", "eps", "weight_decay")
        check_betas(group)
        check_bool(group, "decouple", "maximize")
        if group["clip_lambda"] is not None and not callable(group["clip_lambda"]):
            raise TypeError(f"clip_lambda must be None or a function of the step, got {group['clip_lambda']!r}")

    def named_flags(self, group):
        return dict(MAXIMIZE=group["maximize"], WEIGHT_DECAY=nonzero(group["weight_decay"]),
                    DECOUPLED=group["decouple"])

    def named_scalars(self, group, step):
        wd = group["weight_decay"]
        if step == 1:  # the second moment only: see adopt_update
            return dict(lr=0.0, one_minus_beta1=0.0, beta2=1.0, one_minus_beta2=1.0, eps=1.0, clip_low=0.0,
                        clip_high=0.0, weight_decay=wd, decay_factor=1.0)
        lr = group["lr"]
        beta1, beta2 = group["betas"]
        # the authors call it with the count before this step (their state's step before its increment)
        clip = math.inf if group["clip_lambda"] is None else group["clip_lambda"](step - 1)
        return dict(lr=lr, one_minus_beta1=1 - beta1, beta2=beta2, one_minus_beta2=1 - beta2, eps=group["eps"],
                    clip_low=-clip, clip_high=clip, weight_decay=wd, decay_factor=1 - lr * wd)


class ReferenceADOPT(ReferenceLoop):
    """The oracle: ADOPT as the authors' single-tensor step computes it, one tensor at a time in ``compute_dtype``
    (float64 by default; None: each param's own dtype). As theirs, it keeps ``clip_lambda`` on the optimizer, out
    of its groups (so out of its state_dict)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.9999), eps=1e-6, clip_lambda=fourth_root, weight_decay=0.0,
                 decouple=False, maximize=False, compute_dtype: torch.dtype | None = torch.float64):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decouple=decouple,
                                      maximize=maximize), compute_dtype)
        self.clip_lambda = clip_lambda

    @torch.no_grad()
    def step(self, closure=None):  # (torch.optim's signature: trainers pass closure=None; none is taken here)
        for group, p, state, dtype, t in self.stepping("exp_avg", "exp_avg_sq"):  # (t: the steps before this one)
            beta1, beta2 = group["betas"]
            lr, wd, eps, clip_lambda = group["lr"], group["weight_decay"], group["eps"], self.clip_lambda
            g = p.grad.to(dtype)
            if group["maximize"]:
                g = -g
            x = p.to(dtype)
            if wd != 0 and not group["decouple"]:
                g = g + wd * x
            v = state["exp_avg_sq"].to(dtype)
            if t == 0:
                state["exp_avg_sq"].copy_(v + g * g)
                continue
            if wd != 0 and group["decouple"]:
                x = x * (1 - lr * wd)
            normed = g / v.sqrt().clamp(min=eps)
            if clip_lambda is not None:
                clip = clip_lambda(t)
                normed = normed.clamp(-clip, clip)
            m = state["exp_avg"].to(dtype)
            m = m + (1 - beta1) * (normed - m)
            p.copy_(x - lr * m)
            state["exp_avg"].copy_(m)
            state["exp_avg_sq"].copy_(beta2 * v + (1 - beta2) * g * g)
