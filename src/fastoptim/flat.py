"""Flat-buffer mode: a group's params, grads and states live in one contiguous buffer per (device, dtype).

Each param's ``.data`` and ``.grad`` become views into the buffers, so autograd accumulates into the
flat grad buffer in place, ``zero_grad()`` is one memset, and a step is one elementwise pass over a
single tensor per state. The per-param state dict keeps views too, so ``state_dict()`` is unchanged.

With 8/4-bit state the params whose states are quantized (block-wise, per param: ``storage``) are put
first in the buffers; their quantized states are views of one codes buffer and one absmax buffer per state
(so the kernel's check that no state moved reads a few addresses, not thousands). The rest (small or 1-D
params, plain state) follow, so their states are one buffer over the tail and still step in one pass. 16-bit
states are one bf16 buffer.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from . import storage
from .bulk import all_set_to, set_to as same_layout


class GradViews(list):
    """Grad views of a flat buffer, one list object for as long as they stay the same views (a level may keep
    what it worked out from them while it gets this very object; holding it keeps nothing else alive)."""


class FlatBucket:
    def __init__(self, params: list[Tensor], first: Callable[[Tensor], bool] | None = None):
        """``first(p)``: whether ``p`` goes to the front of the buffers (its states are kept apart)."""
        self.check(params)
        if first is not None:
            params = sorted(params, key=lambda p: not first(p))  # stable: the group's order otherwise
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
        self.grad_views = grad_views  # the grads' views, one per param: handed to the params as their .grad
        self._grad_layouts = self.views(self.grad_buffer)  # the same, never handed out: what a .grad must match
        self.param_views = param_views
        self._head_grads: tuple[int, list[Tensor]] | None = None
        self._where = self.addresses()
        self.state_buffers: dict[str, Tensor] = {}  # each over the params from its start on
        self._state_views: dict[str, list[Tensor | None]] = {}
        self._state_layouts: dict[str, tuple[int, torch.dtype]] = {}  # name -> (first param, dtype)
        self._pools: dict[str, tuple[tuple, list, tuple[Tensor, Tensor]]] = {}  # name -> (formats, states, buffers)

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

    def views(self, buffer: Tensor, start: int = 0) -> list[Tensor]:
        """Views of ``buffer`` as the params from ``start`` on."""
        return [v.view(p.shape) for v, p in zip(buffer.split(self.numels[start:]), self.params[start:])]

    def offset(self, start: int) -> int:
        """Where param ``start`` begins in the param and grad buffers."""
        return sum(self.numels[:start])

    def state_views(self, name: str, start: int = 0, dtype: torch.dtype | None = None) -> list[Tensor | None]:
        """Per param, its view of one state's flat buffer, which holds the params from ``start`` on in
        ``dtype`` (the params' by default); None for the params before ``start``. Made on first use, and anew
        when ``start`` or ``dtype`` change (the step plan fills a view before a param's state uses it). The
        same view objects every call: the plan tells by identity whether a param's state still is its view."""
        layout = (start, dtype or self.dtype)
        views = self._state_views.get(name)
        if views is None or self._state_layouts[name] != layout:
            buffer = self.state_buffers[name] = torch.zeros(self.param_buffer.numel() - self.offset(start),
                                                            dtype=layout[1], device=self.device)
            views = self._state_views[name] = [None] * start + self.views(buffer, start)
            self._state_layouts[name] = layout
        return views

    def pooled_states(self, name: str, formats: list) -> list:
        """Per param at the buffers' head, its quantized state ``name`` in ``formats[i]`` (None: not quantized
        here), the codes and absmax of them all views of one buffer each (``storage.pooled``): the kernel's
        check that no state moved then reads two addresses instead of two per param. Made on first use and anew
        when the formats change; the same objects every call (the plan tells by identity whether a param's
        state still is its pooled one, and copies a replaced one in, as it does into the tail's buffers)."""
        layout = tuple(formats)
        pool = self._pools.get(name)
        if pool is None or pool[0] != layout:
            states, buffers = storage.pooled([p.shape for p in self.params[:len(formats)]], formats, self.device)
            pool = self._pools[name] = (layout, states, buffers)
        return pool[1]

    def pool(self, name: str) -> tuple[Tensor, Tensor] | None:
        """The codes and absmax buffers that the head params' quantized states ``name`` are views of."""
        pool = self._pools.get(name)
        return None if pool is None else pool[2]

    def pool_buffers(self) -> tuple[Tensor, ...]:
        """Every codes and absmax buffer of the pooled states."""
        return tuple(buffer for _, _, buffers in self._pools.values() for buffer in buffers)

    def head_grads(self, start: int) -> list[Tensor]:
        """The grad views of the first ``start`` params, as one list object for as long as the views stay the
        same (``repair_grads`` makes a new view, and a new list, for any it finds changed): a level may keep what
        it worked out from them (addresses, layouts) while it gets this very list and the plan still holds."""
        if self._head_grads is None or self._head_grads[0] != start:
            self._head_grads = (start, GradViews(self.grad_views[:start]))
        return self._head_grads[1]

    def addresses(self) -> tuple[int, int]:
        return self.param_buffer.data_ptr(), self.grad_buffer.data_ptr()

    def intact(self) -> bool:
        """Whether every param's data still is its view of the buffer (one C++ pass: ``p.data = ...``,
        ``p.t_()`` or a resize since, even at the same address, make it False), and the buffers lie where they
        did when the plan was made (``share_memory()`` moves a storage, views and all, in place)."""
        return self.addresses() == self._where and all_set_to(self.params, self.param_views)

    def settle(self) -> None:
        """A plan was made on the buffers as they lie now."""
        self._where = self.addresses()

    def rehome(self) -> None:
        """Make the params views of the buffer again: a deep copy clones each Parameter on its own, and a
        user may have replaced ``p.data`` (its new values are copied in)."""
        self.param_views = self.views(self.param_buffer)
        for p, view in zip(self.params, self.param_views):
            if not same_layout(p, view):
                view.copy_(p.detach().clone())  # cloned: p may lie on the view's own memory (p.t_())
                p.data = view
        self._grad_layouts = self.views(self.grad_buffer)
        for name, buffer in self.state_buffers.items():
            start = self._state_layouts[name][0]
            self._state_views[name] = [None] * start + self.views(buffer, start)
        self.repair_grads()

    def repair_grads(self) -> None:
        """Each ``.grad`` lies on its part of the grad buffer as its view does; where not (a ``.grad`` replaced,
        None, or re-laid or re-pointed in place: ``p.grad.t_()``, ``p.grad.data = x``), its values go into the
        buffer (None counts as zeros) and the param gets a new view."""
        if all_set_to(self.params, self._grad_layouts, grads=True):  # the common case, in one C++ pass
            return
        for i, (p, layout) in enumerate(zip(self.params, self._grad_layouts)):
            g = p.grad
            if same_layout(g, layout):
                continue
            view = self.grad_views[i] = layout.view(layout.shape)  # a new view: the old one may be re-laid
            if g is None:
                view.zero_()
            else:
                view.copy_(g.detach().clone())  # cloned: g may lie on the view's own memory (p.grad.t_())
            p.grad = view
            self._head_grads = None
