"""The optimizer's part of gradient release (``gradient_release=True``): the methods users call on the optimizer,
and those of its own that release needs (a bucket's step, the checks before a backward's first bucket and before
``zero_grad()``); the driver itself is ``engine.release``."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from .engine import plan, release, release_ddp, release_state


class GradientRelease:
    """Mixed into ``FastOptimizer`` (which sets ``_release``: the ``engine.release.Release``, or None)."""

    @property
    def gradient_release(self) -> bool:
        """Whether the step runs inside backward (``engine.release``)."""
        return self._release is not None

    def accumulating(self):
        """``with opt.accumulating(): loss.backward()``: with ``gradient_release`` this backward steps nothing (its
        grads add up; the next backward steps on the sum). Without it, a no-op."""
        return self._release.accumulating() if self._release is not None else nullcontext()

    def release_with(self, ddp_model) -> None:
        """``opt.release_with(DistributedDataParallel(model))``: with ``gradient_release``, each DDP bucket steps
        inside backward once its all-reduce is done, on the reduced grads (``engine.release_ddp``)."""
        release_ddp.tie(self, self._release, ddp_model)

    def measure_grad_norm(self):
        """``with opt.measure_grad_norm(): loss.backward(retain_graph=True)``, then ``loss.backward()``: the norm that
        ``gradient_release`` clips by with ``max_grad_norm``, measured exactly (``engine.release_norm``)."""
        if self._release is None or self.max_grad_norm is None:
            raise RuntimeError(f"{type(self).__name__}.measure_grad_norm() measures the norm that gradient_release=True "
                               f"clips by; this optimizer has gradient_release={self._release is not None}, "
                               f"max_grad_norm={self.max_grad_norm}: clip in opt.step()")
        self._release.rehook()  # (hooks for params unfrozen since; the window's norms start anew)
        return self._release.measuring().measure()

    # --- what FastOptimizer's own methods call ---------------------------------------------------------------

    @torch.no_grad()
    def _release_step(self, params: list[Tensor]) -> list[Tensor]:
        """A released bucket's step (``engine.release``), as ``step()`` steps ``params``; returns those stepped."""
        self._resolve_skips()
        factor = None if self.max_grad_norm is None else self._release.measuring().take_factor()  # (or refused)
        chosen = self._release.by_group(self.param_groups, params)
        work = [self._collect(index, group, ps) for index, group, ps in chosen]  # validates
        self._run([(index, group) for index, group, _ in chosen], work, released=True, grad_mul=factor)
        return [p for _, _, ps in chosen for p in ps]

    def _check_groups(self) -> None:
        """Every group's hyper-parameters and storage settings, as a step checks them (release checks them all as
        a backward starts, before its first bucket steps); the states there are too, where they changed since."""
        for group in self.param_groups:
            self.rule.validate(group)
            self._check_storage(group)
        version = self._state.version
        if self._release.states_checked == version:
            return
        first = 0
        for group in self.param_groups:
            plan.check_states(self.rule.for_group(group), group, self._state, self._state_format, first)
            self._check_rounding_states(group["params"])
            first += len(group["params"])
        self._release.states_checked = version

    def _before_zero_grad(self, set_to_none: bool) -> None:
        """What release refuses of ``zero_grad()``, before anything changes; the freed grads it then forgets."""
        if self.__dict__.get("_release") is not None:
            self._release.zeroing(type(self).__name__)
        freed = release_state.FREED
        if freed:  # (grads released by this optimizer or an older one over its params)
            ids = {id(p) for group in self.param_groups for p in group["params"]} & freed
            if ids and not set_to_none:
                raise RuntimeError(f"{type(self).__name__}.{release.KEPT_ZEROS.format(n=len(ids))}")
            freed.difference_update(ids)
