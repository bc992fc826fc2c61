"""Which path ran: ``record_paths()`` collects the name of each path the dispatcher runs (tests of a fast path
assert that it ran; ``fastoptim bench`` reports it)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

PATHS = ("loop", "foreach", "compiled", "triton", "triton_stored", "torch_fused", "cpu_kernel",
         "stage_loop", "stage_batched", "stage_compiled")  # (the last three: per-tensor stages, ``stages``)
_path_log: list[str] | None = None


@contextmanager
def record_paths() -> Iterator[list[str]]:
    """Collect the name of every path the dispatcher runs while the block runs (one entry per bucket run;
    a bucket split between two paths gives both). Costs one global read per bucket when not recording."""
    global _path_log
    outer, _path_log = _path_log, []
    try:
        yield _path_log
    finally:
        _path_log = outer


def took(path: str) -> None:
    if _path_log is not None:
        _path_log.append(path)
