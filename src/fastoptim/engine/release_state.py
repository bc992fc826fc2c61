"""What a param's release hook reads besides its optimizer: which optimizer releases the param (the newest to hook
it), whether the backward running is a new one (``Backward``), and what accelerate says about it (it accumulates;
fp16 with a GradScaler)."""

from __future__ import annotations

import sys
import weakref

import torch
from torch import Tensor

# id(param) -> a weak reference to the Release that steps it (the newest to hook it), or to the ``Claim`` of a newer
# optimizer without release; a param's entry goes with the param. (A plain dict: the hook reads it for every param
# in every backward, and a weak-keyed lookup costs several times more; the value is weak so that no optimizer's
# leftovers are kept alive through it.)
OWNERS: dict[int, "weakref.ref[Release]"] = {}
# id(param) of the params (all in OWNERS) whose grad a release freed after its step, since a fastoptim zero_grad():
# torch.optim would still hold that grad, and zero_grad(set_to_none=False) would zero it, not leave it None
FREED: set[int] = set()


def forget(pid: int) -> None:
    """A released param is gone (its id may be reused): its entries go."""
    OWNERS.pop(pid, None)
    FREED.discard(pid)


class Claim:
    """An optimizer without release over params that a release hooked: the newest optimizer over a param steps it,
    so the release before it leaves the param alone until this optimizer is gone."""

    def __init__(self, stepper, params) -> None:
        self._stepper = weakref.ref(stepper)
        self.ref = weakref.ref(self)
        self.claim(params)

    def alive(self) -> bool:
        return self._stepper() is not None

    def claim(self, params) -> None:
        for p in params:
            if id(p) in OWNERS:
                OWNERS[id(p)] = self.ref


def owns(rel: "Release", p: Tensor) -> bool:
    """Whether ``rel`` releases ``p``: it hooked it last, or the one that did is gone (it then takes ``p`` back)."""
    ref = OWNERS.get(id(p))
    owner = None if ref is None else ref()
    if owner is rel:
        return True
    if owner is not None and owner.alive():
        return False  # a newer optimizer releases it
    OWNERS[id(p)] = rel.ref
    return True


class Backward:
    """The outermost backward running, as one part of release sees it: ``starts()`` is True at its first call in a
    backward, which queues ``end`` for that backward's end, and False at later calls until ``end`` has run. A
    backward started inside it (reentrant checkpointing: each segment's recompute runs a backward of its own from
    a Function's backward, a new graph task with its own end) is part of it: the grads it writes are whole, and its
    end is not the outer one's. The engine holds a queued callback as long as its graph task lives, so a weak
    reference to it tells a backward still running from one that raised (whose callback never runs)."""

    def __init__(self, end):
        self.end = end
        self.running: weakref.ref | None = None  # the callback queued by the backward running

    def starts(self) -> bool:
        running = self.running
        if running is not None and running() is not None:
            return False
        callback = _EndOfBackward(self)
        torch.autograd.Variable._execution_engine.queue_callback(callback)
        self.running = weakref.ref(callback)
        return True


class _EndOfBackward:
    __slots__ = ("backward", "__weakref__")

    def __init__(self, backward: Backward):
        self.backward = backward

    def __call__(self) -> None:
        self.backward.running = None
        self.backward.end()


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
