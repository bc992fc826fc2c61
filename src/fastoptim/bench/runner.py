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
    # the flat floor: the best torch (or fastoptim, when torch has no such optimizer) step on ONE tensor
    if spec.name in TORCH_FUSED:
        floor_cls = getattr(torch.optim, spec.reference)
        rows.append(Row("flat floor", "torch", "fused", lambda ps: floor_cls(ps, fused=True, **kwargs), flat=True))
    else:
        rows.append(Row("flat floor", "fastoptim", "foreach",
                        lambda ps: spec.cls(ps, impl="foreach", **kwargs), flat=True))
    return rows


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
