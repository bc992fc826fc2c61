"""What a param's release hook reads besides its optimizer: which optimizer releases the param (the newest to hook
it), and what accelerate says about the backward running (it accumulates; fp16 with a GradScaler)."""

from __future__ import annotations

import sys
import weakref

from torch import Tensor

# id(param) -> a weak reference to the Release that steps it (the newest to hook it); a param's entry goes with the
# param. (A plain dict: the hook reads it for every param in every backward, and a weak-keyed lookup costs several
# times more; the value is weak so that no optimizer's leftovers are kept alive through it.)
OWNERS: dict[int, "weakref.ref[Release]"] = {}


def owns(rel: "Release", p: Tensor) -> bool:
    """Whether ``rel`` releases ``p``: it hooked it last, or the one that did is gone (it then takes ``p`` back)."""
    ref = OWNERS.get(id(p))
    owner = None if ref is None else ref()
    if owner is rel:
        return True
    if owner is not None and owner._opt() is not None:
        return False  # a newer optimizer releases it
    OWNERS[id(p)] = rel.ref
    return True


def accelerate_accumulates() -> bool:
    """Whether accelerate (HF Trainer drives it) says this backward accumulates: its ``GradientState`` (one state
    shared by all its instances) has ``sync_gradients`` False between the optimizer steps of an accumulation
    window. False where accelerate is not in use."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    return bool(shared) and shared.get("sync_gradients", True) is False


def accelerate_scales() -> bool:
    """Whether accelerate runs fp16 mixed precision (with a GradScaler, which release refuses): its
    ``AcceleratorState`` (shared by all its instances) says so before any backward."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None)
    return bool(shared) and shared.get("_mixed_precision") == "fp16"
