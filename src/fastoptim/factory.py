"""``create()``: any optimizer by name, with the usual no-decay group for biases and norm weights."""

from __future__ import annotations

import warnings
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


# the usual names of an output head's module (one part of its qualified name: "lm_head", "heads.0")
HEAD_NAMES = frozenset({"head", "heads", "lm_head", "output", "classifier", "logits", "embed_out", "unembed"})


def output_heads(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights of the model's output heads that are not an embedding's own (tied heads are): among the
    Linears whose out_features is an embedding's vocabulary size, the only one or, where there are several (a
    hidden Linear may be as wide as a vocabulary or a positional table), those named like a head
    (``HEAD_NAMES``). Several and none so named, with no tied head: a warning, and none (pass ``head=``)."""
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    vocab = {m.num_embeddings for m in embeddings}
    tables = {id(m.weight) for m in embeddings}
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    tied = any(id(m.weight) in tables for _, m in linears)
    wide = [(name, m) for name, m in linears if m.out_features in vocab and id(m.weight) not in tables]
    if len(wide) == 1 and not tied:
        return [wide[0][1].weight]
    named = [m.weight for name, m in wide if HEAD_NAMES & set(name.split("."))]
    if wide and not named and not tied:
        warnings.warn(f"muon_groups: {len(wide)} Linears are as wide as an embedding ({', '.join(n for n, _ in wide)}) "
                      "and none is named like an output head: all stay on Muon; pass head= (the head's module or "
                      "weight, or () for none) to say which", UserWarning, stacklevel=3)
    return named


def muon_groups(model: torch.nn.Module, weight_decay: float | None = None, adamw_lr: float = 3e-4,
                adamw_betas: tuple = (0.9, 0.95), adamw_eps: float = 1e-8,
                head: torch.nn.Module | torch.Tensor | Iterable | None = None) -> list[dict]:
    """The usual Muon recipe as param groups of one optimizer: Muon for the hidden matrices; AdamW (``adamw_lr``,
    ``adamw_betas``, ``adamw_eps``) for embeddings, the output head and every param that is not a matrix, with no
    weight decay on 0-d/1-d params. ``head``: the output head's modules or weights (None: ``output_heads``)."""
    apart = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    if head is None:
        heads = output_heads(model)
    else:
        heads = [head] if isinstance(head, (torch.nn.Module, torch.Tensor)) else list(head)
        heads = [p for h in heads for p in (h.parameters() if isinstance(h, torch.nn.Module) else [h])]
    apart |= {id(p) for p in heads}
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
        recipe = {k: kwargs.pop(k) for k in ("adamw_lr", "adamw_betas", "adamw_eps", "head") if k in kwargs}
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
