"""Lightning with fastoptim: fit, checkpoint and resume equal a straight run; 32-bit equals torch.optim; gradient
release equals the run without it (with accumulation: through fastoptim.integrations.lightning's callback; under
strategy="ddp": tied to Lightning's DDP model, in lightning_ddp_worker.py)."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import fastoptim

from .kinds import KIND_NAMES, KINDS, TinyLM, tokens


@functools.cache
def lightning_module():
    """Lightning (imported by the first test that runs here, not at collection: the import takes seconds in
    every test process) and the LightningModule of these tests."""
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self, make_optimizer):
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyLM()
            self.make_optimizer = make_optimizer
            self.losses = []

        def training_step(self, batch, _):
            (ids,) = batch
            logits = self.model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return self.make_optimizer(self)

    return pl, Module


def fit(root, make_optimizer, precision="32", clip=None, resume=None, max_steps=6, device="cpu", callbacks=(),
        checkpoint=True, **trainer_args):
    pl, Module = lightning_module()
    module = Module(make_optimizer)
    # one epoch is 3 steps: the checkpoint at step 3 ends an epoch, so a resumed run sees the same batches
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens(12)), batch_size=4)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1,
                                               filename="{step}")
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu" if device == "cpu" else "gpu", devices=1, precision=precision,
                         gradient_clip_val=clip, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[checkpoints, *callbacks] if checkpoint else list(callbacks),
                         enable_checkpointing=checkpoint, num_sanity_val_steps=0, deterministic=True, **trainer_args)
    trainer.fit(module, data, ckpt_path=resume)
    return module


SETTINGS = [("32", None), ("bf16-mixed", 1.0)]


@pytest.mark.parametrize("precision,clip", SETTINGS, ids=["32", "bf16-mixed-clip"])
@pytest.mark.parametrize("kind", KIND_NAMES)
def test_fit_resume(kind, precision, clip, tmp_path, device):
    k = KINDS[kind]
    straight = fit(tmp_path, k.make, precision, clip, device=device)
    assert straight.losses[-1] < straight.losses[0]
    resumed = fit(tmp_path / "again", k.make, precision, clip, resume=str(tmp_path / "step=3.ckpt"),
                  device=device)
    assert len(resumed.losses) == 3
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    if k.torch_twin is not None and precision == "32":
        twin = fit(tmp_path / "torch", k.torch_twin, precision, clip, device=device)
        assert straight.losses == pytest.approx(twin.losses, rel=1e-5, abs=1e-6)


def _adamw(release: bool):
    return lambda module: fastoptim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01, gradient_release=release)


def test_gradient_release_equals_the_step_after_backward(tmp_path, device):
    """Lightning runs the closure (training_step, zero_grad, backward) inside optimizer.step: the buckets step in
    that backward, and the run equals the same run without release, bit for bit."""
    released = fit(tmp_path / "r", _adamw(True), device=device, checkpoint=False)
    ordinary = fit(tmp_path / "o", _adamw(False), device=device, checkpoint=False)
    assert released.losses == ordinary.losses
    for (name, a), b in zip(released.state_dict().items(), ordinary.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    opt = released.trainer.optimizers[0]
    assert opt._release.flushes > 0 and all(p.grad is None for p in released.parameters())


@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_gradient_release_accumulates_with_the_callback(accumulate, tmp_path, device):
    """accumulate_grad_batches > 1: the callback holds the step through the backward of each micro-batch Lightning
    accumulates (3 batches an epoch: windows of 2 leave a short one at the epoch's end, where Lightning steps)."""
    lightning_module()  # (skips where Lightning is missing: the callback's module imports it)
    from fastoptim.integrations.lightning import GradientRelease

    extra = dict(accumulate_grad_batches=accumulate, device=device, checkpoint=False)
    released = fit(tmp_path / "r", _adamw(True), callbacks=[GradientRelease()], **extra)
    ordinary = fit(tmp_path / "o", _adamw(False), **extra)
    assert released.losses == ordinary.losses
    for (name, a), b in zip(released.state_dict().items(), ordinary.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    opt = released.trainer.optimizers[0]
    assert opt.state_dict()["state"][0]["step"].item() == 6  # max_steps optimizer steps, not one per micro-batch
    assert opt._release.flushes > 0 and opt._release.paused == 0


def test_accumulating_without_the_callback_is_refused(tmp_path, device):
    """Without the callback, Lightning's first micro-batch of a window runs its backward outside optimizer.step and
    release steps it: the window's step refuses (by then the params have moved: the message says so)."""
    with pytest.raises(RuntimeError, match="second grad to step on.*GradientRelease"):
        fit(tmp_path, _adamw(True), accumulate_grad_batches=2, device=device, checkpoint=False)


@pytest.mark.parametrize("setting", ["clip", "grad_scaler"])
def test_the_callback_refuses_what_release_cannot_do(setting, tmp_path, device):
    """When fit starts, before any step: gradient_clip_val (it would clip released, None, grads: nothing) and a
    GradScaler (it unscales and checks for inf after backward; the optimizer alone refuses it only after one)."""
    pl, _ = lightning_module()
    from fastoptim.integrations.lightning import GradientRelease

    if setting == "clip":
        extra, match = dict(clip=0.5), "gradient_clip_val=0.5.* clip nothing"
    else:  # (Lightning makes fp16 bf16 on the CPU: the plugin, as it is on a GPU)
        scaler = torch.amp.GradScaler(device)
        extra = dict(precision=None, plugins=[pl.plugins.MixedPrecision("16-mixed", device, scaler=scaler)])
        match = "GradScaler .*precision='16-mixed'"
    with pytest.raises(ValueError, match=match):
        fit(tmp_path, _adamw(True), callbacks=[GradientRelease()], device=device, checkpoint=False, **extra)


@pytest.mark.slow
def test_gradient_release_tied_to_lightnings_ddp_model(tmp_path):
    """strategy="ddp", two CPU processes (gloo): configure_optimizers runs after Lightning wrapped the model in
    DDP, so ``opt.release_with(self.trainer.strategy.model)`` ties release there; with accumulate_grad_batches=2
    (Lightning's no_sync micro-batch, the callback) the params equal the same fit without release bit for bit, and
    no grad is held at any optimizer step. (Launching the ranks, each importing Lightning, is most of the time.)"""
    pytest.importorskip("lightning.pytorch")
    worker = pathlib.Path(__file__).with_name("lightning_ddp_worker.py")
    out = tmp_path / "ddp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(pathlib.Path(fastoptim.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(worker), str(out)], capture_output=True, text=True, timeout=600,
                         env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    released, ordinary = result["released"], result["ordinary"]
    assert result["world"] == 2
    assert released["params"] == ordinary["params"]
    assert released["held"] == [0] * 3 and ordinary["held"] == [6] * 3
    assert released["buckets"] >= 3
