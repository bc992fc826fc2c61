"""How much of the loss drop low-bit state gives up, on a small teacher-student regression.

A fixed random teacher MLP (64 -> 256 -> 256 -> 64, tanh) labels Gaussian inputs; a student of the same shape
from another init learns it with each optimizer at 32-bit state and at each stored format, on the same batches,
the learning rate annealed to 0 (so the end shows the state's noise floor). The student sees each input feature
at its own scale (log-uniform over 10**-2 .. 10, the teacher sees them alike), as real features and embedding
rows differ: its first layer's grads then differ by orders of magnitude along a row, inside one block of state.
The student's three weight matrices hold 97% of its params, so the low-bit runs keep those states quantized.

    share lost = (final loss at the format - final loss at 32 bits) / (initial loss - final loss at 32 bits)

Final loss: the mean over the last tenth of the steps. Usage:

    python tools/low_bit_quality.py [--formats dynamic8 fp8 dynamic4] [--optimizers sgd lion adamw] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import fastoptim


@dataclasses.dataclass
class Config:
    optimizer: str = "adamw"
    state_format: str = "fp32"
    seed: int = 0
    steps: int = 400
    batch: int = 128
    width: int = 256
    lr: float | None = None  # None: the optimizer's own below


SETTINGS = {  # each optimizer's hyper-parameters on this task (tuned at 32 bits, then fixed)
    "sgd": dict(lr=0.05, momentum=0.9),
    "lion": dict(lr=3e-4, betas=(0.9, 0.99), weight_decay=0.0),
    "adamw": dict(lr=2e-3, weight_decay=0.0),
}


def mlp(width: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                               torch.nn.Tanh(), torch.nn.Linear(width, 64))


def train(cfg: Config) -> list[float]:
    """The student's loss at each step."""
    torch.manual_seed(1000 + cfg.seed)
    teacher = mlp(cfg.width)
    torch.manual_seed(cfg.seed)
    student = mlp(cfg.width)
    settings = dict(SETTINGS[cfg.optimizer], **({} if cfg.lr is None else {"lr": cfg.lr}))
    cls = {"sgd": fastoptim.SGD, "lion": fastoptim.Lion, "adamw": fastoptim.AdamW}[cfg.optimizer]
    opt = cls(student.parameters(), state_format=cfg.state_format, **settings)
    data = torch.Generator().manual_seed(cfg.seed)
    scales = 10.0 ** (torch.rand(64, generator=data) * 3 - 2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.steps)  # to 0: the end shows the state's noise
    losses = []
    for _ in range(cfg.steps):
        x = torch.randn(cfg.batch, 64, generator=data)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(student(x * scales), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        losses.append(loss.item())
    return losses


def final(losses: list[float]) -> float:
    return statistics.fmean(losses[-max(1, len(losses) // 10):])


def share_lost(losses: list[float], reference: list[float]) -> float:
    """The part of the 32-bit run's loss drop that ``losses`` does not reach (0: as good; 1: learned nothing)."""
    return (final(losses) - final(reference)) / (reference[0] - final(reference))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["dynamic8", "fp8", "dynamic4"])
    ap.add_argument("--optimizers", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=Config.steps)
    args = ap.parse_args(argv)
    table = {}
    for name in args.optimizers:
        references = {s: train(Config(name, "fp32", s, args.steps)) for s in args.seeds}
        for fmt in args.formats:
            shares = [share_lost(train(Config(name, fmt, s, args.steps)), references[s]) for s in args.seeds]
            table[(name, fmt)] = shares
            print(f"{name:>6} {fmt:>10}: share of the loss drop lost {100 * statistics.fmean(shares):6.2f} % "
                  f"(seeds: {', '.join(f'{100 * v:.2f}' for v in shares)})", flush=True)
    return table


if __name__ == "__main__":
    main()
