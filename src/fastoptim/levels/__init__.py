"""How a rule runs. Every level has ``run(update, params, grads, states, scalars, flags)``."""

from __future__ import annotations

import torch

from . import foreach, loop

# the levels that run today, in the order "auto" prefers them
LEVELS = {"foreach": foreach.run, "loop": loop.run}
# levels named by the API whose implementation is not in this build yet
PLANNED = ("fused", "compiled")
IMPLS = ("auto", *LEVELS, *PLANNED)


def check_impl(impl: str) -> str:
    if impl in PLANNED:
        raise NotImplementedError(f"impl={impl!r} is not available in this build; use one of "
                                  f"{', '.join(repr(i) for i in ('auto', *LEVELS))}")
    if impl not in IMPLS:
        raise ValueError(f"Unknown impl {impl!r}; valid values: {', '.join(repr(i) for i in IMPLS)}")
    return impl


def resolve(impl: str, device: torch.device):
    """The level function for ``impl`` on ``device`` ("auto": the fastest this build has there)."""
    if impl == "auto":
        return LEVELS["foreach"]
    return LEVELS[impl]
