"""Exact global-norm clipping with gradient release: a first backward measures the norm, the second one steps.

    with opt.measure_grad_norm():
        loss.backward(retain_graph=True)  # measures the norm of the grads this backward would leave; keeps none
    loss.backward()                       # steps each bucket, its grads times the clip factor of that norm
    opt.step()                            # (steps what has a grad left, by the same factor; ends the window)

The clip factor needs every grad, and release frees each grad as its bucket steps: so the norm is taken in a
backward of its own. There, a hook on each param sees the grad about to be accumulated, takes the norm of what the
param's grad would then be (its grad so far plus the incoming one, as accumulation adds them), and hands
accumulation ``-0.0`` in its place: adding ``-0.0`` changes no value (``x + -0.0 == x`` for every float, signed
zeros and NaN included), and a grad the pass had to create is set back to None. The norms are combined as
``clip.grad_norm`` combines them for ``opt.step()``, in the same order: the factor is the ordinary step's, bit for bit.

Cost: one more backward per optimizer step (about a third more compute than forward plus backward, less where the
graph is recomputed anyway); memory: the graph is kept from the first backward to the second (as it is kept at the
start of any backward), and one param-sized temporary at a time. Without a measured norm a released bucket with
``max_grad_norm`` refuses to step (before anything changed), so clipping is never skipped in silence.
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor

from .. import clip

NOT_MEASURED = ("max_grad_norm with gradient_release=True: the global grad norm of this step was not measured, and a "
                "released bucket cannot be clipped without it. Measure it in a backward of its own first:\n"
                "    with opt.measure_grad_norm():\n        loss.backward(retain_graph=True)\n    loss.backward()\n"
                "or choose max_grad_norm=None (no clipping), or gradient_release=False (clipping inside opt.step()). "
                "Nothing has stepped in this backward")


class NormPass:
    """The measuring hooks of one optimizer's release, and the clip factor they measured."""

    def __init__(self, opt):
        self._opt = weakref.ref(opt)
        self.handles: dict[int, object] = {}
        self.measuring = 0
        self.queued_for = None
        self.norms: dict[int, tuple] = {}  # id(param) -> (param, (key, norm) or None) of this pass
        self.created: set[int] = set()  # params whose grad this pass created (set back to None)
        self.factor: Tensor | None = None  # the measured window's clip factor, until ``step()`` ends it

    def hook(self, params) -> None:
        for p in params:
            if id(p) not in self.handles and p.requires_grad:
                self.handles[id(p)] = p.register_hook(functools.partial(self._incoming, weakref.ref(p)))

    def remove(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()

    @contextmanager
    def measure(self) -> Iterator[None]:
        self.measuring += 1
        try:
            yield
        finally:
            self.measuring -= 1

    def _incoming(self, ref, grad: Tensor) -> Tensor | None:
        p = ref()
        if not self.measuring or p is None:
            return None
        task = torch._C._current_graph_task_id()
        if self.queued_for != task:
            torch.autograd.Variable._execution_engine.queue_callback(self._measured)
            self.queued_for, self.norms = task, {}
        if p.grad is None:
            self.created.add(id(p))
            total = grad
        else:
            total = p.grad + grad  # what accumulation will leave (in place: the same sum)
        self.norms[id(p)] = (p, clip.tensor_norm(total))
        return torch.tensor(-0.0, dtype=grad.dtype, device=grad.device).expand_as(grad)

    def accumulated(self, p: Tensor) -> bool:
        """Called by the release hook: True while measuring (no bucket then); a grad this pass made goes."""
        if not self.measuring:
            return False
        if id(p) in self.created:
            self.created.discard(id(p))
            p.grad = None
        return True

    def _measured(self) -> None:
        """The end of the measuring backward: the norm of the grads this window steps on, in ``opt.step()``'s order
        (a param the pass did not reach counts with the grad it holds), and its clip factor."""
        self.queued_for = None
        opt = self._opt()
        norms, self.norms = self.norms, {}
        if opt is None:
            return
        keyed, first = [], None
        for group in opt.param_groups:
            for p in group["params"]:
                found = norms.get(id(p))
                if found is None and p.grad is None:
                    continue
                if first is None:
                    first = p.device
                entry = found[1] if found is not None else clip.tensor_norm(p.grad)
                if entry is not None:
                    keyed.append(entry)
        total = clip.total_norm(keyed, first)
        opt.last_grad_norm = total
        self.factor = clip.clip_factor(total, opt.max_grad_norm)

    def take_factor(self) -> Tensor:
        """The factor a released bucket's grads are multiplied by (refused where none was measured)."""
        if self.factor is None:
            opt = self._opt()
            raise RuntimeError(f"{type(opt).__name__}: {NOT_MEASURED}")
        return self.factor
