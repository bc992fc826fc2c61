"""Exact global-norm clipping with gradient release: a first backward measures the norm, the second one steps.

    with opt.measure_grad_norm():
        loss.backward(retain_graph=True)  # measures the norm of the grads this backward would leave; keeps none
    loss.backward()                       # steps each bucket, its grads times the clip factor of that norm
    opt.step()                            # (steps what has a grad left, by the same factor; ends the window)

The clip factor needs every grad, and release frees each grad as its bucket steps: so the norm is taken in a
backward of its own. There each param's grad is accumulated as usual (every grad hook of the user's applied), its
norm taken in the param's dtype (as ``opt.step()`` reads it) once accumulation is done, and the grad put back as it
was before this backward: None, or a copy taken just before (a param whose grad was accumulating: one param-sized
copy at a time). The norms are combined as ``clip.grad_norm`` combines them for ``opt.step()``, in the same order:
the factor is the ordinary step's, bit for bit.

Cost: one more backward per optimizer step (a backward is about two thirds of a training step's compute); memory:
the graph is kept from the first backward to the second (as it is kept at the start of any backward). Without a
measured norm a released bucket with ``max_grad_norm`` refuses to step (before anything changed), so clipping is
never skipped in silence. Under reentrant checkpointing each segment's recompute runs a backward inside the
measuring one; its params' grads are whole, and the norm is taken at the end of the outer backward. A param measured
twice in one window (used in two such segments, or in one and outside it) is refused, as its norm would be of part of
its grad.
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from typing import Iterator

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .. import clip
from .release_state import Backward

MEASURED_TWICE = ("a param's grad was measured twice in one window by measure_grad_norm(): a param used in two "
                  "segments of reentrant checkpointing, or in one and outside it (each segment's recompute "
                  "backpropagates apart: use torch.utils.checkpoint with use_reentrant=False), or two measuring "
                  "backwards before one opt.step(). Nothing has stepped")
NOT_MEASURED = ("max_grad_norm with gradient_release=True: the global grad norm of this step was not measured, and a "
                "released bucket cannot be clipped without it. Measure it in a backward of its own first:\n"
                "    with opt.measure_grad_norm():\n        loss.backward(retain_graph=True)\n    loss.backward()\n"
                "or choose max_grad_norm=None (no clipping), or gradient_release=False (clipping inside opt.step()). "
                "Nothing has stepped in this backward")


@contextmanager
def counting(owner, attr: str) -> Iterator[None]:
    """``owner.<attr>`` one higher while the block runs (blocks nest)."""
    setattr(owner, attr, getattr(owner, attr) + 1)
    try:
        yield
    finally:
        setattr(owner, attr, getattr(owner, attr) - 1)


class NormPass:
    """The measuring hooks of one optimizer's release, and the clip factor they measured."""

    def __init__(self, stepper):
        self._stepper = weakref.ref(stepper)
        self.handles = WeakIdKeyDictionary()  # param -> its hook's handle
        self.measuring = 0
        self.backward = Backward(self._measured)  # the measuring backward running (one inside it is part of it)
        self.kept: dict[int, Tensor] = {}  # id(param) -> its grad before this backward, while it accumulates
        self.norms: dict[int, tuple | None] = {}  # id(param) -> its (key, norm), None if empty, in this window
        self.factor: Tensor | None = None  # the measured window's clip factor, until ``step()`` ends it

    def hook(self, params) -> None:
        for p in params:
            if p.requires_grad and p not in self.handles:
                self.handles[p] = p.register_hook(functools.partial(self._incoming, weakref.ref(p)))

    def remove(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()

    def end_window(self) -> None:
        """``step()`` or ``zero_grad()``: the measured norm served its window."""
        self.factor = None
        self.norms = {}
        self.kept.clear()

    @contextmanager
    def measure(self) -> Iterator[None]:
        try:
            with counting(self, "measuring"):
                yield
        finally:  # (a measuring backward that raised never reached ``_measured``: its copies must not outlive it)
            if not self.measuring:
                self.kept.clear()

    def _incoming(self, ref, grad: Tensor) -> None:
        """Before accumulation (this hook runs first of the param's grad hooks): a grad already there is kept."""
        p = ref()
        if self.measuring and p is not None and p.grad is not None:
            self.kept[id(p)] = p.grad.clone()

    def accumulated(self, p: Tensor) -> bool:
        """Called by the release hook once ``p``'s grad is accumulated: True while measuring (no bucket then). The
        norm of that grad is taken, and the grad put back as it was before this backward."""
        if not self.measuring:
            return False
        if id(p) in self.norms:
            raise RuntimeError(f"{self._stepper().name}: {MEASURED_TWICE}")
        self.backward.starts()  # (each backward's end takes the window's norm so far: the last one counts)
        grad = p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype)  # (as ``opt.step()`` reads it)
        self.norms[id(p)] = clip.tensor_norm(grad)
        kept = self.kept.pop(id(p), None)
        if kept is None:
            p.grad = None
        else:
            p.grad.copy_(kept)
        return True

    def _measured(self) -> None:
        """The end of the measuring backward: the norm of the grads this window steps on, in ``opt.step()``'s order
        (a param the pass did not reach counts with the grad it holds), and its clip factor."""
        self.kept.clear()
        stepper = self._stepper()
        norms = self.norms
        if stepper is None:
            return
        keyed, first = [], None
        for group in stepper.groups:
            for p in group["params"]:
                measured = id(p) in norms
                if not measured and p.grad is None:
                    continue
                if first is None:
                    first = p.device
                grad = None if measured else p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype)
                entry = norms[id(p)] if measured else clip.tensor_norm(grad)
                if entry is not None:
                    keyed.append(entry)
        total = clip.total_norm(keyed, first)
        stepper.last_grad_norm = total
        self.factor = clip.clip_factor(total, stepper.settings.max_grad_norm)

    def take_factor(self) -> Tensor:
        """The factor a released bucket's grads are multiplied by (refused where none was measured)."""
        if self.factor is None:
            raise RuntimeError(f"{self._stepper().name}: {NOT_MEASURED}")
        return self.factor
