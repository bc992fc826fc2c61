"""Gradient release (``gradient_release=True``) under Lightning's automatic optimization.

Lightning runs the backward of each batch inside ``optimizer.step(closure)``, so release works there unchanged,
except when it accumulates: with ``accumulate_grad_batches=N``, the first N-1 micro-batches of a window run their
closure (training_step, zero_grad, backward) without ``optimizer.step``, and nothing global says so (where
accelerate's ``sync_gradients`` does). A released optimizer would step on each of them; it refuses the second
backward of the window instead (``engine.release.RELEASED_TWICE``), once the first has moved the params. This callback
tells it, so that the run equals the run without release, bit for bit::

    import fastoptim.integrations.lightning
    trainer = pl.Trainer(accumulate_grad_batches=4, callbacks=[fastoptim.integrations.lightning.GradientRelease()])

Around each backward that Lightning accumulates (the test its loop asks, ``fit_loop._should_accumulate()``, set
before the batch's forward), every released fastoptim optimizer of the trainer is held in ``opt.accumulating()``;
the window's last backward steps on the sum. When fit starts it refuses what release cannot do exactly: the
trainer's clipping (``gradient_clip_val``: the grads are freed before Lightning clips them), a GradScaler
(``16-mixed``: it unscales and checks for inf after backward) and a strategy that accumulates by itself. With no
released optimizer it does nothing. The module imports Lightning (``lightning.pytorch``); fastoptim never imports it.
"""

from __future__ import annotations

from contextlib import ExitStack

import lightning.pytorch as pl

from ..optimizer import FastOptimizer


def released_optimizers(trainer: pl.Trainer) -> list[FastOptimizer]:
    return [opt for opt in trainer.optimizers if isinstance(opt, FastOptimizer) and opt.gradient_release]


class GradientRelease(pl.Callback):
    """Holds the released optimizers' step through the backward of each micro-batch Lightning accumulates."""

    def __init__(self):
        self._held = ExitStack()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        released = released_optimizers(trainer)
        if not released:
            return
        name = type(released[0]).__name__
        if trainer.gradient_clip_val:
            raise ValueError(f"{name} with gradient_release=True and Trainer(gradient_clip_val="
                             f"{trainer.gradient_clip_val}): each bucket's grads are freed inside backward, before "
                             "Lightning clips, so it would clip nothing. Use gradient_clip_val=None, or "
                             "gradient_release=False (then clip by the trainer or by the optimizer's max_grad_norm)")
        if trainer.scaler is not None:
            raise ValueError(f"{name} with gradient_release=True and a GradScaler (precision={trainer.precision!r}): "
                             "the buckets step inside backward, before the scaler unscales the grads and checks them "
                             "for inf. Use precision='bf16-mixed' or '32', or gradient_release=False")
        if trainer.strategy.handles_gradient_accumulation:
            raise ValueError(f"{name} with gradient_release=True under {type(trainer.strategy).__name__}, which "
                             "accumulates grads itself: release cannot see its accumulation. Use "
                             "gradient_release=False")
        if not hasattr(trainer.fit_loop, "_should_accumulate"):  # (Lightning's own test, private: refuse, never guess)
            raise RuntimeError("fastoptim's GradientRelease needs Lightning's fit_loop._should_accumulate() "
                               f"(Lightning 2.x); lightning {pl.__version__} has none")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss) -> None:
        self._held.close()
        if pl_module.automatic_optimization and trainer.fit_loop._should_accumulate():
            for opt in released_optimizers(trainer):
                self._held.enter_context(opt.accumulating())

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._held.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._held.close()  # (a backward that raised: no on_after_backward)
