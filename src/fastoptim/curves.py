"""Learning curves: one small model trained from the same seed on the same batches with torch.optim and with
fastoptim at each level, so any difference in the numbers shows up as a difference in the loss.

The task is next-byte prediction on the pydoc text that ships with Python, with a small MLP language model
over an 8-byte context. Lion has no torch.optim class; its reference is a float64 loop of the published
algorithm (``fastoptim.reference``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import data, registry
from .reference import reference_class, reference_kwargs

LEARNING_RATES = {"sgd": 0.1, "adam": 3e-3, "adamw": 3e-3, "rmsprop": 1e-3, "adagrad": 0.05, "lion": 3e-4}


class ByteMLP(torch.nn.Module):
    def __init__(self, context: int = 8, width: int = 32, hidden: int = 128):
        super().__init__()
        self.embed = torch.nn.Embedding(256, width)
        self.hidden = torch.nn.Linear(context * width, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.out = torch.nn.Linear(hidden, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(1)
        return self.out(self.norm(torch.nn.functional.gelu(self.hidden(h))))


@dataclass
class Curve:
    optimizer: str
    label: str            # "torch", or the fastoptim level ("fused", "fused flat", ...)
    losses: list[float] = field(default_factory=list)


def _optimizer_kwargs(name: str) -> dict:
    kwargs = {"lr": LEARNING_RATES[name]}
    if name == "sgd":
        kwargs["momentum"] = 0.9
    return kwargs


def train(name: str, make_optimizer, steps: int, seed: int, batch_size: int = 64, context: int = 8) -> list[float]:
    torch.manual_seed(seed)
    model = ByteMLP(context)
    opt = make_optimizer(model)
    tokens = data.corpus_tensor()
    losses = []
    for _, (x, y) in zip(range(steps), data.batches(tokens, batch_size, context, seed)):
        loss = torch.nn.functional.cross_entropy(model(x), y[:, -1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def run(optimizers: list[str], impls: list[str], flat_impls: list[str], steps: int = 200,
        seed: int = 0, progress=lambda: None) -> list[Curve]:
    curves = []
    for name in optimizers:
        spec = registry.get(name)
        kwargs = _optimizer_kwargs(name)
        ref_cls = reference_class(spec)
        ref = Curve(name, "torch" if spec.reference else "reference", train(
            name, lambda m: ref_cls(m.parameters(), **kwargs, **reference_kwargs(spec)), steps, seed))
        curves.append(ref)
        progress()
        for impl, flat in [(i, False) for i in impls] + [(i, True) for i in flat_impls]:
            label = f"{impl} flat" if flat else impl
            curves.append(Curve(name, label, train(
                name, lambda m, impl=impl, flat=flat: spec.cls(m.parameters(), impl=impl, flat=flat, **kwargs),
                steps, seed)))
            progress()
    return curves


def max_differences(curves: list[Curve]) -> list[dict]:
    """Per fastoptim curve: the largest |loss - reference loss| at any step, and the final losses."""
    out = []
    refs = {c.optimizer: c for c in curves if c.label in ("torch", "reference")}
    for c in curves:
        ref = refs[c.optimizer]
        if c is ref:
            continue
        diff = max(abs(a - b) for a, b in zip(c.losses, ref.losses))
        out.append({"optimizer": c.optimizer, "curve": c.label, "reference": ref.label, "max_abs_diff": diff,
                    "final_loss": c.losses[-1], "reference_final_loss": ref.losses[-1]})
    return out


def plot(curves: list[Curve], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(c.optimizer for c in curves))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for c in (c for c in curves if c.optimizer == name):
            reference = c.label in ("torch", "reference")
            ax.plot(c.losses, label=c.label, linewidth=2.5 if reference else 1,
                    linestyle="--" if reference else "-", color="black" if reference else None,
                    zorder=1 if reference else 2, alpha=0.9)
        ax.set_title(f"{name}: next-byte loss (pydoc text)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
