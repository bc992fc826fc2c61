"""Peak tensor memory over stretches of code: what a step costs in memory as users feel it.

On CUDA the caching allocator keeps the peak itself (``torch.cuda.max_memory_allocated``). The CPU has no such
counter, so there the peak comes from torch's memory profiler: every allocation and free of a tensor's storage is
a ``[memory]`` event carrying its bytes (negative for a free), and their running sum in time order is the bytes
live. The profiler sees no free of a block allocated before it started (torch warns "Memory block of unknown size
was allocated before the profiling started"), so ``PeakMemory`` profiles the setup too, whose tensors the measured
code may free (flat mode swaps the params' storage for its buffer's), and marks each measured stretch with
``record_function``. The garbage collector is off inside ``PeakMemory``: a cycle of earlier code's freed in the
middle of a stretch would count against it (on CUDA too), and on the CPU be a free the profiler cannot size.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterable

import torch

MARK = "fastoptim.bench.measured "  # + the stretch's key: the record_function range around it


def _raw_events(prof) -> list:
    """The raw events of a finished ``torch.profiler.profile`` ([] where this torch does not expose them)."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    return [] if results is None else results.events()


def _memory_events(events: list) -> list:
    """The CPU ``[memory]`` events among a profile's raw ``events``, in time order."""
    from torch.autograd import DeviceType

    memory = [e for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    return sorted(memory, key=lambda e: e.start_ns())


def live_bytes_peak(events: Iterable, start_ns: int | None = None, end_ns: int | None = None) -> int:
    """The peak of live bytes (allocations minus frees, in time order) over ``[start_ns, end_ns]``, above the
    bytes live at ``start_ns`` (0 where never more were live). ``events``: the profiler's ``[memory]`` events in
    time order (``start_ns()``, ``nbytes()``); without bounds, all of them from the first."""
    live = base = peak = 0
    for event in events:
        t = event.start_ns()
        if end_ns is not None and t > end_ns:
            break
        live += event.nbytes()
        if start_ns is not None and t < start_ns:
            base = peak = live
        else:
            peak = max(peak, live)
    return peak - base


def profiled_peak(prof) -> int | None:
    """The peak of the CPU tensors' bytes live over a whole ``profile(profile_memory=True)`` run, from its start;
    None where the profiler recorded no memory event (memory profiling off or unavailable here)."""
    events = _memory_events(_raw_events(prof))
    return live_bytes_peak(events) if events else None


class PeakMemory:
    """Peaks of the tensor bytes live on ``device`` over stretches of code, each above those live as it began:

        with PeakMemory(device) as probe:
            params = make()               # live before the stretch: not counted, its frees seen
            with probe.measure("a"):
                build(params).step()
        probe.peaks["a"]                  # bytes; None where it cannot be measured here

    On the CPU the peaks are read from the profiler once the ``with`` block ends; on CUDA each as its stretch ends.
    Other devices: None. The profiler keeps every event of its session (a few hundred MB over one step of 4000
    tensors' optimizer), so a block should hold a few stretches, not a whole bench."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.peaks: dict[str, int | None] = {}
        self._prof = None
        self._collecting = False

    def __enter__(self) -> "PeakMemory":
        self._collecting = gc.isenabled()
        gc.disable()
        if self.device.type == "cpu":
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._collecting:
            gc.enable()
        if self._prof is None:
            return
        self._prof.__exit__(*exc)
        raw = _raw_events(self._prof)
        self._prof = None  # (its events: hundreds of MB on a large step)
        events = _memory_events(raw)
        marks = {e.name()[len(MARK):]: e for e in raw if e.name().startswith(MARK)} if events else {}
        for key in self.peaks:  # no memory event at all: the profiler records none here, so no number
            mark = marks.get(key)
            self.peaks[key] = None if mark is None else live_bytes_peak(events, mark.start_ns(), mark.end_ns())

    @contextmanager
    def measure(self, key: str):
        self.peaks[key] = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.peaks[key] = torch.cuda.max_memory_allocated(self.device) - before
        elif self._prof is not None:
            from torch.profiler import record_function

            with record_function(MARK + key):
                yield
        else:
            yield
