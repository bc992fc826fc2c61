"""Building a group's plan (``plan.Plan``): which params step together, on which state tensors.

Params step together where they share a device, dtype, step count, host states (``rule.host_states``), the states
they hold and those states' formats: the formats decide a bucket's path, so no path splits a bucket by them. Each
state found in a param's dict is checked and adopted in the format it is kept in (a torch.optim tensor converted,
a user's tensor copied into its flat view); new states, conversions and first step counts wait in the plan until
``Plan.commit``, so building changes nothing and a refused step leaves everything as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import storage
from ..storage.state import is_dtensor
from .flat import FlatBucket, same_layout
from .plan import Plan, PlanBucket, local_real
from .state_map import StateMap


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
            p, tensors = local_real(p), [local_real(t) for t in tensors]
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
