"""``create()``: any optimizer by name, with the usual no-decay group for biases and norm weights."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .optimizer import FastOptimizer
from .registry import get


def param_groups(model: torch.nn.Module, weight_decay: float | None = None) -> list[dict]:
    """Two groups: weights with >= 2 dims decay; biases, norm weights and other 1-d/0-d params do not.

    ``weight_decay=None`` leaves the decayed group at the optimizer's default.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay}] if weight_decay is None else [{"params": decay, "weight_decay": weight_decay}]
    groups.append({"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def muon_groups(model: torch.nn.Module, weight_decay: float | None = None, adamw_lr: float = 3e-4,
                adamw_betas: tuple = (0.9, 0.95), adamw_eps: float = 1e-8) -> list[dict]:
    """The usual Muon recipe as param groups of one optimizer: Muon for the hidden matrices; AdamW (``adamw_lr``,
    ``adamw_betas``, ``adamw_eps``) for embeddings, the output head and every param that is not a matrix, with no
    weight decay on 0-d/1-d params. The head is a Linear tied to an embedding or, untied, the last Linear whose
    out_features is an embedding's vocabulary size (only the last: hidden Linears may be as wide as the vocab)."""
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    vocab = {m.num_embeddings for m in embeddings}
    apart = {id(m.weight) for m in embeddings}  # a tied head shares one of these weights
    heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features in vocab]
    if heads and not any(id(m.weight) in apart for m in heads):
        apart.add(id(heads[-1].weight))
    hidden, matrices, vectors = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.dim() == 2 and id(p) not in apart:
            hidden.append(p)
        else:
            (matrices if p.dim() >= 2 else vectors).append(p)
    decay = {} if weight_decay is None else {"weight_decay": weight_decay}
    adamw = dict(use_muon=False, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps)
    groups = [{"params": hidden, **decay}, {"params": matrices, **adamw, **decay},
              {"params": vectors, **adamw, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def create(model_or_params: torch.nn.Module | Iterable, name: str, **kwargs: Any) -> FastOptimizer:
    """``create(model, "adamw", lr=3e-4, weight_decay=0.1, impl="foreach")``; ``create(model, "muon", lr=0.02,
    adamw_lr=3e-4)`` builds the Muon recipe (``muon_groups``) in one optimizer."""
    cls = get(name).cls
    if isinstance(model_or_params, torch.nn.Module) and get(name).name == "muon":
        recipe = {k: kwargs.pop(k) for k in ("adamw_lr", "adamw_betas", "adamw_eps") if k in kwargs}
        groups = muon_groups(model_or_params, kwargs.pop("weight_decay", None), **recipe)
        if not groups:
            raise ValueError("the model has no parameters that require grad")
        return cls(groups, **kwargs)
    if isinstance(model_or_params, torch.nn.Module):
        groups = param_groups(model_or_params, kwargs.pop("weight_decay", None))
        if not groups:
            raise ValueError("the model has no parameters that require grad")
        return cls(groups, **kwargs)
    return cls(model_or_params, **kwargs)
