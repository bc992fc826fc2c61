"""Learning curves: one small model trained from the same seed on the same batches with torch.optim and with
fastoptim at each level, so any difference in the numbers shows up as a difference in the loss.

The task is next-byte prediction on the pydoc text that ships with Python, with a small MLP language model
over an 8-byte context.

Lion has no torch.optim class. Its references are two plain loops of the published algorithm
(``fastoptim.reference.ReferenceLion``): one in the param dtype (fp32 here), the oracle for "the levels compute
exactly this", and one in float64, which says how far fp32 Lion itself is from exact arithmetic. The two differ
by far more than rounding: where ``b1 m + (1 - b1) g`` is within a rounding of 0, a last-bit difference in the
state or the param flips its sign and moves that weight by ``2 lr``. ``reference_gaps`` reports that distance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import data, levels, registry
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
    label: str            # a reference ("torch", EXACT_REFERENCE, FP64_REFERENCE) or a level ("fused flat", ...)
    losses: list[float] = field(default_factory=list)
    reference: bool = False


EXACT_REFERENCE = "reference fp32"  # Lion's oracle in the param dtype (the model is fp32)
FP64_REFERENCE = "reference fp64"   # Lion's oracle in float64


def references(spec: registry.OptimizerSpec) -> list[tuple[str, dict]]:
    """(label, extra constructor arguments) of the reference runs, the exactness oracle first."""
    if spec.reference is not None:
        return [("torch", reference_kwargs(spec))]
    return [(EXACT_REFERENCE, {"compute_dtype": None}), (FP64_REFERENCE, {"compute_dtype": torch.float64})]


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
        for label, extra in references(spec):
            curves.append(Curve(name, label, train(
                name, lambda m, extra=extra: ref_cls(m.parameters(), **kwargs, **extra), steps, seed), reference=True))
            progress()
        for impl, flat in [(i, False) for i in impls] + [(i, True) for i in flat_impls]:
            label = f"{impl} flat" if flat else impl
            with levels.own_paths():  # each row is the level it names, not the path it would route to
                curves.append(Curve(name, label, train(
                    name, lambda m, impl=impl, flat=flat: spec.cls(m.parameters(), impl=impl, flat=flat, **kwargs),
                    steps, seed)))
            progress()
    return curves


def _max_diff(a: Curve, b: Curve) -> float:
    return max(abs(x - y) for x, y in zip(a.losses, b.losses))


def _references_by_optimizer(curves: list[Curve]) -> dict[str, list[Curve]]:
    refs: dict[str, list[Curve]] = {}
    for c in curves:
        if c.reference:
            refs.setdefault(c.optimizer, []).append(c)
    return refs


def max_differences(curves: list[Curve]) -> list[dict]:
    """Per fastoptim curve: the largest |loss - reference loss| at any step against the exactness reference
    (torch.optim, or Lion's loop in the param dtype), and the final losses; for Lion also the same against the
    float64 reference (``max_abs_diff_fp64``)."""
    out = []
    refs = _references_by_optimizer(curves)
    for c in curves:
        if c.reference:
            continue
        exact = refs[c.optimizer][0]
        row = {"optimizer": c.optimizer, "curve": c.label, "reference": exact.label,
               "max_abs_diff": _max_diff(c, exact), "final_loss": c.losses[-1],
               "reference_final_loss": exact.losses[-1]}
        fp64 = next((r for r in refs[c.optimizer] if r.label == FP64_REFERENCE), None)
        if fp64 is not None:
            row["max_abs_diff_fp64"] = _max_diff(c, fp64)
            row["fp64_reference_final_loss"] = fp64.losses[-1]
        out.append(row)
    return out


def reference_gaps(curves: list[Curve]) -> list[dict]:
    """How far the exactness reference itself is from the float64 one (Lion): the cost of fp32 arithmetic, the
    same for every level. ``first_step_apart`` is the first step (1-based) whose losses differ at all."""
    out = []
    for name, refs in _references_by_optimizer(curves).items():
        fp64 = next((r for r in refs if r.label == FP64_REFERENCE), None)
        if fp64 is None:
            continue
        exact = refs[0]
        apart = next((i + 1 for i, (x, y) in enumerate(zip(exact.losses, fp64.losses)) if x != y), None)
        out.append({"optimizer": name, "curve": exact.label, "reference": fp64.label,
                    "max_abs_diff": _max_diff(exact, fp64), "first_step_apart": apart,
                    "final_loss": exact.losses[-1], "reference_final_loss": fp64.losses[-1]})
    return out


def plot(curves: list[Curve], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(c.optimizer for c in curves))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for c in (c for c in curves if c.optimizer == name):
            fp64 = c.label == FP64_REFERENCE
            ax.plot(c.losses, label=c.label, linewidth=2.5 if c.reference else 1,
                    linestyle=":" if fp64 else "--" if c.reference else "-",
                    color="grey" if fp64 else "black" if c.reference else None,
                    zorder=1 if c.reference else 2, alpha=0.9)
        ax.set_title(f"{name}: next-byte loss (pydoc text)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
