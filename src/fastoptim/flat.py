"""Flat-buffer mode: a group's params, grads and states live in one contiguous buffer per (device, dtype).

Each param's ``.data`` and ``.grad`` become views into the buffers, so autograd accumulates into the
flat grad buffer in place, ``zero_grad()`` is one memset, and a step is one elementwise pass over a
single tensor per state. The per-param state dict keeps views too, so ``state_dict()`` is unchanged.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

_grad = operator.attrgetter("grad")


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors lie on the same memory the same way (address, strides and shape)."""
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


class FlatBucket:
    def __init__(self, params: list[Tensor]):
        self.check(params)
        self.params = params
        p0 = params[0]
        self.numels = [p.numel() for p in params]
        total = sum(self.numels)
        self.param_buffer = torch.empty(total, dtype=p0.dtype, device=p0.device)
        self.grad_buffer = torch.zeros(total, dtype=p0.dtype, device=p0.device)
        param_views, grad_views = self.views(self.param_buffer), self.views(self.grad_buffer)
        for p, pv, gv in zip(params, param_views, grad_views):
            pv.copy_(p.detach())
            if p.grad is not None:
                gv.copy_(p.grad)
            p.data = pv
            p.grad = gv
        self.grad_views = grad_views
        self.param_views = param_views
        self.state_buffers: dict[str, Tensor] = {}
        self._state_views: dict[str, list[Tensor]] = {}

    @staticmethod
    def check(params: list[Tensor]) -> None:
        """What flat mode needs of a bucket's params (raised before anything is moved)."""
        p0 = params[0]
        if any(type(p.data) is not torch.Tensor for p in params):
            raise ValueError("flat=True needs plain tensors; sharded (DTensor, FSDP2) params keep flat=False")
        if not (p0.is_floating_point() and all(p.dtype == p0.dtype and p.device == p0.device for p in params)):
            raise ValueError("flat=True needs real floating-point params of one dtype and device per bucket")

    @property
    def device(self) -> torch.device:
        return self.param_buffer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.param_buffer.dtype

    def views(self, buffer: Tensor) -> list[Tensor]:
        return [v.view(p.shape) for v, p in zip(buffer.split(self.numels), self.params)]

    def state_views(self, name: str) -> list[Tensor]:
        """The per-param views of one state's flat buffer (made on first use; the step plan fills a view
        before a param's state uses it). The same view objects every call: the plan tells by identity
        whether a param's state still is its view."""
        views = self._state_views.get(name)
        if views is None:
            buffer = self.state_buffers[name] = torch.zeros_like(self.param_buffer)
            views = self._state_views[name] = self.views(buffer)
        return views

    def rehome(self) -> None:
        """Make the params views of the buffer again: a deep copy clones each Parameter on its own, and a
        user may have replaced ``p.data`` (its new values are copied in)."""
        self.param_views = self.views(self.param_buffer)
        for p, view in zip(self.params, self.param_views):
            if not same_layout(p, view):
                view.copy_(p.detach().clone())  # cloned: p may lie on the view's own memory (p.t_())
                p.data = view
        if any(v.data_ptr() != w.data_ptr() for v, w in zip(self.grad_views, self.views(self.grad_buffer))):
            self.grad_views = self.views(self.grad_buffer)
        for name, buffer in self.state_buffers.items():
            self._state_views[name] = self.views(buffer)
        self.repair_grads()

    def repair_grads(self) -> None:
        """Put the views back where the user replaced a ``.grad`` (None counts as zeros)."""
        if not any(map(operator.is_not, map(_grad, self.params), self.grad_views)):
            return  # the common case, checked at C speed
        for p, view in zip(self.params, self.grad_views):
            g = p.grad
            if g is not view:
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
                p.grad = view
