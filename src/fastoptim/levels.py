"""The names users import to choose and check how a step runs: ``LEVELS`` and ``IMPLS`` (what ``impl=``
takes), ``record_paths()`` (which path ran) and ``own_paths()`` (every level runs its own path).

The surface's face of them: they live in ``fastoptim.engine.dispatch`` and ``fastoptim.paths.record`` (state such
as ``ROUTING`` is set there, not here)."""

from .engine.dispatch import IMPLS, LEVELS, check_impl, own_paths
from .paths.environment import uses_triton
from .paths.record import PATHS, record_paths

__all__ = ["IMPLS", "LEVELS", "PATHS", "check_impl", "own_paths", "record_paths", "uses_triton"]
