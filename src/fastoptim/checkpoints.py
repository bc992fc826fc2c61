"""Checkpoints in torch.optim's format: what ``FastOptimizer.state_dict`` writes (``export``, ``to_torch``) and what
``load_state_dict`` checks before it loads anything (``check_loaded``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import storage


def export(sd: dict[str, Any], *, rule) -> dict[str, Any]:
    """torch.optim's ``state_dict()`` of this optimizer as it is saved: step counters (and the rule's host states)
    as 0-d float tensors, as torch.optim writes them; quantized states as their parts; the settings the rule keeps
    out of checkpoints (``Rule.unsaved_hypers``: a function, say) left out, so the loading optimizer keeps its own."""
    for group in sd["param_groups"]:  # (torch's copies)
        for k in rule.unsaved_hypers:
            group.pop(k, None)
    scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    exported = {}
    for index, state in sd["state"].items():
        entry = {}
        for k, v in state.items():
            if k == "step" or k in rule.host_states:
                v = torch.tensor(float(v), dtype=scalar_dtype)
            entry[k] = v
        exported[index] = storage.export_entry(entry)
    sd["state"] = exported
    return sd


def to_torch(sd: dict[str, Any], *, params: list[Tensor]) -> dict[str, Any]:
    """``sd`` (from ``export``) as torch.optim keeps state: 16/8/4-bit states as tensors of their param's shape and
    dtype (quantized ones dequantized), and no rounding state."""
    for index, entry in sd["state"].items():
        p = params[index]
        plain, parts = storage.split_quantized(entry)
        for name, saved in parts.items():
            plain[name] = storage.import_quantized(name, saved, p)
        sd["state"][index] = {k: storage.torch_value(v, p) for k, v in plain.items()
                              if k not in storage.rounding.ROUNDING_STATES}  # (torch.optim has no use for them)
    return sd


class Kept(NamedTuple):
    """A saved state to put in as it is (past torch's loader, which casts every state to its param's dtype)."""
    index: int
    param: Tensor
    name: str
    value: Any


def check_loaded(state_dict: dict[str, Any], *, groups: list[dict], optimizer_rule, state_format) -> list[Kept]:
    """Everything torch.optim would only find halfway through loading, found before anything changes.
    Returns the states to keep as saved, past torch's casting (``Kept``): quantized states checked and copied,
    and 16-bit ones where this optimizer keeps that state at 16 bits."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' entries")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                         f"this optimizer has {len(groups)}")
    params, rules = [], {}
    for i, (group, saved) in enumerate(zip(groups, saved_groups)):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(f"loaded state dict's parameter group {i} has {len(saved['params'])} params, "
                             f"this optimizer's has {len(group['params'])}")
        merged = {**group, **{k: v for k, v in saved.items() if k != "params"}}
        try:
            optimizer_rule.validate(merged)
        except (ValueError, TypeError) as e:
            raise ValueError(f"loaded state dict's parameter group {i}: {e}") from None
        for p in group["params"]:  # (a setting that no longer fits a param: Muon's split)
            why = optimizer_rule.for_group(merged).check_param(p, merged)
            if why:
                raise ValueError(f"loaded state dict's parameter group {i}: {why}")
        params += list(zip(saved["params"], group["params"]))
        rules.update({id(p): optimizer_rule.for_group(merged) for p in group["params"]})
    by_id = dict(params)
    group_of = {id(p): group for group in groups for p in group["params"]}
    kept = []
    for index, state in state_dict["state"].items():
        if index not in by_id:
            raise ValueError(f"loaded state dict has state for param {index!r}, which no group lists")
        p = by_id[index]
        plain, parts = storage.split_quantized(state)
        for name, value in plain.items():
            if name == "step" or name in optimizer_rule.host_states or not isinstance(value, Tensor):
                continue
            rule = rules[id(p)]
            if name not in rule.state_names and name not in storage.rounding.ROUNDING_STATES:
                lost = name.endswith((storage.CODES, storage.ABSMAX))  # a quantized state's part, its format lost
                raise ValueError(f"loaded state dict has state {name!r} for param {index}, which its group's "
                                 f"algorithm ({rule.name}) does not keep: it keeps {list(rule.state_names)}"
                                 + (f" (no {name.rpartition('.')[0]}{storage.FORMAT} entry says its format; "
                                    f"{storage.TO_TORCH})" if lost else ""))
            if name in storage.rounding.ROUNDING_STATES:
                why = storage.rounding.check_rounding_state(name, value.to(p.device), p)
                if why:
                    raise ValueError(f"loaded state dict's {name!r} for param {index} {why}")
            if name == storage.rounding.RNG:  # the rounding's random stream: [seed, draws]
                kept.append(Kept(index, p, name, value.clone()))  # past torch's loader, which casts to bf16
                continue
            shape = rule.state_shape(name, p)
            if shape is not None and tuple(value.shape) != shape:
                raise ValueError(f"loaded state dict's {name!r} for param {index} has shape "
                                 f"{tuple(value.shape)}; it must have shape {shape} (the param has shape "
                                 f"{tuple(p.shape)})")
            fmt = state_format(p, name, group_of[id(p)])
            kept_as = storage.codecs.of(fmt).tensor_dtype(p.dtype)
            quantized_here = kept_as is None and name in rule.state_names
            if quantized_here and not (storage.is_dtensor(value) or storage.is_dtensor(p)):
                # kept in several tensors here (8/4-bit): converted as it loads, span by span, so neither a
                # copy of the saved tensor nor torch's cast of it is ever made
                try:
                    kept.append(Kept(index, p, name, storage.codecs.of(fmt).adopt(value, p, fmt)))
                except ValueError as e:
                    raise ValueError(f"loaded state dict's {name!r} for param {index} {e}") from None
            elif value.dtype != p.dtype and value.dtype == kept_as:  # kept as saved (bf16)
                kept.append(Kept(index, p, name, value.to(p.device, copy=True)))
        for name, saved in parts.items():
            try:
                kept.append(Kept(index, p, name, storage.import_quantized(name, saved, p)))
            except ValueError as e:
                raise ValueError(f"loaded state dict's param {index}: {e}") from None
    return kept
