"""The names older code imports from ``fastoptim.levels``, now in ``fastoptim.engine.dispatch`` (routing, the
levels' names) and ``fastoptim.paths`` (the paths themselves).

Read lazily, so that loading ``fastoptim.levels.cpu_kernels`` (the C++ kernels' build, which ``bulk`` uses) loads
nothing above it."""

_MOVED = ("IMPLS", "LEVELS", "PATHS", "check_impl", "own_paths", "record_paths", "uses_triton")


def __getattr__(name: str):
    if name in _MOVED:
        from ..engine import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module 'fastoptim.levels' has no attribute {name!r}")


__all__ = list(_MOVED)
