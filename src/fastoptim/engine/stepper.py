"""The stepper: one optimizer's step core, which every step goes through.

Each ``FastOptimizer`` owns one. Three things call it, all downward: ``opt.step()`` (``step``), the release
driver as a bucket of params is ready (``step_params``, ``engine.release``) and the DDP tie after a bucket's
all-reduce (through the driver). It holds what lives from step to step: the settings (``Settings``: the
level, flat mode, clipping and how state is kept), the state mapping, each group's plan (``engine.plan``), the
steps GradScaler's flag may still take back, and flat mode's buffers. It reads the optimizer's param groups,
and nothing else of it.

A step validates every group and plans its buckets before it touches anything, so bad hyper-parameters, sparse
grads or a bad state tensor leave params and state as they were; then it commits the plans (new states in place)
and runs each bucket through the dispatcher (``engine.dispatch``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .. import clip, storage
from ..native import bulk
from ..paths import sharded
from ..storage.state import is_dtensor
from . import amp, buckets, dispatch, plan
from .flat import FlatBucket
from .state_map import StateMap


class StorageSettings(NamedTuple):
    """How one group keeps its state."""
    bits: int | str
    min_quant_size: int
    rounding: str


@dataclass
class Settings:
    """How an optimizer steps; a group's own ``state_bits``, ``min_quant_size`` and ``rounding`` win over these."""
    impl: str = "auto"
    flat: bool = False
    max_grad_norm: float | None = None
    state_bits: int = 32
    min_quant_size: int = storage.MIN_QUANT_SIZE
    rounding: str = "nearest"

    def storage_of(self, group: dict) -> StorageSettings:
        """The group's ``state_bits``, ``min_quant_size`` and ``rounding`` (these where it sets none)."""
        return StorageSettings(group.get("state_bits", self.state_bits),
                               group.get("min_quant_size", self.min_quant_size), group.get("rounding", self.rounding))


@dataclass
class Work:
    """One group's share of a step: the params that step and their grads (None: flat mode reads its buffers)."""
    index: int
    group: dict
    params: list[Tensor]
    grads: list[Tensor] | None
    dense: bool = False  # every grad is of its param's dtype and shape, contiguous (``bulk.with_grads``)


class Stepper:
    def __init__(self, owner, *, rule, settings: Settings, state: StateMap,
                 flat_buckets: list[list[FlatBucket]] | None = None):
        self._owner = weakref.ref(owner)  # (its param groups are read; the optimizer owns this stepper)
        self.name = type(owner).__name__  # (in messages)
        self.rule = rule
        self.settings = settings
        self._state = state
        self.flat_buckets: list[list[FlatBucket]] = [] if flat_buckets is None else flat_buckets  # per group
        self.plans: dict = {}  # per group, and per released set of params: the last step's, reused while they fit
        self.pending_skips: list[tuple] = []  # (found_inf flag, event, what a skip takes back)
        self.last_grad_norm: Tensor | None = None  # with max_grad_norm: the global grad norm of the last step
        self.overlapping = False  # a release driver steps sets of params: plans may overlap (``_commit``)
        self.planned_by: dict[int, object] = {}  # id(param) -> the key of the plan that last stepped it
        self.places: dict[int, tuple[int, int]] = {}  # id(param) -> (group index, position), checked at each use
        self.states_checked: int | None = None  # the state map's version ``check_groups`` last saw

    @property
    def state(self) -> StateMap:
        return self._state

    @state.setter
    def state(self, value: StateMap) -> None:
        """A new mapping (``opt.state = ...``, a load): its version counts from its own start."""
        self._state = value
        self.states_checked = None

    @property
    def groups(self) -> list[dict]:
        owner = self._owner()
        return [] if owner is None else owner.param_groups

    # --- the step ---------------------------------------------------------------------------------------

    def step(self, *, found_inf: Tensor | None = None, grad_scale: Tensor | None = None,
             grad_mul: Tensor | None = None) -> None:
        """Every group's params with a grad. ``found_inf``/``grad_scale``: GradScaler's (``engine.amp``);
        ``grad_mul``: a clip factor measured before (else the grads' own, with ``max_grad_norm``)."""
        self.resolve_skips()
        work = [self.collect(index, group) for index, group in enumerate(self.groups)]  # validates
        self._run(work, keys=[w.index for w in work], found_inf=found_inf, grad_scale=grad_scale, grad_mul=grad_mul)

    @torch.no_grad()  # (called from inside backward, where grad mode is ``create_graph``'s)
    def step_params(self, params: list[Tensor], *, grad_mul: Tensor | None = None) -> list[Tensor]:
        """``params`` alone (a released bucket), as ``step`` steps them; returns those stepped (a param no group
        holds any more is left out, its grad kept)."""
        self.resolve_skips()
        work = [self.collect(index, group, ps) for index, group, ps in self._by_group(params)]  # validates
        if len(self.plans) > 2 * sum(len(g["params"]) for g in self.groups) + 64:  # sets made up anew: start again
            self.plans = {k: v for k, v in self.plans.items() if isinstance(k, int)}
        self._run(work, keys=[(w.index, tuple(map(id, w.params))) for w in work], grad_mul=grad_mul)
        return [p for w in work for p in w.params]

    def _run(self, work: list[Work], *, keys: list, found_inf=None, grad_scale=None, grad_mul=None) -> None:
        """Plan (validating everything first), then run each group's step."""
        plans = [self._plan(w, key) for w, key in zip(work, keys)]
        rules = [self.rule.for_group(w.group) for w in work]
        step_amp = amp.begin_step(impl=self.settings.impl, found_inf=found_inf, rules=rules)
        if step_amp is None:
            return  # GradScaler saw inf/NaN grads: this step changes nothing
        step_amp.grad_mul = self._grad_mul(work, grad_scale) if grad_mul is None else grad_mul
        written: list[Tensor] = []  # (the params to count an in-place write to: one pass over all of them)
        try:
            for key, step_plan, w, rule in zip(keys, plans, work, rules):
                if step_plan is not None:
                    self._commit(key, step_plan)
                    kept = self.settings.storage_of(w.group)
                    dispatch.run_plan(impl=self.settings.impl, rule=rule, step_plan=step_plan, group=w.group,
                                      grads=w.grads, step_amp=step_amp, bits=kept.bits, rounding=kept.rounding,
                                      entry_of=self._entry_of, dense_grads=w.dense, written=written)
        finally:  # (what ran is counted, also where a later bucket raised)
            if written:
                bulk.bump_versions(written)
        if step_amp.found_inf is not None:
            self.pending_skips.append(step_amp.pending())

    def _plan(self, w: Work, key) -> plan.Plan | None:
        """The last plan kept at ``key`` when nothing it was built from changed, else a new one (validated, not
        yet committed: nothing has changed if the step stops here)."""
        if not w.params:
            return None
        cached = self.plans.get(key)
        rule = self.rule.for_group(w.group)
        # what the buckets follow from, and what their params were checked against
        shape = (rule, rule.active(w.group), self.settings.storage_of(w.group), rule.planned_settings(w.group))
        if cached is not None and cached.fits(w.params, shape, self.state):
            return cached
        self.check_storage(w.group)
        if self.settings.flat:
            self._check_flat_group(w.index, w.group)
        self._check_rounding_states(w.params)
        built = buckets.build(rule=rule, group=w.group, params=w.params, state_map=self.state,
                           state_format=self.state_format, param_index=self.param_index,
                           flat_buckets=self.flat_buckets[w.index] if self.settings.flat else None)
        built.active = shape
        built.plain_watched = shape[2].bits != 32  # (16/8/4-bit state: a plain state stays plain, ``plan``)
        return built

    def _commit(self, key, step_plan: plan.Plan) -> None:
        """A new plan's states put in place (its buckets' path caches start empty); kept for the next step. Plans
        of released sets of params may overlap: one that steps a param outdates the others' counts of it."""
        if self.plans.get(key) is not step_plan:
            step_plan.commit()
            if step_plan.reusable:
                self.plans[key] = step_plan
            else:
                self.plans.pop(key, None)
        if not self.overlapping:
            return
        planned_by, plans = self.planned_by, self.plans
        for p in step_plan.params:
            other = planned_by.get(id(p))
            if other != key:
                if other is not None:
                    plans.pop(other, None)
                planned_by[id(p)] = key

    def _entry_of(self, p: Tensor) -> tuple[dict, int, Tensor]:
        """The state dict, optimizer index and param of ``p`` (where a rounding keeps its own state)."""
        return self.state[p], self.param_index(p), p

    def _grad_mul(self, work: list[Work], grad_scale: Tensor | None) -> Tensor | None:
        """What the update multiplies the grads by: GradScaler's 1/scale (as GradScaler.unscale_ computes it),
        times the clip factor of ``max_grad_norm`` from the global norm of the unscaled grads."""
        grad_mul = None if grad_scale is None else grad_scale.double().reciprocal().float()
        max_grad_norm = self.settings.max_grad_norm
        if max_grad_norm is None:
            return grad_mul
        grads = []
        for w in work:  # flat mode with every grad there: the whole grad buffers
            grads += [b.grad_buffer for b in self.flat_buckets[w.index]] if w.grads is None else w.grads
        total = clip.grad_norm(grads)
        if is_dtensor(total):  # sharded grads: the norm is a partial sum until reduced across ranks
            total = total.full_tensor()
        if grad_mul is not None:
            total = total * grad_mul.to(total.device)
        self.last_grad_norm = total
        factor = clip.clip_factor(total, max_grad_norm)
        return factor if grad_mul is None else factor * grad_mul.to(factor.device)

    def resolve_skips(self) -> None:
        """Steps the kernels skipped (found_inf) were counted optimistically; take them back now, reading
        the flag a step later, when the kernel that set it has long finished."""
        if self.pending_skips:
            pending, self.pending_skips = self.pending_skips, []
            amp.resolve_skips(pending, self.state)

    def collect(self, index: int, group: dict, params: list[Tensor] | None = None) -> Work:
        """The params that step (those of ``params``, default the group's, whose grad is not None, as in
        torch.optim) and their grads (in the param's dtype). Flat mode puts grads a user replaced back into the
        buffers first; where every param has its grad there, the grads are None: the step reads the buffers."""
        self.rule.validate(group)
        if params is None:
            params = group["params"]
        if self.settings.flat:
            buckets = self.flat_buckets[index] if index < len(self.flat_buckets) else []
            if all([bucket.repair_grads() for bucket in buckets]):  # (a list: every bucket is repaired)
                return Work(index, group, group["params"], None)
        candidates = params
        params, grads, plain, dense = bulk.with_grads(candidates)
        if plain:
            return Work(index, group, params, grads, dense)
        params, grads = [], []
        for p in candidates:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(f"{self.name} does not support sparse gradients "
                                   f"(param {self.param_index(p)}, shape {tuple(p.shape)})")
            if g.dtype != p.dtype:  # torch takes such a grad where ``p.grad_dtype`` allows: the math promotes it
                g = g.to(p.dtype)
            g = g.resolve_neg()  # (a lazily negated view: kernels read its memory as it lies; else g itself)
            params.append(p)
            grads.append(g)
        return Work(index, group, params, grads)

    def _by_group(self, params: list[Tensor]) -> list[tuple[int, dict, list[Tensor]]]:
        """``params`` by param group: (group index, group, its params of ``params`` in the group's order), for the
        groups that hold any. A param's place is looked up and checked (the group's list may have been edited),
        not searched for: a released bucket costs its own size, not the model's."""
        groups, places, found = self.groups, self.places, {}
        for p in params:
            place = places.get(id(p))
            if place is None or not _holds(groups, place, p):
                self.places = places = {id(q): (index, position) for index, group in enumerate(groups)
                                        for position, q in enumerate(group["params"])}
                place = places.get(id(p))
                if place is None:
                    continue
            found.setdefault(place[0], []).append((place[1], p))
        return [(index, groups[index], [p for _, p in sorted(found[index], key=_first)]) for index in sorted(found)]

    def param_index(self, param: Tensor) -> int:
        """``param``'s index in the optimizer (as state_dict numbers it), for messages; -1 if no group holds it."""
        index = 0
        for group in self.groups:
            for p in group["params"]:
                if p is param:
                    return index
                index += 1
        return -1

    # --- checks -----------------------------------------------------------------------------------------

    def check_groups(self) -> None:
        """Every group's hyper-parameters and storage settings, as a step checks them, and the states in place
        where they changed since the last check (release checks all as a backward starts, before its first
        bucket steps)."""
        for group in self.groups:
            self.rule.validate(group)
            self.check_storage(group)
        if self.states_checked == self.state.version:
            return
        first = 0
        for group in self.groups:
            buckets.check_states(self.rule.for_group(group), group, self.state, self.state_format, first)
            self._check_rounding_states(group["params"])
            first += len(group["params"])
        self.states_checked = self.state.version

    def check_storage(self, group: dict) -> None:
        """A group's storage settings, as given or as edited by hand, before anything is made with them."""
        bits, min_quant_size, rounding = self.settings.storage_of(group)
        storage.check_state_bits(bits, "state_bits of a param group")
        storage.check_min_quant_size(min_quant_size)
        storage.rounding.check_rounding(rounding)
        if self.settings.flat and rounding != "nearest":
            raise ValueError("flat=True rounds to nearest; a param group's rounding must be 'nearest'")
        if rounding == "stochastic" and any(p.dtype == torch.float16 for p in group.get("params", ())):
            raise ValueError("rounding='stochastic' rounds fp32 to bf16 params; this group has fp16 params: "
                             "use rounding='kahan' for them")
        if rounding != "nearest" and any(p.dtype == torch.complex32 for p in group.get("params", ())):
            raise ValueError(f"rounding={rounding!r} takes real bf16/fp16 params; this group has complex32 params: "
                             "use rounding='nearest' for them")
        quantized = storage.codecs.for_bits(bits).quantized
        why = self.rule.for_group(group).refuses_quantized_state(group) if quantized else None
        if why:
            raise ValueError(f"{self.name} with state_bits={bits}: {why}")

    def _check_rounding_states(self, params: list[Tensor]) -> None:
        """The rounding's own state, as a user may have put it in: checked before anything runs."""
        for p in params:
            for name in storage.rounding.ROUNDING_STATES:
                value = self.state[p].get(name) if p in self.state else None
                why = None if value is None else storage.rounding.check_rounding_state(name, value, p)
                if why:
                    raise ValueError(f"state {name!r} of param {self.param_index(p)} {why}")

    def _check_flat_group(self, index: int, group: dict) -> None:
        """Flat buffers belong to the group they were made for: a group list edited by hand (a group popped or its
        params changed) would step another group's buffers. Checked when a plan is made (a reused plan has the
        very params it was made with)."""
        buckets = self.flat_buckets[index] if index < len(self.flat_buckets) else []
        owned = [p for bucket in buckets for p in bucket.params]
        params = group["params"]
        if len(owned) != len(params) or not {id(p) for p in owned} == {id(p) for p in params}:
            raise ValueError(f"flat=True: param group {index} no longer holds the params its flat buffers were "
                             "made for (param_groups edited by hand); make a new optimizer for the new groups")

    # --- state ------------------------------------------------------------------------------------------

    def state_format(self, p: Tensor, name: str, group: dict) -> storage.Format:
        """How a state of ``p`` is kept: the group's ``state_bits`` (the optimizer's by default)."""
        bits, min_quant_size, _ = self.settings.storage_of(group)
        rule = self.rule.for_group(group)
        if rule.state_shape(name, p) != tuple(p.shape):  # factored states are small: kept plain
            return storage.Format(32)
        return storage.format_for(p, name, bits, min_quant_size, rule.unsigned_states)

    def init_state(self, p: Tensor, group: dict) -> dict:
        """``p``'s state, made at its initial values where it has none (a rule whose state exists before a step)."""
        state = self.state[p]
        rule = self.rule.for_group(group)
        if not state:
            if rule.exports_step:
                state["step"] = 0
            for name, needed in zip(rule.state_names, rule.active(group)):
                if needed and rule.state_shape(name, p) is not None:
                    state[name] = buckets.new_state(rule, p, name, group, self.state_format(p, name, group))
        return state

    # --- groups -----------------------------------------------------------------------------------------

    def admit(self, candidate: dict, tensors: list) -> list[list[Tensor]] | None:
        """What a new group (``candidate``: its settings; ``tensors``: its params) must satisfy, checked before
        torch adds it, so a refused group leaves no trace. Returns flat mode's params by (device, dtype)."""
        self.check_storage(candidate)
        rule = self.rule.for_group(candidate)
        params = [p for p in tensors if isinstance(p, Tensor)]  # (torch refuses the others, with its own message)
        for p in params:
            why = rule.check_param(p, candidate)
            if why:
                raise ValueError(why)
        for p in params:  # a per-tensor stage on sharded params gathers each whole param-shaped tensor, only those
            if rule.stages and is_dtensor(p) and sharded.shard_dim0(p):
                for n in rule.state_names:
                    shape = rule.state_shape(n, p)
                    if shape not in (None, tuple(p.shape)):
                        raise NotImplementedError(
                            f"{self.name} keeps state {n!r} of shape {shape} for a sharded (DTensor) param of "
                            f"shape {tuple(p.shape)}: its per-tensor step needs whole tensors, and only "
                            f"param-shaped ones are gathered from the shards; step this param unsharded")
        if not self.settings.flat:
            return None
        if any(rule.state_shape(n, p) not in (None, tuple(p.shape)) for n in rule.state_names for p in params):
            raise ValueError(f"flat=True keeps each state as a view of one buffer shaped like the params; "
                             f"{self.name} keeps factored states of other shapes: use flat=False")
        by_key: dict[tuple, list[Tensor]] = {}
        for p in params:
            by_key.setdefault((p.device, p.dtype), []).append(p)
        for ps in by_key.values():
            FlatBucket.check(ps)
        return list(by_key.values())

    def added(self, group: dict, flat: list[list[Tensor]] | None) -> None:
        """After torch added ``group``: its flat buffers (``flat``: from ``admit``), and any state made up front."""
        if flat is not None:
            bits, min_quant_size, _ = self.settings.storage_of(group)

            def kept_apart(p):  # a state not kept as one tensor is no view of a flat buffer (``buckets._build_flat``)
                fmt = storage.format_for(p, "", bits, min_quant_size, frozenset())
                return storage.codecs.of(fmt).tensor_dtype(p.dtype) is None
            self.flat_buckets.append([FlatBucket(ps, first=kept_apart) for ps in flat])
        if self.rule.for_group(group).eager_state:
            for p in group["params"]:
                self.init_state(p, group)

    def zero_grads(self, set_to_none: bool) -> None:
        """Flat mode's grad buffers: their grads None, or each buffer zeroed with one memset."""
        for buckets in self.flat_buckets:
            for bucket in buckets:
                bucket.zero_grads(set_to_none)

    def scales_in_kernel(self) -> bool:
        """GradScaler's question (``engine.amp``)."""
        return amp.scales_in_kernel(impl=self.settings.impl, rule=self.rule, groups=self.groups,
                                    settings=self.settings)

    def caches(self) -> dict[tuple, dict]:
        """The paths' per-bucket caches of the current plans, by (plan key, bucket index)."""
        return {(k, b): bucket.cache for k, p in self.plans.items() for b, bucket in enumerate(p.buckets)}


def _holds(groups: list[dict], place: tuple[int, int], p: Tensor) -> bool:
    index, position = place
    return index < len(groups) and position < len(groups[index]["params"]) and groups[index]["params"][position] is p


def _first(item: tuple) -> int:
    return item[0]
