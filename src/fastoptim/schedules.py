"""Learning-rate schedules as pure functions of the step, and a scheduler that applies them for free.

A schedule is any callable ``step -> factor``: the lr of each param group is its base lr times the factor
(the base is ``initial_lr``, as torch's schedulers keep it). The factories below cover the usual shapes;
``join`` chains phases. ``Scheduler`` follows torch's LRScheduler protocol (``step()``, ``get_last_lr()``,
``state_dict()``, ``load_state_dict()``, ``last_epoch``) so it fits existing loops and trainers, and it
writes the lr (and beta1 / momentum, when a schedule cycles them) into tensor-valued group entries *in
place*: a compiled or fused step sees the same tensor every step, so it never recompiles and never reads
the value back to the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

Schedule = Callable[[int], float]


def _check_steps(**steps: int) -> None:
    for name, value in steps.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def _cos_anneal(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def constant(factor: float = 1.0) -> Schedule:
    return lambda step: factor


def linear_warmup(warmup_steps: int, start_factor: float = 0.0) -> Schedule:
    """From ``start_factor`` to 1 over ``warmup_steps`` steps, then 1 (torch's LinearLR)."""
    _check_steps(warmup_steps=warmup_steps)
    return linear(start_factor, 1.0, warmup_steps)


def linear(start_factor: float, end_factor: float, steps: int) -> Schedule:
    """A straight line from ``start_factor`` to ``end_factor`` over ``steps`` steps, then ``end_factor``."""
    _check_steps(steps=steps)

    def factor(step: int) -> float:
        if steps == 0:
            return end_factor
        return start_factor + (end_factor - start_factor) * min(step, steps) / steps
    return factor


def linear_decay(total_steps: int, end_factor: float = 0.0) -> Schedule:
    return linear(1.0, end_factor, total_steps)


def cosine(total_steps: int, min_factor: float = 0.0) -> Schedule:
    """Half a cosine from 1 to ``min_factor`` over ``total_steps``, then ``min_factor``
    (torch's CosineAnnealingLR with ``eta_min = min_factor * lr``, without its restarts)."""
    _check_steps(total_steps=total_steps)
    return lambda step: _cos_anneal(1.0, min_factor, min(step, total_steps) / max(total_steps, 1))


def warmup_cosine(warmup_steps: int, total_steps: int, min_factor: float = 0.1) -> Schedule:
    """nanoGPT's get_lr: linear warmup to 1 at ``warmup_steps``, cosine to ``min_factor`` at ``total_steps``."""
    _check_steps(warmup_steps=warmup_steps, total_steps=total_steps)
    if total_steps <= warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if step > total_steps:
            return min_factor
        ratio = (step - warmup_steps) / (total_steps - warmup_steps)
        return min_factor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - min_factor)
    return factor


def inverse_sqrt(warmup_steps: int) -> Schedule:
    """Linear warmup, then 1/sqrt(step) decay (the Transformer schedule, peak 1 at ``warmup_steps``)."""
    _check_steps(warmup_steps=warmup_steps)
    warmup = max(warmup_steps, 1)
    return lambda step: (step + 1) / warmup if step + 1 < warmup else math.sqrt(warmup / (step + 1))


def wsd(warmup_steps: int, stable_steps: int, decay_steps: int, min_factor: float = 0.0,
        decay: str = "linear") -> Schedule:
    """Warmup-stable-decay: linear warmup, a flat stretch at 1, then a decay (linear, cosine or 1-sqrt)."""
    _check_steps(warmup_steps=warmup_steps, stable_steps=stable_steps, decay_steps=decay_steps)
    shapes = {"linear": lambda t: 1 - t, "cosine": lambda t: 0.5 * (1 + math.cos(math.pi * t)),
              "sqrt": lambda t: 1 - math.sqrt(t)}
    if decay not in shapes:
        raise ValueError(f"decay must be one of {sorted(shapes)}, got {decay!r}")
    shape = shapes[decay]

    def decay_phase(step: int) -> float:
        t = min(step, decay_steps) / max(decay_steps, 1)
        return min_factor + (1 - min_factor) * shape(t)
    return join([(warmup_steps, linear_warmup(warmup_steps)), (stable_steps, constant()),
                 (decay_steps, decay_phase)])


def join(phases: Sequence[tuple[int, Schedule]]) -> Schedule:
    """Phases one after another: ``[(steps, schedule), ...]``; each schedule sees its own step from 0, and
    the last one runs on past its length (torch's SequentialLR)."""
    if not phases:
        raise ValueError("join needs at least one phase")
    for steps, _ in phases:
        _check_steps(steps=steps)
    starts = []
    total = 0
    for steps, _ in phases:
        starts.append(total)
        total += steps

    def factor(step: int) -> float:
        for (steps, schedule), start in zip(phases, starts):
            if step < start + steps:
                return schedule(step - start)
        steps, schedule = phases[-1]
        return schedule(step - starts[-1])
    return factor


@dataclass(frozen=True)
class OneCycle:
    """Smith's one-cycle policy exactly as torch's OneCycleLR: lr rises from 1/div_factor to 1 (times max_lr)
    over ``pct_start`` of the run and anneals to 1/(div_factor*final_div_factor); beta1 / momentum moves the
    other way, from ``max_momentum`` to ``base_momentum`` and back."""
    total_steps: int
    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    anneal: str = "cos"
    base_momentum: float = 0.85
    max_momentum: float = 0.95
    three_phase: bool = False

    def __post_init__(self):
        _check_steps(total_steps=self.total_steps)
        if not 0.0 <= self.pct_start <= 1.0:
            raise ValueError(f"pct_start must be in [0, 1], got {self.pct_start}")
        if self.anneal not in ("cos", "linear"):
            raise ValueError(f"anneal must be 'cos' or 'linear', got {self.anneal!r}")

    def _phases(self) -> list[tuple[float, float, float, float, float]]:
        """(end step, start lr, end lr, start momentum, end momentum), lr as a factor of max_lr."""
        initial, peak = 1.0 / self.div_factor, 1.0
        final = initial / self.final_div_factor
        up = float(self.pct_start * self.total_steps) - 1
        lo, hi = self.base_momentum, self.max_momentum
        if self.three_phase:
            down = float(2 * self.pct_start * self.total_steps) - 2
            return [(up, initial, peak, hi, lo), (down, peak, initial, lo, hi),
                    (self.total_steps - 1, initial, final, hi, hi)]
        return [(up, initial, peak, hi, lo), (self.total_steps - 1, peak, final, lo, hi)]

    def _at(self, step: int) -> tuple[float, float]:
        anneal = _cos_anneal if self.anneal == "cos" else (lambda a, b, pct: (b - a) * pct + a)
        start = 0.0
        phases = self._phases()
        for i, (end, lr0, lr1, m0, m1) in enumerate(phases):
            if step <= end or i == len(phases) - 1:
                pct = (step - start) / (end - start)
                return anneal(lr0, lr1, pct), anneal(m0, m1, pct)
            start = end
        raise AssertionError("unreachable")

    def __call__(self, step: int) -> float:
        return self._at(step)[0]

    def momentum(self, step: int) -> float:
        return self._at(step)[1]


class Scheduler:
    """Applies ``lr_schedule`` (and ``momentum_schedule``: absolute beta1 / momentum values) to an optimizer,
    torch's LRScheduler protocol. ``tensor_lr=True`` turns the groups' lr into 0-d tensors on the params'
    device first (fastoptim optimizers take them without syncs or recompiles); values are then written in
    place with ``fill_``. It drives torch.optim optimizers too (pass ``tensor_lr=False`` for those that
    take only float lrs). The base lr of a group is its ``initial_lr`` (set from ``lr`` when absent)."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_schedule: Schedule,
                 momentum_schedule: Schedule | None = None, tensor_lr: bool = False, last_epoch: int = -1):
        if not callable(lr_schedule):
            raise TypeError(f"lr_schedule must be a callable step -> factor, got {lr_schedule!r}")
        if momentum_schedule is None and isinstance(lr_schedule, OneCycle):
            momentum_schedule = lr_schedule.momentum
        if momentum_schedule is not None and not any("betas" in g or "momentum" in g
                                                     for g in optimizer.param_groups):
            raise ValueError("momentum_schedule needs param groups with 'betas' or 'momentum'")
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.momentum_schedule = momentum_schedule
        for group in optimizer.param_groups:
            base = group.setdefault("initial_lr", group["lr"])
            if isinstance(base, Tensor):
                group["initial_lr"] = float(base)  # read once, at construction
            if tensor_lr and not isinstance(group["lr"], Tensor):
                device = group["params"][0].device if group["params"] else torch.device("cpu")
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        self.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._last_lr: list[float] = []
        self.step()

    def step(self) -> None:
        self.last_epoch += 1
        factor = self.lr_schedule(self.last_epoch)
        momentum = None if self.momentum_schedule is None else self.momentum_schedule(self.last_epoch)
        self._last_lr = []
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            lr = base * factor
            _write(group, "lr", lr)
            self._last_lr.append(lr)
            if momentum is not None:
                if "betas" in group:
                    beta1 = group["betas"][0]
                    if isinstance(beta1, Tensor):
                        beta1.fill_(momentum)
                    else:
                        group["betas"] = (momentum, *group["betas"][1:])
                elif "momentum" in group:
                    _write(group, "momentum", momentum)

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs), "_last_lr": list(self._last_lr)}

    def load_state_dict(self, state_dict: dict) -> None:
        missing = {"last_epoch", "base_lrs"} - set(state_dict)
        if missing:
            raise ValueError(f"scheduler state_dict lacks {sorted(missing)}")
        if len(state_dict["base_lrs"]) != len(self.optimizer.param_groups):
            raise ValueError(f"scheduler state_dict has {len(state_dict['base_lrs'])} base lrs, the optimizer "
                             f"has {len(self.optimizer.param_groups)} param groups")
        self.last_epoch = state_dict["last_epoch"]
        self.base_lrs = list(state_dict["base_lrs"])
        self._last_lr = list(state_dict.get("_last_lr", []))


def _write(group: dict, key: str, value: float) -> None:
    current = group[key]
    if isinstance(current, Tensor):
        current.fill_(value)  # in place: the same tensor every step, no recompile, no host read
    else:
        group[key] = value
