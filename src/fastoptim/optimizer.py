"""FastOptimizer: torch.optim.Optimizer's surface, one rule's math, a level that runs it.

A step validates every group before it touches anything (bad hyper-parameters or sparse grads leave
params and state as they were), then, per group, buckets the params that have a grad by
(device, dtype, step) and hands each bucket to the level with the host scalars of that step.
Per-param ``step`` counters (for the optimizers torch keeps one for) live in ``state`` as Python ints:
no per-param tensor ops, no host syncs. ``state_dict()`` writes them as torch.optim does (0-d float
tensors) and ``load_state_dict`` reads both.

With ``flat=True`` each group's params, grads and states live in one buffer per (device, dtype)
(``flat.FlatBucket``) and a step is one pass over those buffers.

torch.amp.GradScaler hands the step ``grad_scale`` and ``found_inf`` (``_step_supports_amp_scaling``):
a step with inf/NaN grads changes nothing; otherwise grads are unscaled inside the update, together with
the clip factor of ``max_grad_norm`` (global norm of the unscaled grads, one multi-tensor reduction). The fused
GPU kernels read ``found_inf`` themselves (no host sync): the step is counted optimistically and taken
back at the next step if the flag was set; other levels read the flag first.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from . import clip, levels
from .flat import FlatBucket
from .levels import Bucket, is_dtensor
from .rules import Rule


@dataclass
class _Amp:
    """What this step multiplies the grads by, and GradScaler's found_inf when the kernels skip by themselves."""
    grad_mul: Tensor | None
    found_inf: Tensor | None
    stepped: list[dict] = field(default_factory=list)  # state dicts whose step was counted optimistically
    buckets: list[FlatBucket] = field(default_factory=list)

    def pending(self) -> tuple:
        """The flag copied to host memory without waiting, and an event that says when it is there."""
        if self.found_inf.device.type == "cuda":
            flag = torch.empty((), dtype=self.found_inf.dtype, pin_memory=True)
            flag.copy_(self.found_inf, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return flag, done, self.stepped, self.buckets
        return self.found_inf.clone(), None, self.stepped, self.buckets


@dataclass
class _Plan:
    """A group's single bucket from the last step, kept so an unchanged next step skips the per-param loop."""
    params: list[Tensor]
    active: tuple
    key: tuple                       # (device, dtype)
    states: list                     # per rule.state_names: the bucket's state tensors, None where inactive
    step_states: list[dict]          # the state dicts whose "step" counts (empty for SGD and Lion)
    step: int

    def fits(self, params: list[Tensor], active: tuple) -> bool:
        return (active == self.active and len(params) == len(self.params)
                and all(map(operator.is_, params, self.params))
                and all(st.get("step") == self.step for st in self.step_states[:1]))


class FastOptimizer(torch.optim.Optimizer):
    rule: Rule
    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable, impl: str = "auto", flat: bool = False,
                 max_grad_norm: float | None = None, **hyper: Any):
        self.impl = levels.check_impl(impl)
        self.flat = bool(flat)
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                          or not max_grad_norm > 0):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm!r} (must be a number > 0, or None)")
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: Tensor | None = None  # the global grad norm of the last step, with max_grad_norm
        self._flat_buckets: list[list[FlatBucket]] = []  # per param group, in flat mode
        self._bucket_caches: dict[tuple, dict] = {}
        self._pending_skips: list[tuple] = []  # (found_inf flag, event, stepped states, flat buckets)
        self._plans: dict[int, _Plan] = {}  # per group: last step's bucket, reused while nothing changed
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
        group = self.param_groups[-1]
        if self.flat:
            by_key: dict[tuple, list[Tensor]] = {}
            for p in group["params"]:
                by_key.setdefault((p.device, p.dtype), []).append(p)
            buckets = [FlatBucket(ps) for ps in by_key.values()]
            self._flat_buckets.append(buckets)
            for bucket in buckets:
                self._sync_flat_state(bucket, group)
        elif self.rule.eager_state:
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

    def _sync_flat_state(self, bucket: FlatBucket, group: dict, force: bool = False) -> None:
        """Every param's state as views of the bucket's state buffers; values already there are kept."""
        rule = self.rule
        names = [n for n, needed in zip(rule.state_names, rule.active(group)) if needed]
        if not force and all(n in bucket.state_buffers for n in names):
            return
        states = bucket.param_states = [self.state[p] for p in bucket.params]
        had_state = [any(n in st for n in rule.state_names) for st in states]
        for name in set(names) | {n for st in states for n in st if n in rule.state_names}:
            fill = rule.initial_value(name, group)
            _, views = bucket.state_buffer(name, fill)
            for st, view in zip(states, views):
                value = st.get(name)
                if value is None:
                    view.fill_(fill)  # (re)loaded without this state: it starts afresh
                elif value is not view:
                    view.copy_(value)
                st[name] = view
        if rule.exports_step:
            steps = {st.setdefault("step", 0) for st in states}
        elif force:  # no counter in torch's state: a loaded buffer means past the first step
            steps = {1 if had else 0 for had in had_state}
        else:
            steps = {bucket.step}
        bucket.step = steps.pop() if len(steps) == 1 else None

    # --- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [self._collect(group) for group in self.param_groups]  # validates; mutates nothing
        for buckets in self._flat_buckets:  # grads a user replaced go back into the flat buffers first
            for bucket in buckets:
                bucket.repair_grads()
        self._resolve_skips()
        found_inf = getattr(self, "found_inf", None)
        in_kernel = found_inf is not None and levels.skips_in_kernel(self.impl, found_inf.device)
        if found_inf is not None and not in_kernel and found_inf.item() != 0:
            return loss  # GradScaler saw inf/NaN grads: this step changes nothing
        amp = _Amp(self._grad_mul(work), found_inf if in_kernel else None)
        for index, (group, params, grads) in enumerate(work):
            if self.flat:
                self._step_flat(index, group, amp)
            elif params:
                self._step_group(index, group, params, grads, amp)
        if in_kernel:
            self._pending_skips.append(amp.pending())
        return loss

    def _grad_mul(self, work: list) -> Tensor | None:
        """What the update multiplies the grads by: GradScaler's 1/scale (as GradScaler.unscale_ computes it),
        times the clip factor of ``max_grad_norm`` from the global norm of the unscaled grads."""
        grad_scale = getattr(self, "grad_scale", None)
        grad_mul = None if grad_scale is None else grad_scale.double().reciprocal().float()
        if self.max_grad_norm is None:
            return grad_mul
        if self.flat:
            grads = [bucket.grad_buffer for buckets in self._flat_buckets for bucket in buckets]
        else:
            grads = [g for _, _, gs in work for g in gs]
        total = clip.grad_norm(grads)
        if is_dtensor(total):  # sharded grads: the norm is a partial sum until reduced across ranks
            total = total.full_tensor()
        if grad_mul is not None:
            total = total * grad_mul.to(total.device)
        self.last_grad_norm = total
        factor = clip.clip_factor(total, self.max_grad_norm)
        return factor if grad_mul is None else factor * grad_mul.to(factor.device)

    def _resolve_skips(self) -> None:
        """Steps the kernels skipped (found_inf) were counted optimistically; take them back now, reading
        the flag a step later, when the kernel that set it has long finished."""
        for flag, done, stepped, buckets in self._pending_skips:
            if done is not None:
                done.synchronize()
            if flag.item() != 0:
                for state in stepped:
                    state["step"] -= 1
                for bucket in buckets:
                    bucket.step -= 1
        self._pending_skips.clear()

    def _collect(self, group: dict) -> tuple[dict, list[Tensor], list[Tensor]]:
        self.rule.validate(group)
        params, grads = [], []
        if self.flat:
            return group, params, grads
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

    def _run(self, key: tuple, group: dict, step: int, params, grads, states, amp: "_Amp") -> None:
        bucket = Bucket(params, grads, states, self._bucket_caches.setdefault(key, {}))
        run = levels.level(self.impl, bucket.device)
        extra = {} if amp.found_inf is None else {"found_inf": amp.found_inf}
        run(self.rule, bucket, group, step, self.rule.scalars(group, step), self.rule.flags(group), amp.grad_mul,
            **extra)

    def _step_flat(self, index: int, group: dict, amp: "_Amp") -> None:
        rule = self.rule
        for b, bucket in enumerate(self._flat_buckets[index]):
            self._sync_flat_state(bucket, group)
            if bucket.step is None:  # params at different step counts (a loaded checkpoint): per param
                self._step_group(index, group, bucket.params, [p.grad for p in bucket.params], amp)
                continue
            bucket.step = step = bucket.step + 1
            if rule.exports_step:
                for state in bucket.param_states:
                    state["step"] = step
            if amp.found_inf is not None:
                amp.buckets.append(bucket)
                amp.stepped.extend(bucket.param_states if rule.exports_step else ())
            states = [[bucket.state_buffers[n]] if needed else None
                      for n, needed in zip(rule.state_names, rule.active(group))]
            self._run((index, "flat", b), group, step, [bucket.param_buffer], [bucket.grad_buffer], states, amp)

    def _step_group(self, index: int, group: dict, params: list[Tensor], grads: list[Tensor], amp: "_Amp") -> None:
        rule = self.rule
        active = rule.active(group)
        plan = self._plans.get(index)
        if plan is not None and plan.fits(params, active):
            return self._step_planned(index, group, plan, grads, amp)
        names = [n for n, needed in zip(rule.state_names, active) if needed]
        counts_steps = rule.exports_step
        plain = True  # every param a plain real tensor: the bucket can be planned for the next step
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
                if amp.found_inf is not None:
                    amp.stepped.append(state)
            else:  # torch keeps no counter here (SGD, Lion): the rule only tells a first step from later ones
                step = 1 if fresh else 2
            if is_dtensor(p):  # FSDP2 / tensor parallel: the update is elementwise, so each rank's shard
                p, g = p.to_local(), g.to_local()
                tensors = [t.to_local() for t in tensors]
                plain = False
            if p.is_complex():  # elementwise on the real view, as torch.optim does
                p, g = torch.view_as_real(p), torch.view_as_real(g)
                tensors = [torch.view_as_real(t) for t in tensors]
                plain = False
            key = (p.device, p.dtype, step)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = ([], [], [[] for _ in names])
            bucket[0].append(p)
            bucket[1].append(g)
            for lst, t in zip(bucket[2], tensors):
                lst.append(t)
        for (device, dtype, step), (ps, gs, ss) in buckets.items():
            it = iter(ss)
            states = [next(it) if needed else None for needed in active]
            self._run((index, device, dtype), group, step, ps, gs, states, amp)
        if plain and len(buckets) == 1:  # the usual case: the next step can skip the per-param work
            (device, dtype, step), (ps, _, ss) = next(iter(buckets.items()))
            it = iter(ss)
            self._plans[index] = _Plan(list(params), active, (device, dtype),
                                       [next(it) if needed else None for needed in active],
                                       [self.state[p] for p in params] if counts_steps else [],
                                       step if counts_steps else 2)
        else:
            self._plans.pop(index, None)

    def _step_planned(self, index: int, group: dict, plan: "_Plan", grads: list[Tensor], amp: "_Amp") -> None:
        """Same params, same flags as the last step, all at one step count: only the counters move."""
        plan.step = step = plan.step + 1 if plan.step_states else 2
        for state in plan.step_states:
            state["step"] = step
        if amp.found_inf is not None:
            amp.stepped.extend(plan.step_states)
        self._run((index, *plan.key), group, step, plan.params, grads, plan.states, amp)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """In flat mode grads are views of one buffer per bucket: zeroed with one memset, never set to None."""
        if not self.flat:
            return super().zero_grad(set_to_none)
        for buckets in self._flat_buckets:
            for bucket in buckets:
                bucket.grad_buffer.zero_()
                bucket.repair_grads()

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
        self._resolve_skips()
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
        self._resolve_skips()  # they speak of the state being replaced (the caches restart in __setstate__)
        super().load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(impl=self.impl, flat=self.flat, max_grad_norm=self.max_grad_norm,
                     _flat_buckets=self._flat_buckets)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # unpickled or deep-copied objects come without the step-to-step caches: start them afresh
        self.__dict__.setdefault("impl", "auto")
        self.__dict__.setdefault("flat", False)
        self.__dict__.setdefault("max_grad_norm", None)
        self.__dict__.setdefault("_flat_buckets", [])
        self.__dict__.setdefault("last_grad_norm", None)
        self._bucket_caches, self._plans, self._pending_skips = {}, {}, []
        for buckets in self._flat_buckets:
            for bucket in buckets:
                bucket.rehome()
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
        for s in self.state.values():
            step = s.get("step")
            if isinstance(step, Tensor):
                s["step"] = int(step.item())
        for group, buckets in zip(self.param_groups, self._flat_buckets):
            for bucket in buckets:
                self._sync_flat_state(bucket, group, force=True)

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
