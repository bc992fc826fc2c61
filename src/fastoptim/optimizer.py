"""FastOptimizer: torch.optim.Optimizer's surface, one rule's math, a level that runs it.

A step validates every group before it touches anything (bad hyper-parameters or sparse grads leave
params and state as they were), then, per group, buckets the params that have a grad by
(device, dtype, step) and hands each bucket to the level with the host scalars of that step.
Per-param ``step`` counters (for the optimizers torch keeps one for) live in ``state`` as Python ints:
no per-param tensor ops, no host syncs. ``state_dict()`` writes them as torch.optim does (0-d float
tensors) and ``load_state_dict`` reads both.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from . import levels
from .rules import Rule


class FastOptimizer(torch.optim.Optimizer):
    rule: Rule

    def __init__(self, params: Iterable, impl: str = "auto", **hyper: Any):
        self.impl = levels.check_impl(impl)
        defaults = dict(self.rule.defaults)
        unknown = set(hyper) - set(defaults)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected argument(s) {sorted(unknown)}; "
                            f"valid: {sorted(defaults)}")
        defaults.update(hyper)
        self.rule.validate(defaults)
        super().__init__(params, defaults)

    # --- param groups ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        candidate = {k: v for k, v in param_group.items() if k != "params"}
        for k, v in self.defaults.items():
            candidate.setdefault(k, v)
        self.rule.validate(candidate)
        super().add_param_group(param_group)
        if self.rule.eager_state:
            group = self.param_groups[-1]
            for p in group["params"]:
                self._init_state(p, group)

    def _init_state(self, p: Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            if self.rule.exports_step:
                state["step"] = 0
            for name, needed in zip(self.rule.state_names, self.rule.active(group)):
                if needed:
                    state[name] = self._new_state(p, name, group)
        return state

    def _new_state(self, p: Tensor, name: str, group: dict) -> Tensor:
        value = self.rule.initial_value(name, group)
        if p.is_complex():  # the update runs on the real view: both halves start at the value
            value = complex(value, value)
        return torch.full_like(p, value, memory_format=torch.preserve_format)

    # --- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [self._collect(group) for group in self.param_groups]  # validates; mutates nothing
        for group, params, grads in work:
            if params:
                self._step_group(group, params, grads)
        return loss

    def _collect(self, group: dict) -> tuple[dict, list[Tensor], list[Tensor]]:
        self.rule.validate(group)
        params, grads = [], []
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients "
                                   f"(param {self._param_index(p)}, shape {tuple(p.shape)})")
            params.append(p)
            grads.append(g)
        return group, params, grads

    def _step_group(self, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        rule = self.rule
        names = [n for n, needed in zip(rule.state_names, rule.active(group)) if needed]
        counts_steps = rule.exports_step
        buckets: dict[tuple, tuple[list, list, list]] = {}
        for p, g in zip(params, grads):
            state = self.state[p]
            fresh = not state
            if fresh:
                state = self._init_state(p, group)
            try:
                tensors = [state[n] for n in names]
            except KeyError:  # a flag turned on mid-run (momentum 0 -> 0.9) needs a state it lacked
                self._add_missing_state(p, state, group, names)
                tensors = [state[n] for n in names]
                fresh = True
            if counts_steps:
                state["step"] = step = state["step"] + 1
            else:  # torch keeps no counter here (SGD, Lion): the rule only tells a first step from later ones
                step = 1 if fresh else 2
            if p.is_complex():  # elementwise on the real view, as torch.optim does
                p, g = torch.view_as_real(p), torch.view_as_real(g)
                tensors = [torch.view_as_real(t) for t in tensors]
            key = (p.device, p.dtype, step)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = ([], [], [[] for _ in names])
            bucket[0].append(p)
            bucket[1].append(g)
            for lst, t in zip(bucket[2], tensors):
                lst.append(t)
        flags = rule.flags(group)
        active = rule.active(group)
        for (device, _, step), (ps, gs, ss) in buckets.items():
            it = iter(ss)
            states = [next(it) if needed else None for needed in active]
            levels.resolve(self.impl, device)(rule.update, ps, gs, states, rule.scalars(group, step), flags)

    def _add_missing_state(self, p: Tensor, state: dict, group: dict, names: list[str]) -> None:
        for name in names:
            if name not in state:
                state[name] = self._new_state(p, name, group)

    def _param_index(self, param: Tensor) -> int:
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p is param:
                    return index
                index += 1
        return -1

    # --- state_dict in torch.optim's format -----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        exported = {}
        for index, state in sd["state"].items():
            entry = {}
            for k, v in state.items():
                if k == "step":
                    v = torch.tensor(float(v), dtype=scalar_dtype)
                entry[k] = v
            exported[index] = entry
        sd["state"] = exported
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_state_dict(state_dict)
        # cloned so that stepping never writes into the caller's checkpoint dict
        state_dict = dict(state_dict)
        state_dict["state"] = {k: {n: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v)
                                   for n, v in s.items()}
                               for k, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
        for s in self.state.values():
            step = s.get("step")
            if isinstance(step, Tensor):
                s["step"] = int(step.item())

    def _check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Everything torch.optim would only find halfway through loading, found before anything changes."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must be a dict with 'state' and 'param_groups' entries")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                             f"this optimizer has {len(self.param_groups)}")
        params = []
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(f"loaded state dict's parameter group {i} has {len(saved['params'])} params, "
                                 f"this optimizer's has {len(group['params'])}")
            merged = {**self.defaults, **{k: v for k, v in saved.items() if k != "params"}}
            try:
                self.rule.validate(merged)
            except (ValueError, TypeError) as e:
                raise ValueError(f"loaded state dict's parameter group {i}: {e}") from None
            params += list(zip(saved["params"], group["params"]))
        by_id = dict(params)
        for index, state in state_dict["state"].items():
            if index not in by_id:
                raise ValueError(f"loaded state dict has state for param {index!r}, which no group lists")
            p = by_id[index]
            for name, value in state.items():
                if name == "step" or not isinstance(value, Tensor):
                    continue
                if value.shape != p.shape:
                    raise ValueError(f"loaded state dict's {name!r} for param {index} has shape "
                                     f"{tuple(value.shape)}, the param has shape {tuple(p.shape)}")
