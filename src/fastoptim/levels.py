"""The names users import to choose and check how a step runs: ``LEVELS`` and ``IMPLS`` (what ``impl=``
takes), ``record_paths()`` (which path ran) and ``own_paths()`` (every level runs its own path).

A face of the surface layer: the names live in ``fastoptim.engine.dispatch`` (state such as ``ROUTING`` is
set there, not here)."""

from .engine.dispatch import IMPLS, LEVELS, PATHS, check_impl, own_paths, record_paths, uses_triton

__all__ = ["IMPLS", "LEVELS", "PATHS", "check_impl", "own_paths", "record_paths", "uses_triton"]
