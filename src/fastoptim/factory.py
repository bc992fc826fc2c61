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


def create(model_or_params: torch.nn.Module | Iterable, name: str, **kwargs: Any) -> FastOptimizer:
    """``create(model, "adamw", lr=3e-4, weight_decay=0.1, impl="foreach")``."""
    cls = get(name).cls
    if isinstance(model_or_params, torch.nn.Module):
        groups = param_groups(model_or_params, kwargs.pop("weight_decay", None))
        if not groups:
            raise ValueError("the model has no parameters that require grad")
        return cls(groups, **kwargs)
    return cls(model_or_params, **kwargs)
