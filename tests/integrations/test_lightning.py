"""Lightning with fastoptim: fit, checkpoint and resume equal a straight run; 32-bit equals torch.optim."""

from __future__ import annotations

import functools

import pytest
import torch

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


def fit(root, make_optimizer, precision="32", clip=None, resume=None, max_steps=6, device="cpu"):
    pl, Module = lightning_module()
    module = Module(make_optimizer)
    # one epoch is 3 steps: the checkpoint at step 3 ends an epoch, so a resumed run sees the same batches
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens(12)), batch_size=4)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1,
                                               filename="{step}")
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu" if device == "cpu" else "gpu", devices=1, precision=precision,
                         gradient_clip_val=clip, logger=False, callbacks=[checkpoints], enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, deterministic=True)
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
