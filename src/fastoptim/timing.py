"""Wall-clock timing of device work. GPU kernels run asynchronously: a clock read right after a launch
measures the launch, not the work. ``clock(where)`` gives a clock that first waits for the work queued on
those devices (``torch.cuda.synchronize`` on CUDA; nothing on the CPU, whose work is done when the call
returns). Read it at both ends of every timed region."""

from __future__ import annotations

from time import perf_counter
from typing import Callable, Iterable

import torch

# device type -> how to wait for the work queued on one device of that type; types not listed run
# synchronously (the CPU)
SYNC: dict[str, Callable[[torch.device], None]] = {
    "cuda": lambda device: torch.cuda.synchronize(device),
    "xpu": lambda device: torch.xpu.synchronize(device),
    "mps": lambda device: torch.mps.synchronize(),
}


def devices_of(where: Iterable) -> list[torch.device]:
    """The distinct devices of some tensors, devices or device strings, in first-seen order."""
    seen: dict[torch.device, None] = {}
    for item in where:
        seen.setdefault(item.device if isinstance(item, torch.Tensor) else torch.device(item), None)
    return list(seen)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait until each device has finished the work queued on it; nothing for the CPU."""
    for device in devices:
        sync = SYNC.get(device.type)
        if sync is not None:
            sync(device)


def clock(where: Iterable) -> Callable[[], float]:
    """``perf_counter`` read after the devices of ``where`` (tensors or devices) have finished their queued
    work: ``t0 = now(); work(); elapsed = now() - t0`` times the work itself on any device."""
    devices = devices_of(where)

    def now() -> float:
        synchronize(devices)
        return perf_counter()

    return now
