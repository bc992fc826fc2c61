"""The torch.optim surface's part of gradient release (``gradient_release=True``): the methods users call on the
optimizer; the driver itself is ``engine.release``."""

from __future__ import annotations

from contextlib import nullcontext

from .engine import release_ddp


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
