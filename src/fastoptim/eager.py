"""``eager``: ``torch.compiler.disable`` made at a function's first call, not at import.

``torch.compiler.disable`` imports ``torch._dynamo`` when it decorates, about as long as importing torch itself:
every ``fastoptim`` command, every torchrun rank and every program that never compiles would pay it at
``import fastoptim``. (torch.optim defers it the same way.) Under ``torch.compile`` the function is the
disabled one, as with the decorator: the caller's graph breaks there and the function runs eagerly."""

from __future__ import annotations

import functools
from typing import Callable


def eager(fn: Callable | None = None, *, reason: str | None = None) -> Callable:
    """``@eager`` or ``@eager(reason=...)``: ``fn`` under ``torch.compiler.disable`` (with ``reason``)."""
    if fn is None:
        return functools.partial(eager, reason=reason)
    disabled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            import torch

            disabled = torch.compiler.disable(fn, reason=reason) if reason else torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    # what ``torch.compiler.disable`` marks its functions with (Dynamo reads these), so a first call under tracing
    # breaks the graph here with ``reason`` too, instead of tracing ``run`` into the disable call itself
    run._torchdynamo_disable = True
    run._torchdynamo_disable_msg = reason
    return run
