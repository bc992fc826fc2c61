"""The names older code imports from ``fastoptim.levels``, now in ``fastoptim.paths`` and ``fastoptim.engine``.

Read lazily, so that loading ``fastoptim.levels.cpu_kernels`` (the C++ kernels' build, which ``bulk`` uses) loads
nothing above it."""

_MOVED = ("IMPLS", "LEVELS", "PATHS", "check_impl", "own_paths", "record_paths", "uses_triton")


def __getattr__(name: str):
    if name in _MOVED:
        from ..paths import base

        return getattr(base, name)
    raise AttributeError(f"module 'fastoptim.levels' has no attribute {name!r}")


__all__ = list(_MOVED)
