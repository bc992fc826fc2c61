"""Run by tests/integrations/test_lightning.py as a script: Lightning's ``strategy="ddp"`` on two CPU processes
(gloo; Lightning starts the second by running this script again), the same fit with gradient release tied to the
DDP model in ``configure_optimizers`` and without it, two micro-batches a step through fastoptim's callback. Rank 0
writes the params, the grads held at each optimizer step and the buckets stepped to the JSON file named by argv[1]."""

import json
import sys

import lightning.pytorch as pl
import torch

import fastoptim
from fastoptim.integrations.lightning import GradientRelease


class Module(pl.LightningModule):
    def __init__(self, release):
        super().__init__()
        torch.manual_seed(0)
        self.release = release
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                       torch.nn.GELU(), torch.nn.Linear(64, 1))
        self.held = []

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer):
        self.held.append(sum(p.grad is not None for p in self.parameters()))

    def configure_optimizers(self):
        optimizer = fastoptim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01, gradient_release=self.release)
        if self.release:
            optimizer.release_with(self.trainer.strategy.model)  # (Lightning wrapped it in DDP before this call)
        return optimizer


def fit(release):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 32, generator=g),
                                                                      torch.randn(48, 1, generator=g)), batch_size=4)
    module = Module(release)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=2, strategy="ddp", accumulate_grad_batches=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[GradientRelease()] if release else [])
    trainer.fit(module, data)
    opt = trainer.optimizers[0]
    return trainer, dict(params=[p.detach().flatten().tolist() for p in module.parameters()], held=module.held,
                         buckets=opt._release.ddp.buckets_stepped if release else 0)


if __name__ == "__main__":
    (trainer, released), (_, ordinary) = fit(True), fit(False)
    if trainer.global_rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(dict(released=released, ordinary=ordinary, world=trainer.world_size), f)
