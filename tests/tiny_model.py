"""A small module the CLI tests name as a bench workload (``tiny_model:make``)."""

import torch


def make() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 64), torch.nn.LayerNorm(64),
                               torch.nn.Linear(64, 100))
