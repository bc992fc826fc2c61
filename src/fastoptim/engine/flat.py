"""Flat-buffer mode: a group's params, grads and states live in one contiguous buffer per (device, dtype).

Each param's ``.data``, its ``.grad`` and each of its states is an *alias* of its part of a buffer: a tensor
with a storage of its own that lies on the buffer's memory (``alias``). A step is one elementwise pass over
a single tensor per state, yet a model's own checkpointing sees one storage per param holding exactly its
bytes: safetensors refuses tensors that share a storage without covering it (``save_model`` raises,
accelerate's ``save_state`` drops them), and pickle writes a view's whole storage.

Grads are torch.optim's: a param's ``.grad`` is its grad alias or None. ``zero_grad()`` sets them to None (or,
``set_to_none=False``, zeroes the buffer with one memset), and a param whose grad is None is not stepped. A
hook on each param points a None ``.grad`` at its zeroed alias just before autograd accumulates, so a backward
after ``model.zero_grad()`` (what trainers call) accumulates into the buffer in place as well.

With 8/4-bit state the params whose states are quantized (block-wise, per param: ``storage``) are put
first in the buffers; their quantized states are views of one codes buffer and one absmax buffer per state
(so the kernel's check that no state moved reads a few addresses, not thousands). The rest (small or 1-D
params, plain state) follow, so their states are one buffer over the tail and still step in one pass. 16-bit
states are one bf16 buffer.
"""

from __future__ import annotations

import math
import operator
import weakref
from functools import partial
from typing import Callable

import torch
from torch import Tensor
from torch.utils.dlpack import to_dlpack

from .. import storage
from ..native.bulk import all_set_to, layouts, set_to as same_layout, with_grads
from ..eager import eager
from ..paths.base import GradViews


def alias(buffer: Tensor, start: int, shape: torch.Size) -> Tensor:
    """``buffer[start:start + n].view(shape)`` with a storage of its own: it starts at the view's first byte,
    holds exactly its bytes, writes through to the buffer and keeps the buffer alive (DLPack's deleter)."""
    return torch.from_dlpack(to_dlpack(buffer[start:start + math.prod(shape)].view(shape)))


@eager  # a backward run from a compiled function would trace it, once per param (index guards)
def _point_grad(bucket_ref: weakref.ref, index: int, grad_outputs: tuple) -> None:
    """Runs before autograd accumulates a param's grad (a pre-hook of its AccumulateGrad node, which runs in a
    backward and not in ``torch.autograd.grad``): see ``FlatBucket.point_grad``. Holds its bucket weakly: the
    hook keeps no optimizer alive, and does nothing once it is gone."""
    bucket = bucket_ref()
    if bucket is not None:
        bucket.point_grad(index)


class FlatBucket:
    def __init__(self, params: list[Tensor], first: Callable[[Tensor], bool] | None = None):
        """``first(p)``: whether ``p`` goes to the front of the buffers (its states are kept apart)."""
        self.check(params)
        if first is not None:
            params = sorted(params, key=lambda p: not first(p))  # stable: the group's order otherwise
        self.params = params
        self._make_buffers()
        for p, pv, gv in zip(params, self.param_views, self.grad_views):
            pv.copy_(p.detach())
            if p.grad is not None:  # a param without a grad keeps none, as torch.optim leaves it
                gv.copy_(p.grad)
                p.grad = gv
            p.data = pv
        self._zeroed = [p.grad is None for p in params]
        self._hook_params()

    def _make_buffers(self) -> None:
        p0 = self.params[0]
        self.numels = [p.numel() for p in self.params]
        # each param starts 16 bytes aligned (the kernels' vector loads, where params step apart: some grads None);
        # the gaps are zeros that step as zeros and are never read
        unit = max(1, 16 // p0.element_size())
        self._starts = [0]
        for n in self.numels:
            self._starts.append(self._starts[-1] + -(-n // unit) * unit)
        self.param_buffer = torch.zeros(self._starts[-1], dtype=p0.dtype, device=p0.device)
        self.grad_buffer = torch.zeros(self._starts[-1], dtype=p0.dtype, device=p0.device)
        self.param_views = self.views(self.param_buffer)  # what each p.data is set to (never handed out)
        self.grad_views = self.views(self.grad_buffer)  # the grads' aliases, one per param: handed out as .grad
        self._grad_layouts = [g.view(g.shape) for g in self.grad_views]  # the same, never handed out: what a .grad must match
        self._head_grads: tuple[int, list[Tensor]] | None = None
        self.state_buffers: dict[str, Tensor] = {}  # each over the params from its start on
        self._state_views: dict[str, list[Tensor | None]] = {}
        self._state_layouts: dict[str, tuple[int, torch.dtype]] = {}  # name -> (first param, dtype)
        self._pools: dict[str, tuple[tuple, list, tuple[Tensor, Tensor]]] = {}  # name -> (formats, states, buffers)
        self._hooks: list = []
        # per param, whether its part of the grad buffer is known to hold zeros while its grad is None (then a hook
        # points the grad there without a memset of its own); one memset of the whole buffer makes them all so
        self._zeroed = [True] * len(self.params)
        self._memset_tried = False  # since the last step: whether a hook looked for every grad None
        self._watch()
        self.settle()

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
        """Aliases of ``buffer`` (which holds the params from ``start`` on) as those params."""
        base = self._starts[start]
        return [alias(buffer, self._starts[i] - base, p.shape) for i, p in enumerate(self.params[start:], start)]

    def offset(self, start: int) -> int:
        """Where param ``start`` begins in the param and grad buffers."""
        return self._starts[start]

    # --- the aliases' memory: share_memory_() moves an alias's storage (only it) off the buffer ------------------

    def _watch(self) -> None:
        """Remember where every alias lies (what ``moved`` compares with)."""
        self._watched = [*self.param_views, *self._grad_layouts,
                         *(v for views in self._state_views.values() for v in views if v is not None)]
        self._watched_at = layouts(self._watched, shapes=False)
        self._counted = self._holders()

    def _holders(self) -> tuple[int, ...]:
        """How many tensors hold each buffer's memory. Each alias holds a view of its buffer until its storage lets
        go of that memory (``share_memory_()`` moves it): so the counts stay while no alias moved, and one look
        at them each step stands for a look at thousands of aliases (``moved``)."""
        return tuple(_use_count(b.untyped_storage()._cdata)
                     for b in (self.param_buffer, self.grad_buffer, *self.state_buffers.values()))

    def moved(self) -> bool:
        """Whether some alias's memory moved off the buffer (``share_memory_()`` on a param, grad or state)."""
        return layouts(self._watched, shapes=False) != self._watched_at

    def realias(self) -> None:
        """New aliases for those whose memory moved: the param, grad or state still on the moved memory is then
        no longer its alias, and is copied back in as a replaced one is (``rehome``, ``repair_grads``, the plan)."""
        if self._holders() == self._counted:
            return
        if not self.moved():  # other views of a buffer came or went (a level's cache): none moved
            self._counted = self._holders()
            return
        now, then = _addresses(layouts(self._watched, shapes=False)), _addresses(self._watched_at)
        moved = {id(t) for t, a, b in zip(self._watched, now, then) if a != b}
        for i, p in enumerate(self.params):
            begin = self._starts[i]
            if id(self.param_views[i]) in moved:
                self.param_views[i] = alias(self.param_buffer, begin, p.shape)
            if id(self._grad_layouts[i]) in moved:
                self._zeroed[i] = False
                self.grad_views[i] = alias(self.grad_buffer, begin, p.shape)
                self._grad_layouts[i] = self.grad_views[i].view(p.shape)
                self._head_grads = None
            for name, views in self._state_views.items():
                if views[i] is not None and id(views[i]) in moved:
                    views[i] = alias(self.state_buffers[name], begin - self._starts[self._state_layouts[name][0]],
                                     p.shape)
        self._watch()

    # --- states ----------------------------------------------------------------------------------------------

    def state_views(self, name: str, start: int = 0, dtype: torch.dtype | None = None) -> list[Tensor | None]:
        """Per param, its alias of one state's flat buffer, which holds the params from ``start`` on in
        ``dtype`` (the params' by default); None for the params before ``start``. Made on first use, and anew
        when ``start`` or ``dtype`` change (the step plan fills a view before a param's state uses it). The
        same alias objects every call: the plan tells by identity whether a param's state still is its view."""
        layout = (start, dtype or self.dtype)
        views = self._state_views.get(name)
        if views is None or self._state_layouts[name] != layout:
            buffer = self.state_buffers[name] = torch.zeros(self._starts[-1] - self.offset(start),
                                                            dtype=layout[1], device=self.device)
            views = self._state_views[name] = [None] * start + self.views(buffer, start)
            self._state_layouts[name] = layout
            self._watch()
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

    # --- params and grads ------------------------------------------------------------------------------------

    def head_grads(self, start: int) -> list[Tensor]:
        """The grad aliases of the first ``start`` params, as one list object for as long as they stay the same
        (``repair_grads`` makes a new alias object, and a new list, for any it finds changed): a level may keep
        what it worked out from them (addresses, layouts) while it gets this very list and the plan still holds."""
        if self._head_grads is None or self._head_grads[0] != start:
            self._head_grads = (start, GradViews(self.grad_views[:start]))
        return self._head_grads[1]

    def addresses(self) -> tuple[int, int]:
        return self.param_buffer.data_ptr(), self.grad_buffer.data_ptr()

    def intact(self) -> bool:
        """Whether every param's data still is its alias of the buffer (one C++ pass: ``p.data = ...``,
        ``p.t_()`` or a resize since, even at the same address, make it False), and no alias moved since the
        plan was made (``repair_grads``, run first in every step, makes anew any that moved)."""
        return (self.addresses() == self._where and self._watched_at is self._settled_at
                and all_set_to(self.params, self.param_views))

    def settle(self) -> None:
        """A plan was made on the buffers and aliases as they lie now."""
        self._where = self.addresses()
        self._settled_at = self._watched_at

    def rehome(self) -> None:
        """Make the params aliases of the buffer again where they are not (``p.data`` replaced, or its memory
        moved): their values are copied in."""
        self.realias()
        for p, view in zip(self.params, self.param_views):
            if not same_layout(p, view):
                view.copy_(p.detach().clone())  # cloned: p may lie on the view's own memory (p.t_())
                p.data = view
        self.repair_grads()
        self._hook_params()

    def repair_grads(self) -> bool:
        """Each ``.grad`` that is not None lies on its part of the grad buffer as its alias does; where not (a
        ``.grad`` replaced, re-laid or re-pointed in place: ``p.grad.t_()``, ``p.grad.data = x``, or its memory
        moved), its values go into the buffer and the param gets a new alias. A None grad stays None. Returns
        whether every param has a grad (then the whole grad buffer is this step's grads)."""
        self._memset_tried = False
        if all_set_to(self.params, self._grad_layouts, grads=True) and self._holders() == self._counted:
            return True  # the common case, in one C++ pass
        self.realias()
        index = self._index()
        present, grads, _, _ = with_grads(self.params)
        if all_set_to(present, [self._grad_layouts[index[id(p)]] for p in present], grads=True):
            return len(present) == len(self.params)  # some grads None, the others in place
        for p, g in zip(present, grads):
            i = index[id(p)]
            layout = self._grad_layouts[i]
            if same_layout(g, layout):
                continue
            view = self.grad_views[i] = layout.view(layout.shape)  # a new one: the old one may be re-laid
            view.copy_(g.detach().clone())  # cloned: g may lie on the view's own memory (p.grad.t_())
            p.grad = view
            self._zeroed[i] = False
            self._head_grads = None
        return len(present) == len(self.params)

    def _index(self) -> dict[int, int]:
        index = self.__dict__.get("_index_of")
        if index is None:
            index = self._index_of = {id(p): i for i, p in enumerate(self.params)}
        return index

    def zero_grads(self, set_to_none: bool) -> None:
        """torch.optim's ``zero_grad``: every grad None, or (``set_to_none=False``) each grad that is not None
        zeroed: one memset of the buffer, after any replaced grad is put back on it."""
        if set_to_none:
            for p in self.params:
                p.grad = None
            self._memset_tried = False
            return
        self.repair_grads()
        self.grad_buffer.zero_()

    def point_grad(self, i: int) -> None:
        """Param ``i``'s grad is about to be accumulated: where it is None and the param still is this buffer's,
        its grad becomes its zeroed alias, so autograd accumulates into the buffer in place (not into a new
        tensor that the step would have to copy in). After ``model.zero_grad()`` the first such hook finds every
        grad None and zeroes the whole buffer with one memset instead of one per param."""
        p = self.params[i]
        if p.grad is not None or p.dtype != self.dtype:
            return
        if self.grad_views[i].data_ptr() != self.grad_buffer.data_ptr() + self._starts[i] * p.element_size():
            self.realias()  # its memory moved (share_memory_()) holding old grads, which no memset here reaches
        if not p.is_set_to(self.param_views[i]):
            return
        view, layout = self.grad_views[i], self._grad_layouts[i]
        if not view.is_set_to(layout):  # the alias handed out was re-laid (p.grad.t_()) before it was set to None
            view = self.grad_views[i] = layout.view(layout.shape)
            self._head_grads = None
        if not self._zeroed[i] and not self._memset_tried:
            self._memset_tried = True  # (once between steps: a backward with some grads there zeroes each)
            if not with_grads(self.params)[0]:
                self.grad_buffer.zero_()
                self._zeroed = [True] * len(self.params)
        if self._zeroed[i]:
            self._zeroed[i] = False  # autograd writes it now
        else:
            view.zero_()
        p.grad = view

    def _hook_params(self) -> None:
        """A pre-hook (``point_grad``) on the AccumulateGrad node of each param that takes grads. The bucket holds
        the nodes, so every graph uses these very nodes (a param holds its node weakly); the hooks go with the
        bucket. Made anew where a param's node changed (``p.data`` of another layout resets it)."""
        with torch.enable_grad():
            nodes = [p.view_as(p).grad_fn.next_functions[0][0] if p.requires_grad else None for p in self.params]
        held = self.__dict__.get("_nodes")
        if held is not None and len(held) == len(nodes) and all(map(operator.is_, held, nodes)):
            return
        _remove_hooks(self._hooks)
        me = weakref.ref(self)
        self._hooks += [node.register_prehook(partial(_point_grad, me, i)) for i, node in enumerate(nodes)
                        if node is not None]
        if "_nodes" not in self.__dict__:
            weakref.finalize(self, _remove_hooks, self._hooks)  # (the list is kept, its handles change)
        self._nodes = nodes

    # --- pickling: each alias pickles its own bytes; the buffers are made anew and the values copied in ---------

    def __getstate__(self) -> dict:
        return {"params": self.params}

    def __setstate__(self, state: dict) -> None:
        """The params come back on memory of their own (and the states in the optimizer's state, the plan copies
        them in at the next step): new buffers, values copied in by ``rehome`` (the optimizer's ``__setstate__``)."""
        self.params = state["params"]
        self._make_buffers()
        self._settled_at = None  # no plan holds: the first step makes one


_use_count = torch._C._storage_Use_Count


def _addresses(found) -> list[int]:
    """``bulk.layouts(..., shapes=False)`` as a list of addresses (the C++ pass gives their bytes)."""
    return list(memoryview(found).cast("q")) if isinstance(found, bytes) else list(found)


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
