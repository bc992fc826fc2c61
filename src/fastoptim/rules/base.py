"""The rule contract: one optimizer's math, written once, independent of how it runs.

A rule supplies
  * ``defaults``      torch.optim's hyper-parameter names and default values;
  * ``state_names``   torch.optim's state names, in torch's order (``step`` excluded);
  * ``validate``      raises ``ValueError`` naming the bad hyper-parameter;
  * ``active``        which of ``state_names`` a group needs (e.g. ``max_exp_avg_sq`` only with amsgrad);
  * ``named_flags``   booleans fixed for a run (branch conditions inside ``update``), by name;
  * ``named_scalars`` host-side numbers for one step (bias corrections, step size, ``1 - lr*wd``, the value of a
                      hyper-parameter that is a function of the step), by name;
  * ``host_states``   torch's per-param 0-d states (NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``), kept as host
                      floats and moved by ``host_step``; ``scalars`` gets their values before the step;
  * ``update``        the elementwise math: ``update(p, g, *states, *scalars, *FLAGS) -> (p, *states)``.

A rule that is not elementwise (Muon's Newton-Schulz, Adafactor's row and column factors) gives ``stages``
instead of ``update``: a short pipeline of ``Elementwise`` stages (the contract above, over named tensors) and
``PerTensor`` stages (torch ops on a batch of same-shape tensors: matrix products, reductions over a tensor's
own dims). The levels run each stage's one source: elementwise stages as they run ``update``, per-tensor stages
one tensor at a time (loop) or batched over each shape group (the other levels). ``scratch`` names the
temporaries the stages pass between them (param-shaped, made per step). A rule may hand a param group to
another rule (``for_group``: Muon's AdamW groups).

The names are ``update``'s own parameter names: after ``p``, ``g`` and the states come its scalars, then its
FLAGS (in capitals). ``scalar_names``/``flag_names`` are read from that signature when the rule class is defined;
``register`` then calls ``named_scalars``/``named_flags`` on the defaults and every option set and refuses, at
import, a rule whose names differ. The levels get positional tuples in that order from ``scalars()`` and
``flags()``, which the base class derives: no rule writes an order by hand.

What the rest of the package derives from a rule (the public class and its signature and docstring, exports,
``create()``, CLI choices, the curves' settings, the test matrix) is declared beside it in ``declared.Declared``,
which ``Rule`` extends: ``class_name``, ``signature``, ``oracle``, ``option_sets``, ``takes``, ``curves_options``
and the tests' hints.

``update`` receives every state in ``state_names`` order, ``None`` for the inactive ones, and returns them
in the same order (inactive ones passed through). It uses arithmetic operators and ``prims`` only, on
tensors, itself or through the helpers of ``common`` (math several rules share, kept to the same contract):
arithmetic among scalars alone (``1 - beta1``) belongs in ``scalars``, done once in double precision on the host
as torch.optim does, so every level rounds the same numbers.
"""

from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from .declared import Declared


@dataclass(frozen=True)
class Elementwise:
    """``update(p, g, *tensors, *scalars, *FLAGS) -> (p, *tensors)``, the elementwise contract, over the states
    and scratch tensors named in ``tensors`` (in that order)."""
    update: Callable[..., tuple]
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class PerTensor:
    """``fn(*reads, *scalars, *FLAGS) -> writes``: torch ops on a batch, each argument ``n`` same-shape tensors
    stacked on a new leading dim (``n = 1`` on the loop level), so the math reduces and multiplies over dims 1
    and up only. ``reads`` and ``writes`` name "param", "grad", states and scratch tensors; an inactive state
    comes as None. ``fn`` never writes into its arguments (they may be the user's tensors); it may write in place
    into temporaries it made itself.

    ``in_place``: ``fn`` writes each of ``writes`` (all of them among ``reads``) into its argument, in place, as
    torch.optim's own loops do, and returns None; no other argument is written. An argument may then be the
    target itself (a view of it), so the new values need no pass of their own to get there.

    ``flat``: ``fn``'s result for a tensor does not depend on its shape (LAMB's norms over the whole tensor), so
    ``fn`` may get each tensor as a vector, the batch shaped (n, numel): the compiled level passes it so, and
    compiles one graph for every rank. Leave it False where the math reads a tensor's own dims (Adafactor's row
    and column factors, Muon's matrices); tests/paths/test_compiled_graphs.py checks every stage declared flat.

    ``local_rows(shape, flags)``: True where ``fn``, on a param of global ``shape`` (and its param-shaped
    states) under the rule's FLAGS ``flags`` (positional, in ``flag_names`` order), works slice by slice along
    dim 0: given any run of whole dim-0 slices alone, it gives what it gives on them within the whole tensor (a
    stack of matrices each stepped on its own: an (E, M, N) param is E matrices). A rank holding such a tensor's
    rows (FSDP2's Shard(0)) then runs the stage on them, with no gather (``paths.sharded``). None: never, the
    stage needs each whole tensor. tests/engine/test_distributed.py checks every stage that declares it."""
    fn: Callable[..., tuple | None]
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    in_place: bool = False
    flat: bool = False
    local_rows: Callable[[tuple, tuple], bool] | None = None

    def __post_init__(self):
        if self.in_place and not set(self.writes) <= set(self.reads):
            raise ValueError(f"an in-place stage writes into what it reads: {self.writes} not all in {self.reads}")


class Rule(Declared):
    name: ClassVar[str]
    defaults: ClassVar[dict[str, Any]]
    state_names: ClassVar[tuple[str, ...]]
    # torch.optim keeps a ``step`` entry in this optimizer's per-param state
    exports_step: ClassVar[bool] = True
    # torch.optim creates this optimizer's state in __init__, not on the first step
    eager_state: ClassVar[bool] = False
    # states that are never negative (second moments, sums of squares): kept with unsigned maps at 8/4 bits
    unsigned_states: ClassVar[frozenset] = frozenset()
    update: ClassVar[Callable[..., tuple]]
    # torch.optim's per-param 0-d tensor states that hold one number moved by the step count and the
    # hyper-parameters alone (NAdam's mu_product): kept here as host floats in the param's state dict, as the step
    # count is, and written as torch's 0-d tensors by state_dict(). ``scalars`` gets their values before the step.
    host_states: ClassVar[tuple[str, ...]] = ()
    # not elementwise: the pipeline the levels run instead of ``update``, and the temporaries it passes along
    stages: ClassVar[tuple] = ()
    scratch: ClassVar[tuple[str, ...]] = ()
    # defaults every group gets that ``optimizer.defaults`` does not list (Muon's AdamW groups' betas: torch's
    # schedulers cycle ``betas`` where defaults list them, and Muon's ``momentum`` must be what they cycle)
    group_only: ClassVar[frozenset] = frozenset()
    # hyper-parameters ``state_dict()`` leaves out of each saved group (a function: torch.save would pickle it by
    # name, and torch.load(weights_only=True) refuses it); a loaded group keeps the loading optimizer's own value
    unsaved_hypers: ClassVar[frozenset] = frozenset()
    # read from ``update``'s (or the stages') signature when the class is defined: the order the levels pass
    scalar_names: ClassVar[tuple[str, ...]] = ()
    flag_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for method in ("scalars", "flags"):
            if method in vars(cls):
                raise TypeError(f"{cls.__name__} defines {method}(): define named_{method}() instead, a dict by "
                                "update()'s parameter names (the base class passes them in update()'s order)")
        if "update" in vars(cls) or "stages" in vars(cls) or "state_names" in vars(cls):
            cls.scalar_names, cls.flag_names = _update_names(cls)

    def for_group(self, group: dict) -> "Rule":
        """The rule whose math steps ``group`` (itself, but for rules that hand some groups to another)."""
        return self

    def check_param(self, p: Tensor, group: dict) -> str | None:
        """Why ``p`` cannot be stepped in ``group`` (None: it can); checked when the group is added."""
        return None

    def check_stepped_param(self, p: Tensor, group: dict) -> str | None:
        """Why ``p``, which has a grad, cannot be stepped in ``group`` (None: it can). For what torch.optim refuses
        only in its step: checked when a step is planned, before anything changes, and raised as RuntimeError."""
        return None

    def torch_group(self, group: dict) -> dict:
        """A saved param group as the torch.optim class takes it (``torch_state_dict``): the group itself, but for
        settings torch's class spells otherwise (Muon's constant coefficient schedules)."""
        return group

    def planned_settings(self, group: dict) -> tuple:
        """The group's settings that ``check_stepped_param`` reads (Muon's ``matrices`` and ``split``): a plan
        built under other values is built again, so a value set by hand since is checked before anything
        changes."""
        return ()

    def state_shape(self, name: str, p: Tensor) -> tuple | None:
        """The shape of state ``name`` of ``p`` (the param's, but for factored states), or None where ``p``
        keeps no such state (Adafactor's ``variance`` of a matrix). States of another shape than the param's
        are kept as plain tensors of its dtype: they are small."""
        return tuple(p.shape)

    def validate(self, group: dict) -> None:
        raise NotImplementedError

    def active(self, group: dict) -> tuple[bool, ...]:
        return (True,) * len(self.state_names)

    def named_flags(self, group: dict) -> dict[str, Any]:
        """This group's FLAGS, by ``update``'s parameter names."""
        raise NotImplementedError

    def flags(self, group: dict) -> tuple:
        """``named_flags`` in ``update``'s order: what the levels pass."""
        return _in_order(self.named_flags(group), self.flag_names, self, "named_flags")

    def bucket_flags(self, flags: tuple, dtype: torch.dtype) -> tuple:
        """``flags`` for a bucket of params stored in ``dtype`` (the math may see them upcast to fp32)."""
        return flags

    def named_scalars(self, group: dict, step: int, *host: float) -> dict[str, Any]:
        """This step's host scalars, by ``update``'s parameter names (``host``: the ``host_states`` before it)."""
        raise NotImplementedError

    def scalars(self, group: dict, step: int, *host: float) -> tuple:
        """``named_scalars`` in ``update``'s order: what the levels pass."""
        return _in_order(self.named_scalars(group, step, *host), self.scalar_names, self, "named_scalars")

    def initial_value(self, name: str, group: dict) -> float:
        return 0.0

    def host_start(self, group: dict) -> tuple[float, ...]:
        """``host_states`` of a param before its first step."""
        return ()

    def host_step(self, group: dict, step: int, values: tuple[float, ...]) -> tuple[float, ...]:
        """``host_states`` after step ``step`` from their ``values`` before it."""
        return values

    def host_values(self, state: dict | None, group: dict) -> tuple[float, ...]:
        """A param's ``host_states`` as floats: from its state dict (a torch checkpoint's 0-d tensors too), or
        where it has none yet, their values before a first step."""
        if not self.host_states:
            return ()
        start = self.host_start(group)
        out = []
        for name, first in zip(self.host_states, start):
            value = first if state is None or name not in state else state[name]
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"state {name!r} must hold one number, got a tensor of shape {tuple(value.shape)}")
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"state {name!r} must be a number, got {value!r}")
            out.append(float(value))
        return tuple(out)

    def refuses_quantized_state(self, group: dict) -> str | None:
        """Why this group's math cannot run on 8/4-bit state (None: it can)."""
        return None

    # torch's own fused kernel for the same math, where one exists: ``torch_fused(params, grads, states,
    # group, step, grad_scale, found_inf)`` with ``states`` per ``state_names`` (None when inactive) and
    # ``step`` this step's count. None: no such kernel.
    torch_fused: ClassVar[Callable[..., None] | None] = None


def _tail_names(fn: Callable, skip: int, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(scalars, FLAGS) of ``fn``'s parameters after its first ``skip`` (the tensors): the FLAGS in capitals,
    after every scalar."""
    names = [n for n in inspect.signature(fn).parameters][skip:]
    scalars = tuple(n for n in names if not n.isupper())
    flags = tuple(n for n in names if n.isupper())
    if names != list(scalars + flags):
        raise TypeError(f"{where}: its FLAGS (capitals) must follow its scalars, got {tuple(names)}")
    return scalars, flags


def _update_names(cls) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The scalars and flags ``cls``'s math takes, by name, in order; every stage must take the same."""
    if getattr(cls, "stages", ()):
        found = []
        for stage in cls.stages:
            skip = 2 + len(stage.tensors) if isinstance(stage, Elementwise) else len(stage.reads)
            fn = stage.update if isinstance(stage, Elementwise) else stage.fn
            found.append((fn.__name__, _tail_names(fn, skip, f"{cls.__name__} stage {fn.__name__}")))
        for name, names in found[1:]:
            if names != found[0][1]:
                raise TypeError(f"{cls.__name__}: stage {name} takes scalars and flags {names}, stage "
                                f"{found[0][0]} takes {found[0][1]}: every stage gets the same ones")
        return found[0][1]
    update = getattr(cls, "update", None)
    if update is None:
        return (), ()
    return _tail_names(update, 2 + len(cls.state_names), f"{cls.__name__}.update")


def _in_order(values: dict, names: tuple[str, ...], rule: Rule, method: str) -> tuple:
    try:
        ordered = tuple(values[n] for n in names)
    except KeyError as missing:
        raise TypeError(_mismatch(rule, method, values, names)) from missing
    if len(values) != len(names):
        raise TypeError(_mismatch(rule, method, values, names))
    return ordered


def _mismatch(rule: Rule, method: str, values: dict, names: tuple[str, ...]) -> str:
    given = tuple(values)
    extra = [n for n in given if n not in names]
    missing = [n for n in names if n not in given]
    return (f"{type(rule).__name__}.{method}() gives {given}, but its math takes {names}: "
            f"{'unknown ' + str(extra) if extra else ''}{'; ' if extra and missing else ''}"
            f"{'missing ' + str(missing) if missing else ''}")


# --- the registry of rules: each rule file registers its own; fastoptim.registry builds everything from it ----

RULES: dict[str, Rule] = {}


def check_declaration(rule: Rule) -> None:
    """Refuses a rule whose named scalars and flags are not its math's parameters, or whose option sets name a
    hyper-parameter it does not have or a value it refuses: called on registration, so at import."""
    for opts in ({},) + tuple(rule.option_sets):
        unknown = set(opts) - set(rule.defaults)
        if unknown:
            raise TypeError(f"{type(rule).__name__}.option_sets: {sorted(unknown)} are not hyper-parameters of "
                            f"{rule.name} (its defaults: {tuple(rule.defaults)})")
        group = {**rule.defaults, **opts}
        rule.validate(group)
        own = rule.for_group(group)
        own.flags(group)
        own.scalars(group, 1, *own.host_start(group))
    for name in rule.unsaved_hypers:
        if name not in rule.defaults:
            raise TypeError(f"{type(rule).__name__}.unsaved_hypers names {name!r}, not one of its hyper-parameters "
                            f"{tuple(rule.defaults)}")
    for name in rule.unsigned_states:
        if name not in rule.state_names:
            raise TypeError(f"{type(rule).__name__}.unsigned_states names {name!r}, not one of {rule.state_names}")


def register(rule):
    """Adds a rule (an instance, or a class made with no arguments; usable as a class decorator) to ``RULES``
    after ``check_declaration``. Returns its argument."""
    instance = rule() if isinstance(rule, type) else rule
    check_declaration(instance)
    if instance.name in RULES:
        raise ValueError(f"an optimizer named {instance.name!r} is registered already")
    RULES[instance.name] = instance
    return rule


def steps_list(step: int, params: list) -> list:
    """torch's fused kernels read one 0-d step tensor per param; they only read it, so one is shared."""
    return [torch.tensor(float(step))] * len(params)


# --- shared validation helpers: each names the argument it rejects -----------------------------

# Device tensors already range-checked once (by id; the weak value tells a live tensor from a reused id).
_seen_on_device: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _number(name: str, value: Any) -> float | None:
    """The value as a float; None where a tensor's value is not read here.

    A tensor hyper-parameter must hold one floating-point value (torch.optim raises ``ValueError`` for a
    tensor lr of another size, and so does every argument here). Its value is range-checked like a float's
    where reading it costs nothing: a CPU tensor on every check, a tensor on an accelerator once, when first
    seen (at construction, where torch.optim reads it too). Later in-place writes to a device tensor (an lr a
    schedule writes on the GPU) are not read back, since that would sync every step: their range is the
    writer's duty. Inside a torch.compile trace, and on the meta device, nothing is read."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
        if not value.is_floating_point():
            raise TypeError(f"{name} as a tensor must hold one floating-point value, got dtype {value.dtype}")
        if torch.compiler.is_compiling() or value.is_meta:
            return None
        if value.device.type != "cpu":
            if _seen_on_device.get(id(value)) is value:
                return None
            _seen_on_device[id(value)] = value
        value = value.item()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}: {value!r}")
    if math.isnan(value):
        raise ValueError(f"Invalid {name}: {value} (must not be NaN)")
    return float(value)


def nonzero(value: Any) -> bool:
    """Whether a feature that a zero hyper-parameter turns off is on; a tensor value counts as on."""
    return isinstance(value, torch.Tensor) or value != 0


def check_nonnegative(group: dict, *names: str) -> None:
    for name in names:
        value = _number(name, group[name])
        if value is not None and value < 0.0:
            raise ValueError(f"Invalid {name}: {value} (must be >= 0)")


def check_unit_interval(name: str, value: Any) -> None:
    """``value`` in [0, 1): the range of betas, alpha and momentum-like decay rates."""
    value = _number(name, value)
    if value is not None and not 0.0 <= value < 1.0:
        raise ValueError(f"Invalid {name}: {value} (must be in [0, 1))")


def check_betas(group: dict) -> None:
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (must be a pair (beta1, beta2))")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError(f"betas must be either both floats or both Tensors, got {betas!r}")  # torch's rule
    for i, beta in enumerate(betas):
        check_unit_interval(f"beta{i + 1} (betas[{i}])", beta)


def check_bool(group: dict, *names: str) -> None:
    for name in names:
        if not isinstance(group[name], bool):
            raise TypeError(f"{name} must be a bool, got {group[name]!r}")
