"""What ``FastOptimizer.load_state_dict`` checks before it loads anything (kept apart from the class, which runs it)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from . import storage


def check_loaded(opt, state_dict: dict[str, Any]) -> list[tuple]:
    """Everything torch.optim would only find halfway through loading, found before anything changes.
    Returns the states to keep as saved, past torch's casting: (index, param, name, value), quantized
    states checked and copied, and 16-bit ones where this optimizer keeps that state at 16 bits."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' entries")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                         f"this optimizer has {len(opt.param_groups)}")
    params, rules = [], {}
    for i, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(f"loaded state dict's parameter group {i} has {len(saved['params'])} params, "
                             f"this optimizer's has {len(group['params'])}")
        merged = {**group, **{k: v for k, v in saved.items() if k != "params"}}
        try:
            opt.rule.validate(merged)
        except (ValueError, TypeError) as e:
            raise ValueError(f"loaded state dict's parameter group {i}: {e}") from None
        params += list(zip(saved["params"], group["params"]))
        rules.update({id(p): opt.rule.for_group(merged) for p in group["params"]})
    by_id = dict(params)
    group_of = {id(p): group for group in opt.param_groups for p in group["params"]}
    kept = []
    for index, state in state_dict["state"].items():
        if index not in by_id:
            raise ValueError(f"loaded state dict has state for param {index!r}, which no group lists")
        p = by_id[index]
        plain, parts = storage.split_quantized(state)
        for name, value in plain.items():
            if name == "step" or name in opt.rule.host_states or not isinstance(value, Tensor):
                continue
            rule = rules[id(p)]
            if name not in rule.state_names and name not in storage.ROUNDING_STATES:
                lost = name.endswith((storage.CODES, storage.ABSMAX))  # a quantized state's part, its format lost
                raise ValueError(f"loaded state dict has state {name!r} for param {index}, which its group's "
                                 f"algorithm ({rule.name}) does not keep: it keeps {list(rule.state_names)}"
                                 + (f" (no {name.rpartition('.')[0]}{storage.FORMAT} entry says its format; "
                                    f"{storage.TO_TORCH})" if lost else ""))
            if name in storage.ROUNDING_STATES:
                why = storage.check_rounding_state(name, value.to(p.device), p)
                if why:
                    raise ValueError(f"loaded state dict's {name!r} for param {index} {why}")
            if name == storage.RNG:  # the rounding's random stream: [seed, draws]
                kept.append((index, p, name, value.clone()))  # past torch's loader, which casts to bf16
                continue
            shape = rule.state_shape(name, p)
            if shape is not None and tuple(value.shape) != shape:
                raise ValueError(f"loaded state dict's {name!r} for param {index} has shape "
                                 f"{tuple(value.shape)}; it must have shape {shape} (the param has shape "
                                 f"{tuple(p.shape)})")
            fmt = opt._state_format(p, name, group_of[id(p)])
            kept_as = storage.codecs.of(fmt).tensor_dtype(p.dtype)
            quantized_here = kept_as is None and name in rule.state_names
            if quantized_here and not (storage.is_dtensor(value) or storage.is_dtensor(p)):
                # kept in several tensors here (8/4-bit): converted as it loads, span by span, so neither a
                # copy of the saved tensor nor torch's cast of it is ever made
                try:
                    kept.append((index, p, name, storage.codecs.of(fmt).adopt(value, p, fmt)))
                except ValueError as e:
                    raise ValueError(f"loaded state dict's {name!r} for param {index} {e}") from None
            elif value.dtype != p.dtype and value.dtype == kept_as:  # kept as saved (bf16)
                kept.append((index, p, name, value.to(p.device, copy=True)))
        for name, saved in parts.items():
            try:
                kept.append((index, p, name, storage.import_quantized(name, saved, p)))
            except ValueError as e:
                raise ValueError(f"loaded state dict's param {index}: {e}") from None
    return kept
