"""Oracles: torch.optim classes, and plain reference loops of the published algorithms where torch has none.
The tests and ``fastoptim curves`` compare against these; nothing else in the package uses them."""

from __future__ import annotations

import importlib

import torch

from fastoptim.registry import OptimizerSpec
from fastoptim.rules.declared import ReferenceLoop, reference_newton_schulz


class ReferenceLion(ReferenceLoop):
    """Lion exactly as published (Chen et al. 2023, Algorithm 2), one tensor at a time:

        c = b1 m + (1 - b1) g;   p <- p - lr (sign(c) + wd p);   m <- b2 m + (1 - b2) g

    ``compute_dtype`` is the precision of that arithmetic: float64 (the default; params and state are then
    rounded once per step to their own dtype), or None for each param's own dtype, one rounding per operation
    as a plain loop in that dtype does. Lion's sign makes the two differ more than rounding suggests: where
    ``c`` is within a rounding of 0, a last-bit difference in ``m`` or ``p`` flips ``sign(c)`` and moves that
    weight by ``2 lr``, so an fp32 run and the float64 reference part ways after a few dozen steps of training
    (``fastoptim curves`` prints by how much). A claim that a level computes exactly this algorithm in fp32 is
    checked against ``compute_dtype=None``; how close fp32 Lion stays to exact arithmetic, against float64."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False,
                 compute_dtype: torch.dtype | None = torch.float64):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize), compute_dtype)

    @torch.no_grad()
    def step(self, closure=None):  # (torch.optim's signature: trainers pass closure=None; none is taken here)
        for group, p, state, dtype, _ in self.stepping("exp_avg", counted=False):  # (torch's Lion keeps no count)
            beta1, beta2 = group["betas"]
            lr, weight_decay = group["lr"], group["weight_decay"]
            g = p.grad.to(dtype)
            if group["maximize"]:
                g = -g
            m = state["exp_avg"].to(dtype)
            x = p.to(dtype)
            update = torch.sign(beta1 * m + (1 - beta1) * g)
            p.copy_(x - lr * (update + weight_decay * x))
            state["exp_avg"].copy_(beta2 * m + (1 - beta2) * g)


class ReferenceLAMB(ReferenceLoop):
    """LAMB exactly as published (You et al. 2019, Algorithm 2, with phi the identity, or a clamp of the ratio at
    ``max_trust_ratio``), one tensor at a time in ``compute_dtype`` (float64 by default; None: the param's dtype):

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  r = m_hat / (sqrt(v_hat) + eps) + wd p
        p <- p - lr * (||p|| / ||r||) * r        (the ratio 1 where either norm is 0)"""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, max_trust_ratio=None,
                 maximize=False, compute_dtype: torch.dtype | None = torch.float64):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      max_trust_ratio=max_trust_ratio, maximize=maximize), compute_dtype)

    @torch.no_grad()
    def step(self, closure=None):  # (torch.optim's signature: trainers pass closure=None; none is taken here)
        for group, p, state, dtype, before in self.stepping("exp_avg", "exp_avg_sq"):
            beta1, beta2 = group["betas"]
            t = before + 1
            g = p.grad.to(dtype)
            if group["maximize"]:
                g = -g
            x = p.to(dtype)
            m = beta1 * state["exp_avg"].to(dtype) + (1 - beta1) * g
            v = beta2 * state["exp_avg_sq"].to(dtype) + (1 - beta2) * g * g
            r = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + group["eps"]) + group["weight_decay"] * x
            x_norm, r_norm = x.norm().item(), r.norm().item()
            ratio = x_norm / r_norm if x_norm > 0 and r_norm > 0 else 1.0
            if group["max_trust_ratio"] is not None:
                ratio = min(ratio, group["max_trust_ratio"])
            p.copy_(x - group["lr"] * ratio * r)
            state["exp_avg"].copy_(m)
            state["exp_avg_sq"].copy_(v)


class ReferenceMuon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz in ``ns_dtype`` (None: what ``fastoptim.Muon`` picks on the CPU):
    torch's own single-tensor loop (``lerp``, ``addmm``, the same order of operations), one matrix at a time.
    With bf16 it is torch.optim.Muon; with float32, the oracle of fastoptim's fp32 Newton-Schulz. It also takes
    fastoptim's coefficient schedules (a preset's name, one triple per iteration) and ``ns_method``, with Gram
    Newton-Schulz written out as plain products on the (transposed-if-tall) matrix."""

    def __init__(self, params, *args, ns_dtype: torch.dtype | str | None = None, ns_method: str = "auto",
                 **kwargs):
        from fastoptim.rules.muon import ns_dtype_for

        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype_for(ns_dtype)
        self.ns_method = ns_method

    @torch.no_grad()
    def step(self, closure=None):  # (torch.optim's signature: trainers pass closure=None; none is taken here)
        from torch.optim._muon import _adjust_lr

        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                x = reference_newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                            self.ns_dtype, self.ns_method)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(x, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))


def matrix_views(t: torch.Tensor, matrices: str = "auto", split=None) -> list[torch.Tensor]:
    """The 2-D views of ``t`` that Muon orthogonalises apart, written for the oracle apart from the rule's own:
    ``g.view(len(g), -1)`` for filters, as Jordan's Muon views them (``matrices="flatten"``, or "auto" at 4+
    dims), each matrix of a batch ("batch", or "auto" at 3 dims), and each block of rows ``split`` cuts."""
    if t.dim() == 2:
        mats = [t]
    elif matrices == "batch" or (matrices == "auto" and t.dim() == 3):
        mats = list(t.view(-1, *t.shape[-2:]).unbind(0))
    else:
        mats = [t.view(len(t), -1)]
    if split is None:
        return mats
    return [block for m in mats for block in m.split([len(m) // split] * split if isinstance(split, int)
                                                     else list(split))]


class ReferenceMuonRecipe:
    """The Muon recipe (``fastoptim.factory.muon_groups``) with the oracles: ``reference`` (``ReferenceMuon``, or
    the oracle of another rule of matrices: NorMuon's) for the hidden matrices, torch's AdamW (single-tensor) for
    each other group. Takes a model, as ``fastoptim.create`` does. A Muon param that is not one matrix (filters, a
    batch of matrices, ``split``) is stepped as its ``matrix_views``, each a param of the oracle's own that shares
    the param's memory."""

    # the group options it takes itself (how a param's matrices are laid out), with their defaults; the rest of
    # ``muon_kwargs`` go to ``reference``
    LAYOUT = (("matrices", "auto"), ("split", None))

    def __init__(self, model, lr=1e-3, adamw_lr=3e-4, adamw_betas=(0.9, 0.95), adamw_eps=1e-8,
                 weight_decay=0.1, reference=ReferenceMuon, **muon_kwargs):
        from fastoptim.factory import muon_groups

        self.optimizers = []
        self.views: list[tuple[torch.Tensor, list[torch.nn.Parameter], dict]] = []
        # (an oracle of 2-D matrices only, NorMuon's, gets the recipe that leaves params of 3+ dims to AdamW)
        batched = getattr(reference, "batched_matrices", True)
        for group in muon_groups(model, weight_decay, adamw_lr, adamw_betas, adamw_eps, batched=batched):
            params = group.pop("params")
            if group.pop("use_muon", True):
                layout = {k: group.pop(k, muon_kwargs.get(k, default)) for k, default in self.LAYOUT}
                kwargs = {k: v for k, v in muon_kwargs.items() if k not in layout}
                stepped = []
                for p in params:
                    if p.dim() == 2 and layout["split"] is None:
                        stepped.append(p)
                        continue
                    views = [torch.nn.Parameter(v) for v in matrix_views(p.detach(), **layout)]
                    self.views.append((p, views, layout))
                    stepped += views
                self.optimizers.append(reference(stepped, lr=lr, **group, **kwargs))
            else:
                self.optimizers.append(torch.optim.AdamW(params, **group, foreach=False))

    def zero_grad(self):
        for opt in self.optimizers:
            opt.zero_grad()
        for p, _, _ in self.views:
            p.grad = None

    def step(self):
        for p, views, layout in self.views:
            grads = [None] * len(views) if p.grad is None else matrix_views(p.grad, **layout)
            for view, grad in zip(views, grads):
                view.grad = grad
        for opt in self.optimizers:
            opt.step()


def reference_class(spec: OptimizerSpec):
    """The oracle class the rule names (``Rule.oracle``: a torch.optim class or a reference loop)."""
    module, _, name = spec.cls.rule.oracle.rpartition(".")
    return getattr(importlib.import_module(module), name)


def reference_kwargs(spec: OptimizerSpec) -> dict:
    """torch.optim's single-tensor path: the documented oracle."""
    return {} if spec.reference is None else {"foreach": False}
