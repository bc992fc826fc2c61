"""Timing: every row of one workload in one process, interleaved, medians after warm-up."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import registry
from . import workloads

# torch.optim's fused CPU kernels exist for these
TORCH_FUSED = {"sgd", "adam", "adamw", "adagrad"}


@dataclass
class Row:
    label: str
    library: str
    impl: str
    build: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    flat: bool = False          # runs on one flat tensor of the workload's size
    times_ms: list[float] = field(default_factory=list)
    first_step_ms: float = float("nan")
    state_bytes: int = 0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else float("nan")

    @property
    def spread_ms(self) -> tuple[float, float]:
        return (min(self.times_ms), max(self.times_ms)) if self.times_ms else (float("nan"),) * 2


def rows_for(optimizer: str, impls: list[str], flat_impls: list[str] = (), peers: bool = True) -> list[Row]:
    spec = registry.get(optimizer)
    kwargs = dict(spec.option_sets[0])
    rows = [Row(f"fastoptim {impl}", "fastoptim", impl, lambda ps, impl=impl: spec.cls(ps, impl=impl, **kwargs))
            for impl in impls]
    rows += [Row(f"fastoptim {impl} flat", "fastoptim", f"{impl}+flat",
                 lambda ps, impl=impl: spec.cls(ps, impl=impl, flat=True, **kwargs)) for impl in flat_impls]
    if peers and spec.reference is not None:
        torch_cls = getattr(torch.optim, spec.reference)
        rows += [Row("torch loop", "torch", "loop", lambda ps: torch_cls(ps, foreach=False, **kwargs)),
                 Row("torch foreach", "torch", "foreach", lambda ps: torch_cls(ps, foreach=True, **kwargs))]
        if spec.name in TORCH_FUSED:
            rows.append(Row("torch fused", "torch", "fused", lambda ps: torch_cls(ps, fused=True, **kwargs)))
    rows.append(floor_row(spec, kwargs))
    return rows


# torch fused kernels on one flat tensor that move the same bytes per param as a rule with n states
_SAME_BYTES = {0: ("SGD", {}), 1: ("SGD", {"momentum": 0.9}), 2: ("AdamW", {}), 3: ("Adam", {"amsgrad": True})}


def floor_row(spec, kwargs: dict) -> Row:
    """The flat floor: torch's fused step on ONE flat tensor of the workload's size (the memory-bound best
    case). Where torch has no fused kernel for the optimizer, a torch fused kernel that moves the same bytes
    per param (same number of states) stands in, and the row's impl says which."""
    if spec.name in TORCH_FUSED:
        cls, floor_kwargs, what = getattr(torch.optim, spec.reference), kwargs, spec.reference
    else:
        rule = spec.cls.rule
        n_states = sum(rule.active({**rule.defaults, **kwargs}))
        name, floor_kwargs = _SAME_BYTES[n_states]
        cls, what = getattr(torch.optim, name), f"{name}{floor_kwargs or ''} (same bytes)"
    return Row("flat floor", "torch", f"fused {what}", lambda ps: cls(ps, fused=True, **floor_kwargs), flat=True)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def run_workload(shapes, rows: list[Row], rounds: int, steps_per_round: int, warmup: int,
                 progress: Callable[[], None] = lambda: None) -> None:
    """Each row gets its own params; rounds interleave the rows so drift hits them all alike."""
    n = workloads.numel(shapes)
    live = []
    for row in rows:
        params = workloads.make_params([(n,)] if row.flat else shapes)
        opt = row.build(params)
        t0 = time.perf_counter()
        opt.step()
        row.first_step_ms = (time.perf_counter() - t0) * 1e3
        for _ in range(warmup):
            opt.step()
        row.state_bytes = state_bytes(opt)
        live.append((row, opt))
        progress()
    for _ in range(rounds):
        for row, opt in live:
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                opt.step()
            row.times_ms.append((time.perf_counter() - t0) * 1e3 / steps_per_round)
            progress()
