"""The step plan: which params step together, on which state tensors, at which step count.

A step hands each *bucket* (params of one device, dtype, step count and state formats: ``buckets`` builds them)
to the dispatcher. Working the buckets out costs Python work per param, so a group's plan is kept from one step
to the next and reused while nothing it was built from has changed. This module owns that cache and the step
counters.

What a plan caches (one per param group):
  * the params that had a grad, in the order the group lists them, and their buckets;
  * per bucket: the params' state dicts and state tensors (in flat mode, the flat buffers that every
    param's state is a view of), its step count, and the paths' own cache (a kernel's table);
  * the state mapping it was built from, and that mapping's ``version``.

What makes it stale, checked at every step before anything runs:
  * another list of params with grads (compared by identity), another set of active states, or other
    storage settings (``state_bits``, ``min_quant_size``: the stepper puts them into ``Plan.active``), or other
    values of the settings its params were checked against (``Rule.planned_settings``: Muon's ``split``);
  * a param's data moved or re-laid (``p.data = ...``, ``p.t_()``, a resize: address, strides or shape; in flat
    mode, a param's data no longer the very view of its buffer that the plan made);
  * a stored (16/8/4-bit) state's tensor moved in place (``share_memory_()``): a kernel's table keeps their
    addresses (flat mode's pooled states are watched by their pools, which move whole);
  * ``optimizer.state`` replaced by another mapping;
  * any change made through the mapping or a per-param dict: a cleared or deleted state, a state tensor
    added, removed or replaced, a step count written. ``StateMap`` and its ``StateDict`` values count
    every such change in ``StateMap.version`` (``state_map``); only the step's own bookkeeping writes past
    the count. Code that walks ``optimizer.state`` to move it puts moved copies in, which counts; a
    ``QuantizedState`` a plan holds refuses its fields reassigned (``storage.state``);
  * a step the kernels skipped by themselves (GradScaler found inf), when it is taken back;
  * sharded (DTensor) or complex params: their local or real views are made anew every step, so such a
    group is planned afresh every step.
Never cached: grads (new tensors every step), hyper-parameters (read every step), tensor contents.
Not seen: a state tensor re-laid in place (``state["exp_avg"].t_()``): assign a new tensor instead.

Step counters. For the rules torch keeps a counter for (``rule.exports_step``) the count is the
``"step"`` entry of the param's state dict, a Python int (no tensor ops, no syncs); ``state_dict()``
writes it as torch does. For SGD and Lion torch keeps none: as in torch, a param whose state lacks the
rule's tensors is at its first step. A rule's ``host_states`` (NAdam's ``mu_product``) are kept the same way,
host floats moved by ``advance``; params step together only where they hold the same values.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import storage
from ..native import bulk
from .flat import FlatBucket
from ..storage.state import is_dtensor
from .state_map import StateMap, quiet_set


# --- plans ------------------------------------------------------------------------------------------------

@dataclass
class PlanBucket:
    key: tuple                         # (device, dtype)
    step: int                          # the count its params are at before the next step
    params: list[Tensor]               # what the paths run on (a flat buffer, local or real views)
    states: list[list[Tensor] | None]  # per rule.state_names, None where inactive
    owners: list[Tensor]               # the user's params whose state this bucket steps
    positions: list[int] | None        # where its params sit among the group's params with grads; None: all
    flat_grad: Tensor | None = None    # flat mode: the bucket is one buffer (or its tail) per tensor role
    head: FlatBucket | None = None     # flat mode: the bucket is the params kept apart at the buffer's head
    convert: bool = False              # grads need the same view as params (DTensor local, complex real)
    dicts: list = field(default_factory=list)  # the owners' state dicts (None: no state), set at commit
    cache: dict = field(default_factory=dict)  # the paths' own (a kernel's tensor table)
    staged: bool | None = None         # some state is not plain (``paths.staged``); None: not yet known
    host: tuple = ()                   # the rule's ``host_states`` before the next step, the same for every param
    host_before: tuple = ()            # ... and before the step being run (what ``rule.scalars`` gets)

    def grads(self, group_grads: list[Tensor] | None) -> list[Tensor]:
        """This step's grads for the bucket, from the group's (None in flat mode: the grads are views)."""
        if self.flat_grad is not None:
            return [self.flat_grad]
        if self.head is not None:  # the grad buffer's views, one list object while they stay the same
            return self.head.head_grads(len(self.owners))
        if group_grads is None:
            return [p.grad for p in self.owners]
        grads = group_grads if self.positions is None else [group_grads[i] for i in self.positions]
        return [local_real(g) for g in grads] if self.convert else grads


@dataclass
class Plan:
    """One param group's buckets, and what they were built from."""
    params: list[Tensor]
    active: tuple                      # the group's settings its buckets follow from (states, storage, checks)
    state_map: StateMap
    version: int
    buckets: list[PlanBucket] = field(default_factory=list)
    reusable: bool = True
    created: dict[int, tuple] = field(default_factory=dict)  # id(param) -> the state entries the step makes
    replaced: dict[int, dict] = field(default_factory=dict)  # id(param) -> {name: (state found, what replaces it)}
    pending: list[tuple] = field(default_factory=list)       # (param, name, tensor, fill) put in at commit
    rehome: list[FlatBucket] = field(default_factory=list)   # flat buckets whose params' .data was replaced
    layouts: object = None                                   # the watched tensors' addresses, strides, shapes
    watched: list[Tensor] = field(default_factory=list)      # the params (not in flat mode) and stored states
    plain_watched: bool = False                              # plain states watched too (a group at 16/8/4 bits)
    flat: list[FlatBucket] | None = None                     # flat mode: the buckets whose views the params are

    def fits(self, params: list[Tensor], active: tuple, state_map: StateMap) -> bool:
        return (self.reusable and state_map is self.state_map and state_map.version == self.version
                and active == self.active and len(params) == len(self.params)
                and all(map(operator.is_, params, self.params))
                and self.same_layouts(params))

    def same_layouts(self, params: list[Tensor]) -> bool:
        """Each param's data, and each stored state, where and as it was at commit (one pass over both). In flat
        mode each param still is its view of the buffer: one pass against views the buffer keeps anyway (cheaper
        than reading each param's address and shape)."""
        if self.flat is not None:
            return all(fb.intact() for fb in self.flat) and (not self.watched or bulk.layouts(self.watched, False)
                                                              == self.layouts)
        return bulk.layouts(self.watched, len(params)) == self.layouts

    def commit(self) -> None:
        """Put the built states in place (building changed nothing, so a failed or skipped step leaves
        everything as it was), then remember the mapping's version."""
        state_map = self.state_map
        for fb in self.rehome:
            fb.rehome()
        self.rehome.clear()
        written = _written(self.pending)
        for found in self.replaced.values():  # a state found on memory this commit writes cannot be given back
            for name in [name for name, (value, _) in found.items() if written.intersection(_memory(value))]:
                del found[name]
        for p, name, value, fill in _unaliased(self.pending, written):
            state = state_map.get(p)
            if state is None:
                state = state_map.fresh_dict(p)
            if isinstance(fill, (Tensor, storage.QuantizedState)):
                value.copy_(fill)
            elif fill is not None:
                value.fill_(fill)
            quiet_set(state, name, value)
        self.pending.clear()
        for bucket in self.buckets:
            bucket.dicts = list(map(state_map.get, bucket.owners))
        self.version = state_map.version
        if self.reusable:
            # (the params' shapes and strides too; the states' addresses: a state is replaced, not re-laid)
            shaped = 0 if self.flat is not None else len(self.params)
            self.watched = ([] if self.flat is not None else list(self.params)) + _stored_states(self.buckets,
                                                                                                 self.plain_watched)
            self.layouts = bulk.layouts(self.watched, shaped)
        for fb in self.flat or ():
            fb.settle()

    def advance(self, rule, group: dict) -> list[tuple]:
        """Count one step for every bucket (and move the rule's ``host_states`` with it, from ``group``'s
        hyper-parameters of this step); returns what ``take_back`` needs if the kernels skip it."""
        created, self.created = self.created, {}
        replaced, self.replaced = self.replaced, {}
        names = rule.host_states
        counted: dict[int, list] = {}  # new count -> the state dicts at it (one pass for buckets at one count)
        for bucket in self.buckets:  # set with dict.__setitem__: the plan's own bookkeeping, not a change
            bucket.step = step = bucket.step + 1
            if rule.exports_step:
                counted.setdefault(step, []).extend(bucket.dicts)
            if names:
                bucket.host_before = bucket.host
                bucket.host = rule.host_step(group, step, bucket.host)
                for name, value in zip(names, bucket.host):
                    bulk.set_each(bucket.dicts, name, value)
        for step, dicts in counted.items():
            bulk.set_each(dicts, "step", step)
        return [(bucket.owners, bucket.dicts, created, replaced, dict(zip(names, bucket.host_before)),
                 rule.exports_step) for bucket in self.buckets]


def _stored_states(buckets: list[PlanBucket], plain: bool) -> list[Tensor]:
    """The tensors of the buckets' stored (not plain) states, a kernel may keep the addresses of, and where
    ``plain`` the plain ones too (a plain state re-typed in place, ``s.data = s.data.bfloat16()``, would reach a
    path that takes plain states only); states on a flat buffer's pool move together, so one of them is watched
    (a user's own states may share a storage and one of them be re-pointed: each is watched)."""
    found = {}
    for b in buckets:
        pooled = {t.untyped_storage()._cdata for t in (b.head.pool_buffers() if b.head is not None else ())}
        for column in b.states:
            for s, p in zip(column or (), b.params):
                if not plain and storage.is_plain(s, p):
                    continue
                for t in s.tensors() if isinstance(s, storage.QuantizedState) else (s,):
                    key = t.untyped_storage()._cdata
                    found.setdefault(("pool", key) if key in pooled else ("own", id(t)), t)
    return list(found.values())


def _memory(x: Tensor | storage.QuantizedState) -> list[int]:
    return [t.untyped_storage()._cdata for t in (x.tensors() if isinstance(x, storage.QuantizedState) else (x,))]


def _written(pending: list[tuple]) -> set[int]:
    """The storages that committing ``pending`` writes (by a copy or a fill)."""
    return {m for _, _, value, fill in pending if fill is not None
            and isinstance(value, (Tensor, storage.QuantizedState)) for m in _memory(value)}


def _unaliased(pending: list[tuple], written: set[int]) -> list[tuple]:
    """``pending`` with each value to copy that lies on memory some entry writes (by a copy or a fill) taken first:
    in flat mode one param's state given another's and the other's deleted (its fill would zero what the copy
    reads), views swapped (the first copy would overwrite what the second reads), or a state given its own
    view re-laid (``s["exp_avg"] = s["exp_avg"].t()``: a copy onto itself)."""
    copied = [i for i, entry in enumerate(pending) if isinstance(entry[3], (Tensor, storage.QuantizedState))]
    if not copied:
        return pending
    pending = list(pending)
    for i in copied:
        p, name, value, fill = pending[i]
        if written.intersection(_memory(fill)):
            fill = fill.clone()
            pending[i] = (p, name, value, fill)
    return pending


def take_back(state_map: StateMap, taken: list) -> None:
    """A step the kernels skipped: counters go back one; the states the step created go away and those it
    converted (a tensor the user put in, kept at 16/8/4 bits or copied into flat mode's buffers) are the user's
    again, as if it never ran (torch.optim has no state for a param before its first step). A tensor put in
    that lay on memory the step wrote (flat mode's views swapped between params) is not given back: the state
    it was copied into holds its values."""
    for owners, dicts, created, replaced, host_before, exports_step in taken:
        for p, state in zip(owners, dicts):
            if state is None:
                continue
            made = created.get(id(p), ())
            for name in made:
                state.pop(name, None)
            for name, (value, converted) in replaced.get(id(p), {}).items():
                if dict.get(state, name) is converted:  # (not where the user put another since)
                    state[name] = value
            if exports_step and "step" not in made:
                state["step"] = state["step"] - 1
            for name, value in host_before.items():
                if name not in made:
                    state[name] = value
            if not state and state_map.get(p) is state:
                del state_map[p]


def local_real(t: Tensor) -> Tensor:
    if isinstance(t, storage.QuantizedState):
        return t.local()
    if is_dtensor(t):
        t = t.to_local()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t
