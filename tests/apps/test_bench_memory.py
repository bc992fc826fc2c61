"""The bench's peak memory above params and grads: a measurement (the profiler's live tensor bytes on the CPU, the
allocator's peak on CUDA)."""

import torch

from fastoptim.bench import memory

MiB = 2 ** 20


def _floats(mib: float) -> torch.Tensor:
    return torch.empty(int(mib * MiB) // 4)


def test_each_stretch_counts_its_own_peak_above_what_was_live_as_it_began():
    with memory.PeakMemory("cpu") as probe:
        held = [_floats(4)]  # made before the stretches: not counted, but its free is seen
        with probe.measure("grow"):
            scratch = _floats(3)
            del scratch
            held.append(_floats(1))
        with probe.measure("free first"):
            held.clear()  # -5 MiB, then +2: never above where it began
            held.append(_floats(2))
        with probe.measure("then free"):  # +0.5 MiB, -2, +0.25
            held.append(_floats(0.5))
            del held[0]
            held.append(_floats(0.25))
    assert probe.peaks == {"grow": 3 * MiB, "free first": 0, "then free": MiB // 2}


def test_a_cycle_left_by_earlier_code_is_not_freed_against_a_stretch():
    """The collector is off inside the probe: earlier garbage is not freed in the middle of a stretch, where its
    free would hide what the stretch itself allocated."""
    with memory.PeakMemory("cpu") as probe:
        with probe.measure("leaves garbage"):
            cycle = {"tensor": _floats(4)}
            cycle["self"] = cycle
            del cycle
        with probe.measure("allocates"):
            objects = [[] for _ in range(50_000)]  # enough new objects that the collector would run here
            held = _floats(3)
    assert probe.peaks["allocates"] == 3 * MiB and len(objects) and held.numel()


def test_on_cuda_the_peak_is_the_allocators_above_its_count_as_the_stretch_began(monkeypatch):
    """The CUDA branch's arithmetic, with the allocator's counters stood in (the CPU runs this test too)."""
    calls, counters = [], {"allocated": 100, "peak": 100}

    def reset(device):
        calls.append("reset")
        counters["peak"] = counters["allocated"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["peak"])
    counters["peak"] = 10_000  # an earlier peak: the reset forgets it
    with memory.PeakMemory("cuda") as probe:
        with probe.measure("step"):
            counters["peak"], counters["allocated"] = 450, 300
    assert probe.peaks == {"step": 350} and calls == ["sync", "reset", "sync"]
