"""The optimizer settings every trainer is tried with, and tiny models built from code (no downloads).

Each kind names a fastoptim optimizer setting and, where one exists, the torch.optim optimizer it must agree with.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

import fastoptim

LR = 1e-3


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    make: Callable[[torch.nn.Module], torch.optim.Optimizer]  # model -> optimizer
    torch_twin: Callable[[torch.nn.Module], torch.optim.Optimizer] | None  # the torch.optim it equals, if any
    cls_and_kwargs: tuple | None  # (class, kwargs) for trainers that build the optimizer themselves


def _adamw(**extra) -> Callable:
    return lambda model: fastoptim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, **extra)


def _torch_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)


KINDS = {
    "32": Kind("32", _adamw(), _torch_adamw, (fastoptim.AdamW, {"lr": LR, "weight_decay": 0.01})),
    "32-flat": Kind("32-flat", _adamw(flat=True), _torch_adamw,
                    (fastoptim.AdamW, {"lr": LR, "weight_decay": 0.01, "flat": True})),
    "8": Kind("8", _adamw(state_bits=8), None, (fastoptim.AdamW, {"lr": LR, "weight_decay": 0.01, "state_bits": 8})),
    "8-flat": Kind("8-flat", _adamw(state_bits=8, flat=True), None,
                   (fastoptim.AdamW, {"lr": LR, "weight_decay": 0.01, "state_bits": 8, "flat": True})),
    "muon": Kind("muon", lambda model: fastoptim.create(model, "muon", lr=0.02, adamw_lr=LR), None, None),
}
KIND_NAMES = list(KINDS)


class TinyLM(torch.nn.Module):
    """Embedding, two blocks of Linear/GELU/LayerNorm, an untied head: tensors big enough to be 8-bit
    (4096+ elements), small enough to train in milliseconds."""

    def __init__(self, vocab: int = 128, width: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width),
                                                              torch.nn.GELU(), torch.nn.Linear(2 * width, width))
                                          for _ in range(2))
        self.norm = torch.nn.LayerNorm(width)
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x)
        return self.lm_head(self.norm(x))


def tokens(n: int, seq: int = 16, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    """A learnable stream: each token is the previous one plus one, from random starts."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (n, 1), generator=g)
    return (starts + torch.arange(seq)) % vocab


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
