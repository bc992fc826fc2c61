"""Timing: every row of one workload in one process, interleaved, medians after warm-up."""

from __future__ import annotations

import gc
import statistics
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..levels import record_paths
from .. import registry, timing
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
    error: str | None = None    # what stopped the row (a peer that cannot run here), shown instead of times
    times_ms: list[float] = field(default_factory=list)
    first_step_ms: float = float("nan")
    state_bytes: int = 0
    state_bits: int = 32        # the width the row keeps its state at (low-bit rows keep small params at 32)
    peak_bytes: int | None = None  # tensor bytes above params and grads, build and first step (measure_peaks)
    paths: list[str] = field(default_factory=list)  # the paths fastoptim's levels took (record_paths)
    ns: dict | None = None      # Newton-Schulz settings it runs (NS_OPTIONS), for Muon's family; None: none
    flops: int | None = None    # Newton-Schulz FLOPs per step on the workload (matmul.newton_schulz_rows)
    method: str | None = None   # "keller/standard", ...: the coefficients and method it ran (matmul.method_label)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else float("nan")

    @property
    def spread_ms(self) -> tuple[float, float]:
        return (min(self.times_ms), max(self.times_ms)) if self.times_ms else (float("nan"),) * 2


class ClipThenStep:
    """The unfused baseline: a clip_grad_norm_ pass over the grads, then the optimizer's step."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_norm: float, clip: Callable):
        self.optimizer, self.max_norm, self.clip = optimizer, max_norm, clip
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.state = optimizer.state

    def step(self) -> None:
        self.clip(self.params, self.max_norm)
        self.optimizer.step()


PEER_MODES = ("none", "torch", "fp32", "all")
NS_OPTIONS = ("ns_coefficients", "ns_steps", "ns_method", "ns_dtype")
# the Newton-Schulz variants timed at the fused level, beside the levels' default
NS_METHODS = ("standard", "gram")


def _state(bits: int | str) -> str:
    """A row's state format: "8-bit" for a width, a format's own name for one registered beside its width's."""
    return f"{bits}-bit" if isinstance(bits, int) else bits


def rows_for(optimizer: str, impls: list[str], flat_impls: list[str] = (), peers: str = "fp32",
             clip: float | None = None, state_bits: tuple[int, ...] = ()) -> list[Row]:
    """The rows of one optimizer. ``peers``: "none"; "torch" (torch.optim loop / foreach / fused); "fp32"
    (also the installed libraries' full-precision optimizers); "all" (also their 8/4-bit ones and
    torch.compile of torch's step). With ``clip``, fastoptim rows clip inside the step (``max_grad_norm``),
    torch rows run ``torch.nn.utils.clip_grad_norm_`` first, and one more row shows fastoptim's fused level
    with the separate clip pass, to read off what fusing saves. ``state_bits``: more fastoptim rows, each
    level (and each flat level) again with its state kept at those widths (``state_bits=``; a format's
    ``key``, its name for one registered beside its width's own). For a rule with Newton-Schulz (Muon, NorMuon):
    the fused level again with each coefficient preset and method (``fastoptim fused polar_express/gram``), and
    fastoptim's fused AdamW on the same params, to read the step's cost against AdamW's."""
    if peers not in PEER_MODES:
        raise ValueError(f"peers must be one of {PEER_MODES}, got {peers!r}")
    spec = registry.get(optimizer)
    kwargs = dict(spec.option_sets[0])
    ours = dict(kwargs, max_grad_norm=clip) if clip else kwargs
    tag = " (clip in step)" if clip else ""
    rows = [Row(f"fastoptim {impl}{tag}", "fastoptim", impl, lambda ps, impl=impl: spec.cls(ps, impl=impl, **ours))
            for impl in impls]
    rows += [Row(f"fastoptim {impl} flat{tag}", "fastoptim", f"{impl}+flat",
                 lambda ps, impl=impl: spec.cls(ps, impl=impl, flat=True, **ours)) for impl in flat_impls]
    rows += [Row(f"fastoptim {impl} {_state(bits)} state{tag}", "fastoptim", f"{impl}+{bits}bit",
                 lambda ps, impl=impl, bits=bits: spec.cls(ps, impl=impl, state_bits=bits, **ours), state_bits=bits)
             for bits in state_bits if bits != 32 for impl in impls]
    rows += [Row(f"fastoptim {impl} flat {_state(bits)} state{tag}", "fastoptim", f"{impl}+flat+{bits}bit",
                 lambda ps, impl=impl, bits=bits: spec.cls(ps, impl=impl, flat=True, state_bits=bits, **ours))
             for bits in state_bits if bits != 32 for impl in flat_impls]
    if clip:
        from ..clip import clip_grad_norm_
        rows.append(Row("fastoptim fused + clip_grad_norm_", "fastoptim", "fused",
                        lambda ps: ClipThenStep(spec.cls(ps, impl="fused", **kwargs), clip, clip_grad_norm_)))
    newton_schulz = "ns_steps" in spec.rule.defaults
    if newton_schulz:
        group = {**spec.rule.defaults, **kwargs}
        settings = {k: group[k] for k in NS_OPTIONS}
        for row in rows:
            row.ns = settings
        if "fused" in impls:
            from ..rules.newton_schulz import PRESETS
            for preset in PRESETS:
                for method in NS_METHODS:
                    variant = dict(ns_coefficients=preset, ns_method=method)
                    rows.append(Row(f"fastoptim fused {preset}/{method}{tag}", "fastoptim", "fused",
                                    lambda ps, v=variant: spec.cls(ps, impl="fused", **ours, **v),
                                    ns={**settings, **variant}))

    torch_name = spec.torch_counterpart

    def torch_row(label, **flags):
        torch_cls = getattr(torch.optim, torch_name)
        if clip:
            return Row(f"{label} + clip_grad_norm_", "torch", label.split()[-1], lambda ps: ClipThenStep(
                torch_cls(ps, **flags, **kwargs), clip, torch.nn.utils.clip_grad_norm_))
        return Row(label, "torch", label.split()[-1], lambda ps: torch_cls(ps, **flags, **kwargs))

    if peers != "none" and spec.torch_class is not None:  # torch steps it one tensor at a time only
        rows.append(torch_row("torch loop"))
        if newton_schulz:
            rows[-1].ns = _torch_newton_schulz(getattr(torch.optim, spec.torch_class))
    elif peers != "none" and spec.reference is not None:
        rows += [torch_row("torch loop", foreach=False), torch_row("torch foreach", foreach=True)]
        if spec.name in TORCH_FUSED:
            rows.append(torch_row("torch fused", fused=True))
        if peers == "all" and not clip:
            torch_cls = getattr(torch.optim, spec.reference)
            rows.append(Row("torch compiled foreach", "torch", "compiled",
                            lambda ps: CompiledStep(torch_cls(ps, foreach=True, **kwargs))))
    if peers in ("fp32", "all") and not clip:
        from .peers import peer_rows
        for label, library, build, bits in peer_rows(spec.name, kwargs, everything=peers == "all"):
            rows.append(Row(label, library, "peer", build, state_bits=bits))
    if spec.params == "matrices":
        adamw = registry.get("adamw").cls
        clipped = dict(max_grad_norm=clip) if clip else {}
        rows.append(Row(f"{ADAMW_LABEL}{tag}", "fastoptim", "fused",
                        lambda ps: adamw(ps, impl="fused", **clipped)))
    rows.append(floor_row(spec, kwargs))
    return rows


# AdamW's fused step on a Muon row set's params: what the Muon step costs over the usual one
ADAMW_LABEL = "fastoptim AdamW fused"


def _torch_newton_schulz(cls) -> dict:
    """The Newton-Schulz a torch.optim class runs: its defaults, standard iterations, always in bf16."""
    import inspect

    defaults = {k: p.default for k, p in inspect.signature(cls).parameters.items()}
    return dict(ns_coefficients=defaults["ns_coefficients"], ns_steps=defaults["ns_steps"], ns_method="standard",
                ns_dtype="bfloat16")


class CompiledStep:
    """torch.compile of an optimizer's step, the way torch's docs compile one."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.state = optimizer.state
        self._step = torch.compile(optimizer.step, fullgraph=False)

    def step(self) -> None:
        self._step()


# torch fused kernels on one flat tensor that move the same bytes per param as a rule with n states
_SAME_BYTES = {0: ("SGD", {}), 1: ("SGD", {"momentum": 0.9}), 2: ("AdamW", {}), 3: ("Adam", {"amsgrad": True})}


def floor_row(spec, kwargs: dict) -> Row:
    """The flat floor: torch's fused step on ONE flat tensor of the workload's size (the memory-bound best
    case). Where torch has no fused kernel for the optimizer, a torch fused kernel that moves the same bytes
    per param (same number of states) stands in, and the row's impl says which."""
    if spec.name in TORCH_FUSED:
        cls, floor_kwargs, what = getattr(torch.optim, spec.reference), kwargs, spec.reference
    else:
        n_states = full_size_states(spec, kwargs)
        name, floor_kwargs = _SAME_BYTES[n_states]
        cls, what = getattr(torch.optim, name), f"{name}{floor_kwargs or ''} (same bytes)"
    return Row("flat floor", "torch", f"fused {what}", lambda ps: cls(ps, fused=True, **floor_kwargs), flat=True)


def full_size_states(spec, kwargs: dict) -> int:
    """How many param-sized states the optimizer keeps for a large matrix (Adafactor's factored ones are not)."""
    rule = spec.cls.rule
    matrix = torch.empty(1024, 1024, device="meta")
    group = {**rule.defaults, **kwargs}
    return sum(on and rule.state_shape(name, matrix) == (1024, 1024)
               for name, on in zip(rule.state_names, rule.active(group)))


def _state_values(state):
    for v in state.values():
        if isinstance(v, dict):  # some libraries nest per-param state one level deeper
            yield from _state_values(v)
        else:
            yield v


def _tensors(value):
    """The plain tensors a state value holds (a quantized state: its codes and scales; a tensor subclass: its
    inner tensors)."""
    from ..storage import QuantizedState

    if isinstance(value, QuantizedState):
        local = value.local()
        yield from local.tensors()
    elif isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from _tensors(getattr(value, name))
        else:
            yield value


def state_bytes(opt) -> int:
    """Bytes of state tensors (quantized ones: codes and scales), not counting step counters (0-d tensors).
    A tensor that several params' states share (bitsandbytes keeps one quantization map for all) counts once."""
    seen, total = set(), 0
    for s in opt.state.values():
        for v in _state_values(s):
            for t in _tensors(v):
                key = (t.device, t.data_ptr(), t.numel() * t.element_size())
                if t.dim() > 0 and key not in seen:
                    seen.add(key)
                    total += key[2]
    return total


def run_workload(shapes, rows: list[Row], rounds: int, steps_per_round: int, warmup: int,
                 progress: Callable[[], None] = lambda: None, device="cpu", memory: bool = True) -> None:
    """Each row gets its own params on ``device``; rounds interleave the rows so drift hits them all alike.
    Every timed step starts and ends with the device synchronized (``timing.clock``). With ``memory``, each row
    that ran then gets its ``peak_bytes`` (``measure_peaks``) once the rounds are over."""
    n = workloads.numel(shapes)
    now = timing.clock([device])
    live = []
    for row in rows:
        params = workloads.make_params([(n,)] if row.flat else shapes, device=device)
        try:
            opt = row.build(params)
            grads = [p.grad for p in params]  # after build: flat mode swaps in views of its buffer
            t0 = now()
            with record_paths() as paths:
                opt.step()
            row.first_step_ms = (now() - t0) * 1e3
            row.paths = sorted(set(paths))
            for _ in range(warmup):
                for p, g in zip(params, grads):
                    p.grad = g
                opt.step()
        except Exception as e:  # a peer that cannot run on this machine: say why, time the rest
            row.error = f"{type(e).__name__}: {e}".splitlines()[0][:120]
            progress()
            continue
        row.state_bytes = state_bytes(opt)
        live.append((row, opt, params, grads))
        progress()
    for _ in range(rounds):
        for row, opt, params, grads in live:
            elapsed = 0.0
            for _ in range(steps_per_round):
                if params[0].grad is None:  # a library that consumes the grads: put them back, untimed
                    for p, g in zip(params, grads):
                        p.grad = g
                t0 = now()
                opt.step()
                elapsed += now() - t0
            row.times_ms.append(elapsed * 1e3 / steps_per_round)
            progress()
    if memory:
        ran = [row for row, *_ in live]
        live.clear()  # the timed instances go before the measured ones are made (the loop's names held one)
        opt = params = grads = None
        gc.collect()
        measure_peaks(ran, shapes, progress, device)


def measure_peaks(rows: list[Row], shapes, progress: Callable[[], None] = lambda: None, device="cpu") -> None:
    """Each row's ``peak_bytes``: the peak of tensor bytes above the params and grads while a new instance of it
    is built and takes its first step (its state made), on ``device`` (``memory.PeakMemory``: the profiler on the
    CPU, the allocator on CUDA). A second instance, once the timing is over: the profiler slows what it watches,
    so no timed step (the first one included) runs under it, and by then the kernels are built and compiled, so
    the peak is the step's and its state's, not the compiler's. None where it cannot be measured."""
    from .memory import PeakMemory

    n = workloads.numel(shapes)
    for row in rows:
        opt, failed = None, False
        # a profiler session per row: one session's events over every row would take GBs on mlp2000
        with PeakMemory(device) as probe:
            try:
                params = workloads.make_params([(n,)] if row.flat else shapes, device=device)
                with probe.measure("step"):
                    opt = row.build(params)
                    opt.step()
            except Exception:  # a peer whose second instance fails: no number rather than a wrong one
                failed = True
        row.peak_bytes = None if failed else probe.peaks["step"]
        gone = weakref.ref(opt) if opt is not None else lambda: None
        opt = params = None
        if gone() is not None:  # held by a reference cycle: free its state before the next row's is made
            gc.collect()
        progress()


def time_schedulers(steps: int = 400, rounds: int = 7, groups: int = 2) -> list[dict]:
    """Microseconds per scheduler step, fastoptim's Scheduler against torch's, on an AdamW with ``groups``
    param groups; interleaved rounds, medians."""
    from .. import optimizers, schedules

    def fresh(cls):
        return cls([{"params": [torch.nn.Parameter(torch.zeros(4))]} for _ in range(groups)], lr=1e-3)

    total = steps * rounds + 10
    S = torch.optim.lr_scheduler
    makers = {
        "torch CosineAnnealingLR": lambda: S.CosineAnnealingLR(fresh(torch.optim.AdamW), T_max=total),
        "fastoptim cosine": lambda: schedules.Scheduler(fresh(optimizers.AdamW), schedules.cosine(total)),
        "fastoptim cosine, tensor lr": lambda: schedules.Scheduler(fresh(optimizers.AdamW), schedules.cosine(total),
                                                                   tensor_lr=True),
        "torch OneCycleLR": lambda: S.OneCycleLR(fresh(torch.optim.AdamW), max_lr=1e-3, total_steps=total),
        "fastoptim OneCycle": lambda: schedules.Scheduler(fresh(optimizers.AdamW), schedules.OneCycle(total)),
        "fastoptim OneCycle, tensor lr": lambda: schedules.Scheduler(fresh(optimizers.AdamW),
                                                                     schedules.OneCycle(total), tensor_lr=True),
    }
    with warnings.catch_warnings():  # torch warns that its scheduler steps before any optimizer step
        warnings.simplefilter("ignore")
        live = {label: make() for label, make in makers.items()}
    times: dict[str, list[float]] = {label: [] for label in live}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(rounds):
            for label, sched in live.items():
                t0 = time.perf_counter()
                for _ in range(steps):
                    sched.step()
                times[label].append((time.perf_counter() - t0) * 1e6 / steps)
    return [{"label": label, "us_per_step": statistics.median(ts), "min_us": min(ts), "max_us": max(ts)}
            for label, ts in times.items()]
