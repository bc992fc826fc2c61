"""The step plan: which params step together, on which state tensors, at which step count.

A step hands each *bucket* (params of one device, dtype and step count) to the dispatcher. Working the buckets
out costs Python work per param, so a group's plan is kept from one step to the next and reused while
nothing it was built from has changed. This module owns that cache and the step counters.

What a plan caches (one per param group):
  * the params that had a grad, in the order the group lists them, and their buckets;
  * per bucket: the params' state dicts and state tensors (in flat mode, the flat buffers that every
    param's state is a view of), its step count, and the paths' own cache (a kernel's table);
  * the state mapping it was built from, and that mapping's ``version``.

What makes it stale, checked at every step before anything runs:
  * another list of params with grads (compared by identity), another set of active states, or other
    storage settings (``state_bits``, ``min_quant_size``: the optimizer puts them into ``Plan.active``);
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
from typing import Any

import torch
from torch import Tensor

from .. import storage
from ..native import bulk
from .flat import FlatBucket, same_layout
from ..storage.state import is_dtensor
from .state_map import StateDict, StateMap, as_state_map, quiet_set  # noqa: F401 (optimizer.state, counting)


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
        return [_local_real(g) for g in grads] if self.convert else grads


@dataclass
class Plan:
    """One param group's buckets, and what they were built from."""
    params: list[Tensor]
    active: tuple                      # the group's settings its buckets follow from (active states, storage)
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
            return all(fb.intact() for fb in self.flat) and (not self.watched or bulk.layouts(self.watched)
                                                              == self.layouts)
        return bulk.layouts(self.watched) == self.layouts

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
            self.watched = (([] if self.flat is not None else list(self.params))
                            + _stored_states(self.buckets, self.plain_watched))
            self.layouts = bulk.layouts(self.watched)
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


def _host(plan: Plan, rule, group: dict, p: Tensor, state: dict | None) -> tuple:
    """A param's ``rule.host_states`` (checked); those it has none of yet wait in ``plan.pending``."""
    if not rule.host_states:
        return ()
    values = rule.host_values(state, group)
    missing = tuple(name for name in rule.host_states if state is None or name not in state)
    for name, value in zip(rule.host_states, values):
        if name in missing:
            plan.pending.append((p, name, value, None))
    if missing:
        plan.created[id(p)] = plan.created.get(id(p), ()) + missing
    return values


def _local_real(t: Tensor) -> Tensor:
    if isinstance(t, storage.QuantizedState):
        return t.local()
    if is_dtensor(t):
        t = t.to_local()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t


def _count(state: dict | None, exports_step: bool) -> int:
    """The step count a param is at: its ``"step"`` (0 without one) where torch keeps a counter; else 1 for a
    param with state (past its first step) and 0 for one without."""
    if not exports_step:
        return 0 if not state else 1
    step = 0 if state is None else state.get("step", 0)
    if isinstance(step, Tensor):
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not float(step).is_integer() or step < 0:
        raise ValueError(f"state 'step' must be a whole number >= 0, got {step!r}")
    return int(step)


def _check_state_tensor(value: Any, p: Tensor, name: str, index: int, shape: tuple | None = None) -> None:
    """A state tensor the paths can run on: the param's dtype and device, and its shape (or ``shape``)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"state {name!r} of param {index} must be a tensor, got {type(value).__name__}")
    shape = tuple(p.shape) if shape is None else shape
    if tuple(value.shape) != shape or value.dtype != p.dtype or value.device != p.device:
        raise ValueError(f"state {name!r} of param {index} has shape {tuple(value.shape)}, dtype {value.dtype}, "
                         f"device {value.device}; it must have shape {shape}, dtype {p.dtype}, device {p.device} "
                         f"(the param has shape {tuple(p.shape)})")


def new_state(rule, p: Tensor, name: str, group: dict, fmt: storage.Format):
    """A new state ``name`` of ``p`` at its initial value, in ``fmt`` (a factored one plain, of its own shape)."""
    shape = rule.state_shape(name, p)
    if shape != tuple(p.shape):
        return torch.full(shape, rule.initial_value(name, group), dtype=p.dtype, device=p.device)
    return storage.make(p, fmt, rule.initial_value(name, group))


def _adopt(value: Any, p: Tensor, fmt: storage.Format, name: str, index: int, shape: tuple | None = None):
    """A state found in the param's dict, in the format it is kept in: plain ones must fit the param as
    they are; a plain tensor found where another format is kept is converted (a torch.optim checkpoint), and
    so is a bf16 (16-bit) or quantized one where the state is now plain (``state_bits`` edited)."""
    kept_at_16 = isinstance(value, Tensor) and value.dtype == torch.bfloat16 != p.dtype and p.is_floating_point()
    if shape is not None and shape != tuple(p.shape):  # a factored state: plain, of its own shape
        _check_state_tensor(value, p, name, index, shape)
        return value
    if fmt.plain and not isinstance(value, storage.QuantizedState) and not kept_at_16:
        _check_state_tensor(value, p, name, index)
        return value
    try:
        return storage.adopt(value, p, fmt)
    except (TypeError, ValueError) as e:
        raise type(e)(f"state {name!r} of param {index} {e}") from None


def check_states(rule, group: dict, state_map: StateMap, state_format, first_index: int) -> None:
    """What ``build`` refuses of the states already in the group's params' dicts, refused without building or
    changing anything (release checks every group so before a backward's first bucket steps). ``first_index``:
    the optimizer index of the group's first param."""
    active = rule.active(group)
    for index, p in enumerate(group["params"], first_index):
        state = state_map.get(p)
        if not state:
            continue
        for name, on in zip(rule.state_names, active):
            value = state.get(name) if on else None
            shape = None if value is None else rule.state_shape(name, p)
            if shape is not None:
                _adopt(value, p, state_format(p, name, group), name, index, shape)


def _param_states(plan: Plan, p: Tensor, state: dict | None, names: list[str], exports_step: bool,
                  make, param_index) -> tuple[list[Tensor], int]:
    """One param's state tensors for this step and its count. ``make(name, value)`` gives the tensor the
    step runs on and what goes into it at commit (a fill value, a tensor to copy, or None); new ones, and
    existing ones replaced (converted, or copied into a flat view), wait in ``plan.pending``, as does a
    first ``step`` entry."""
    if state is not None and not plan.state_map.tracks(state):
        plan.reusable = False  # a dict of the user's own: its changes are not counted
    tensors, created = [], []
    for name in names:
        value = None if state is None else state.get(name)
        target, fill = make(name, value)
        if value is None:
            created.append(name)
            plan.pending.append((p, name, target, fill))
        elif target is not value:  # converted to its format, or (flat mode) copied into its view
            plan.pending.append((p, name, target, fill))
            plan.replaced.setdefault(id(p), {})[name] = (value, target)
        tensors.append(target)
    count = 0 if created and not exports_step else _count(state, exports_step)
    if exports_step and (state is None or "step" not in state):
        plan.pending.append((p, "step", 0, None))
        created.append("step")
    if created:
        plan.created[id(p)] = tuple(created)
    return tensors, count


def build(*, rule, group: dict, params: list[Tensor], state_map: StateMap, state_format, param_index,
          flat_buckets: list[FlatBucket] | None) -> Plan:
    """Work out the buckets of one group from scratch. Validates every state it will use and changes
    nothing: new states and copies into flat buffers wait in ``plan.pending`` until ``commit``.

    ``state_format(p, name, group)`` says how a state is kept (``storage``); ``param_index(p)`` numbers
    params in error messages. In flat mode too ``params`` are the group's params whose grad is not None.
    """
    for p in params:  # what torch.optim refuses at its step (in flat mode only params with a grad, as torch)
        why = rule.check_stepped_param(p, group) if flat_buckets is None or p.grad is not None else None
        if why:
            raise RuntimeError(why)
    active = rule.active(group)
    names = [n for n, on in zip(rule.state_names, active) if on]
    plan = Plan(list(params), active, state_map, state_map.version)
    if flat_buckets is not None:
        plan.flat = flat_buckets
        positions = {id(p): i for i, p in enumerate(params)}
        for fb in flat_buckets:
            _build_flat(plan, rule, group, fb, names, positions, state_format, param_index)
        return plan
    buckets: dict[tuple, PlanBucket] = {}
    for position, p in enumerate(params):
        held = tuple(on and rule.state_shape(name, p) is not None for name, on in zip(rule.state_names, active))
        formats = {name: state_format(p, name, group) for name, on in zip(rule.state_names, held) if on}

        def make(name, value, p=p, formats=formats):
            if value is None:
                return new_state(rule, p, name, group, formats[name]), None
            return _adopt(value, p, formats[name], name, param_index(p), rule.state_shape(name, p)), None
        tensors, count = _param_states(plan, p, state_map.get(p), [n for n, on in zip(rule.state_names, held) if on],
                                       rule.exports_step, make, param_index)
        host = _host(plan, rule, group, p, state_map.get(p))
        owner = p
        convert = is_dtensor(p) or p.is_complex()
        if convert:  # views made anew every step: such a group is planned afresh every step
            plan.reusable = False
            p, tensors = _local_real(p), [_local_real(t) for t in tensors]
        # (a complex param's real view has a real dtype: ``convert`` keeps it apart from real params of that dtype,
        # as its grad needs the same view and a plain param's must stay as it is)
        # (the states' formats decide the bucket's path: params kept alike step together, and no path splits them)
        key = (p.device, p.dtype, count, host, held, convert, tuple(formats.values()))
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = PlanBucket(key[:2], count, [], [[] if on else None for on in held], [], [],
                                               convert=convert, host=host)
        bucket.params.append(p)
        bucket.owners.append(owner)
        bucket.positions.append(position)
        it = iter(tensors)
        for lst in bucket.states:
            if lst is not None:
                lst.append(next(it))
    plan.buckets = list(buckets.values())
    if len(plan.buckets) == 1:
        plan.buckets[0].positions = None
    return plan


def _build_flat(plan: Plan, rule, group: dict, fb: FlatBucket, names: list[str], positions: dict,
                state_format, param_index) -> None:
    """Flat mode: a state is a view of the bucket's buffer for that state, which holds the params from the
    first one whose states are plain or 16-bit on (``FlatBucket`` puts the params with quantized states
    first); the params before it keep states of their own, as without flat mode. A missing state starts at
    its initial value; one the user replaced (or a checkpoint loaded) is copied into its view, or converted.
    Only the params in ``positions`` (grad not None) step: where some do not, the others step on their aliases."""
    fb.realias()  # (new alias objects for any whose memory moved: a state on moved memory is then copied back)
    replaced = [i for i, (p, view) in enumerate(zip(fb.params, fb.param_views))
                if not same_layout(p, view)]
    for i in replaced:  # p.data = ... or p.t_() since the last step: the values go into the buffer (at commit)
        p, view = fb.params[i], fb.param_views[i]
        if p.shape != view.shape or p.dtype != view.dtype or p.device != view.device:
            raise ValueError(f"param {param_index(p)} was given data of shape {tuple(p.shape)}, dtype {p.dtype}, "
                             f"device {p.device}; flat=True keeps it in a buffer of shape {tuple(view.shape)}, "
                             f"dtype {view.dtype}, device {view.device}: make a new optimizer for the new layout")
    if replaced:
        plan.rehome.append(fb)
    formats = {name: [state_format(p, name, group) for p in fb.params] for name in names}
    # a state kept as one tensor (its codec's ``tensor_dtype``) can be a view of a flat buffer; one kept as
    # several (a quantized state's codes and absmax) keeps its param before the buffers, its tensors pooled
    dtypes = {name: [storage.codecs.of(f).tensor_dtype(fb.dtype) for f in fs] for name, fs in formats.items()}
    apart = [any(dtypes[n][i] is None for n in names) for i in range(len(fb.params))]
    start = max((i + 1 for i, a in enumerate(apart) if a), default=0)  # the flat buffers' first param
    views = {n: fb.state_views(n, start, dtypes[n][-1]) for n in names} if start < len(fb.params) else {}
    pools = {n: fb.pooled_states(n, [f if d is None else None for f, d in zip(formats[n][:start], dtypes[n])])
             for n in names}
    fills = {name: rule.initial_value(name, group) for name in names}
    members = [i for i, p in enumerate(fb.params) if id(p) in positions]
    counts, tensors = {}, {}
    for i, p in ((i, fb.params[i]) for i in members):
        def make(name, value, i=i, p=p):
            adopted = None if value is None else _adopt(value, p, formats[name][i], name, param_index(p))
            if i < start and pools[name][i] is None:  # kept apart, as without flat mode
                return (storage.make(p, formats[name][i], fills[name]) if value is None else adopted), None
            view = pools[name][i] if i < start else views[name][i]  # a quantized state's pooled codes and absmax
            return view, (fills[name] if value is None else None if value is view else adopted)
        ts, count = _param_states(plan, p, plan.state_map.get(p), names, rule.exports_step, make, param_index)
        counts[i] = (count, _host(plan, rule, group, p, plan.state_map.get(p)))
        tensors[i] = ts

    column = {name: k for k, name in enumerate(names)}

    def states(members: list[int]) -> list[list | None]:
        return [[tensors[i][column[n]] for i in members] if n in column else None for n in rule.state_names]

    if len(members) == len(fb.params) and len(set(counts.values())) == 1 and not rule.stages:  # the usual case: one pass over each flat buffer (and one kernel call for the rest)
        count, host = counts[0]
        if start:
            plan.buckets.append(PlanBucket((fb.device, fb.dtype), count, list(fb.params[:start]),
                                           states(list(range(start))), list(fb.params[:start]), None, host=host,
                                           head=fb))
        if start < len(fb.params):
            off = fb.offset(start)
            buffers = [[fb.state_buffers[n]] if n in views else None for n in rule.state_names]
            plan.buckets.append(PlanBucket((fb.device, fb.dtype), count, [fb.param_buffer[off:]], buffers,
                                           list(fb.params[start:]), None, flat_grad=fb.grad_buffer[off:], host=host))
        return
    # some params without a grad, params at different counts (a reset state, a partial checkpoint), or a rule with
    # per-tensor stages (they need each param's shape): per param, on the aliases
    by_count: dict[tuple, list[int]] = {}
    for i, c in counts.items():
        by_count.setdefault(c, []).append(i)
    for (c, host), members in by_count.items():
        owners = [fb.params[i] for i in members]
        plan.buckets.append(PlanBucket((fb.device, fb.dtype), c, owners, states(members), owners,
                                       [positions[id(p)] for p in owners], host=host))
