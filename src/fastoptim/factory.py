"""``create()``: any optimizer by name, with the usual no-decay group for biases and norm weights."""

from __future__ import annotations

import sys
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


# the usual names of an output head: a Linear's own name or its outermost module's ("lm_head", "heads.0",
# "classifier.6", "head.fc"); names inside a block ("layer.0.output.dense") are not looked at
HEAD_NAMES = frozenset({"head", "heads", "lm_head", "output", "classifier", "logits", "embed_out", "unembed",
                        "fc", "out", "score", "last_linear"})


def _named_like_head(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] in HEAD_NAMES or parts[0] in HEAD_NAMES


def output_heads(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights of the model's output heads that are not an embedding's own (tied heads are), by a stated rule:

    * a language model (an Embedding, and Linears whose out_features is its vocabulary size): the only such
      Linear, or, where there are several (a hidden Linear may be as wide as a vocabulary or a positional
      table), those named like a head (``HEAD_NAMES``); several and none so named, with no tied head: a warning,
      and none;
    * a classifier (no tied head and no Linear as wide as a vocabulary): the Linears named like a head, else
      the last Linear registered (the output layer of ``nn.Sequential`` MLPs and of most models). A warning
      names the choice where it is a guess: chosen by position, or several named.

    ``muon_groups(head=...)`` says it outright instead."""
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    vocab = {m.num_embeddings for m in embeddings}
    tables = {id(m.weight) for m in embeddings}
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    tied = any(id(m.weight) in tables for _, m in linears)
    wide = [(name, m) for name, m in linears if m.out_features in vocab and id(m.weight) not in tables]
    if len(wide) == 1 and not tied:
        return [wide[0][1].weight]
    if wide or tied:
        named = [m.weight for name, m in wide if _named_like_head(name)]
        if wide and not named and not tied:
            _warn(f"muon_groups: {len(wide)} Linears are as wide as an embedding ({', '.join(n for n, _ in wide)}) "
                  "and none is named like an output head: all stay on Muon; pass head= (the head's module or "
                  "weight, or () for none) to say which")
        return named
    return _classifier_head(model, linears)


def _warn(message: str) -> None:
    """A UserWarning that points at the first caller outside this module (of create() or muon_groups())."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def _shown(name: str) -> str:
    return repr(name) if name else "the model itself"


def _classifier_head(model: torch.nn.Module, linears: list[tuple[str, torch.nn.Linear]]) -> list[torch.nn.Parameter]:
    """A model without a language model's head: its Linears named like a head, and its last layer where that is a
    convolution named like a head (a conv classifier, as SqueezeNet's or a segmentation net's: earlier convs under
    such a name, an ASPP or a detection tower, are hidden layers); else its last Linear; else (a net of
    convolutions only) its last convolution. Muon would orthogonalise the logits' weights, which the recipe keeps
    on AdamW."""
    last_conv, last_is_conv = None, False
    for name, m in model.named_modules():  # (one pass: registration order)
        if isinstance(m, torch.nn.modules.conv._ConvNd):
            last_conv, last_is_conv = (name, m), True
        elif isinstance(m, torch.nn.Linear):
            last_is_conv = False
    named = [(name, m) for name, m in linears if _named_like_head(name)]
    if last_is_conv and _named_like_head(last_conv[0]):
        named.append(last_conv)
    say = "pass head= (the head's module or weight, or () for none) to say which"
    if len(named) > 1:
        _warn(f"muon_groups: {len(named)} layers are named like an output head "
              f"({', '.join(_shown(n) for n, _ in named)}): all are taken as output heads and stepped by AdamW; {say}")
    elif not named and (linears or last_conv):
        named, kind = ([linears[-1]], "Linear") if linears else ([last_conv], "convolution")
        _warn(f"muon_groups: no layer is named like an output head or tied to an embedding: the last {kind} "
              f"registered, {_shown(named[0][0])}, is taken as the output head and stepped by AdamW; {say}")
    return [m.weight for _, m in named]


def _takes_muon(p: torch.Tensor) -> bool:
    """A param of 3+ dims goes to Muon where its first two dims are above 1 (as in timm's Muon): a 1 there marks
    a class token, a position table (1, n, d), a layer scale (d, 1, 1) or a depthwise filter (c, 1, k, k)."""
    return p.dim() >= 3 and p.shape[0] > 1 and p.shape[1] > 1


def muon_groups(model: torch.nn.Module, weight_decay: float | None = None, adamw_lr: float = 3e-4,
                adamw_betas: tuple = (0.9, 0.95), adamw_eps: float = 1e-8,
                head: torch.nn.Module | torch.Tensor | Iterable | None = None, batched: bool = True) -> list[dict]:
    """The usual Muon recipe as param groups of one optimizer: Muon for the hidden matrices; AdamW (``adamw_lr``,
    ``adamw_betas``, ``adamw_eps``) for embeddings, the output head and every param that is not a matrix, with no
    weight decay on 0-d/1-d params. ``head``: the output head's modules or weights (None: ``output_heads``).

    Muon's matrices: 2-D weights; convolution weights, in a group of their own with ``matrices="flatten"`` (each
    filter bank the matrix (out, in * kernel), as Jordan's Muon takes it; a Conv1d weight is 3-D too); and
    other params of 3+ dims, batches of matrices (MoE experts (E, M, N); those of 4+ dims in a group of their own
    with ``matrices="batch"``, which "auto" would flatten), both where their first two dims are above 1
    (``_takes_muon``). ``batched=False`` (a rule of 2-D matrices only: NorMuon) leaves
    params of 3+ dims to AdamW."""
    apart = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    if head is None:
        heads = output_heads(model)
    else:
        heads = [head] if isinstance(head, (torch.nn.Module, torch.Tensor)) else list(head)
        heads = [p for h in heads for p in (h.parameters() if isinstance(h, torch.nn.Module) else [h])]
    apart |= {id(p) for p in heads}
    convs = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.modules.conv._ConvNd)}
    hidden, filters, stacks, matrices, vectors = [], [], [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) not in apart and (p.dim() == 2 or batched and _takes_muon(p)):
            (filters if id(p) in convs else stacks if p.dim() >= 4 else hidden).append(p)
        else:
            (matrices if p.dim() >= 2 else vectors).append(p)
    if not hidden and not filters and not stacks and (matrices or vectors):
        _warn("muon_groups: the model has no hidden matrix for Muon (a 2-D weight, a convolution's filters, or "
              "a batch of matrices such as MoE experts): every param steps with AdamW")
    decay = {} if weight_decay is None else {"weight_decay": weight_decay}
    adamw = dict(use_muon=False, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps)
    groups = [{"params": hidden, **decay}, {"params": filters, "matrices": "flatten", **decay},
              {"params": stacks, "matrices": "batch", **decay},
              {"params": matrices, **adamw, **decay}, {"params": vectors, **adamw, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def create(model_or_params: torch.nn.Module | Iterable, name: str, **kwargs: Any) -> FastOptimizer:
    """``create(model, "adamw", lr=3e-4, weight_decay=0.1, impl="foreach")``; ``create(model, "muon", lr=0.02,
    adamw_lr=3e-4)`` builds the Muon recipe (``muon_groups``) in one optimizer."""
    spec = get(name)
    cls = spec.cls
    if isinstance(model_or_params, torch.nn.Module) and spec.params == "matrices":  # Muon's recipe
        recipe = {k: kwargs.pop(k) for k in ("adamw_lr", "adamw_betas", "adamw_eps", "head") if k in kwargs}
        groups = muon_groups(model_or_params, kwargs.pop("weight_decay", None), **recipe,
                             batched=cls.rule.batched_matrices)
        if not groups:
            raise ValueError("the model has no parameters that require grad")
        return cls(groups, **kwargs)
    if isinstance(model_or_params, torch.nn.Module):
        groups = param_groups(model_or_params, kwargs.pop("weight_decay", None))
        if not groups:
            raise ValueError("the model has no parameters that require grad")
        return cls(groups, **kwargs)
    return cls(model_or_params, **kwargs)
