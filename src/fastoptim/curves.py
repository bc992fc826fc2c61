"""Learning curves: one small model trained from the same seed on the same batches with torch.optim and with
fastoptim at each level, so any difference in the numbers shows up as a difference in the loss.

The task is next-byte prediction on the pydoc text that ships with Python, with a small MLP language model
over an 8-byte context.

Lion has no torch.optim class. Its references are two plain loops of the published algorithm
(``fastoptim.reference.ReferenceLion``): one in the param dtype (fp32 here), the oracle for "the levels compute
exactly this", and one in float64, which says how far fp32 Lion itself is from exact arithmetic. The two differ
by far more than rounding: where ``b1 m + (1 - b1) g`` is within a rounding of 0, a last-bit difference in the
state or the param flips its sign and moves that weight by ``2 lr``. ``reference_gaps`` reports that distance.

How the state and the params are kept is the other question these curves answer: each level again with its
state at 16/8/4 bits (``state_bits=``), and with bf16 params and no fp32 master copy (``rounding=``), beside
the same level's 32-bit fp32 run. ``precision_gaps`` reports how far each one ends from it, as a percentage
of the final loss (the mean over the last tenth of the steps, so one batch does not decide it).
"""

from __future__ import annotations

import inspect

from dataclasses import dataclass, field

import torch

from . import data, levels, registry, storage
from .factory import create
from .reference import ReferenceMuonRecipe, reference_class, reference_kwargs

# each optimizer's settings on this task are its rule's (``Rule.curves_options``: its lr, SGD's momentum)
LEARNING_RATES = {name: spec.cls.rule.curves_options["lr"] for name, spec in registry.OPTIMIZERS.items()}
# Muon's recipe steps the embedding, the output head and 1-D params with AdamW at this lr (``muon_groups``)
MUON_ADAMW_LR = 3e-3


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
    level: str | None = None   # the level row it belongs to ("fused", "fused flat"); None for a reference
    state_bits: int | str = 32  # how the optimizer kept its state (state_bits=: a width, or a format's name)
    params: str = "fp32"       # the params' dtype: "fp32", or "bf16" (no fp32 master copy)
    rounding: str = "nearest"  # how bf16 params were rounded back (rounding=)

    @property
    def full_precision(self) -> bool:
        """32-bit state and fp32 params: the run the low-precision ones are measured against."""
        return self.state_bits == 32 and self.params == "fp32"


EXACT_REFERENCE = "reference fp32"  # Lion's oracle in the param dtype (the model is fp32)
FP64_REFERENCE = "reference fp64"   # Lion's oracle in float64


def references(spec: registry.OptimizerSpec) -> list[tuple[str, dict]]:
    """(label, extra constructor arguments) of the reference runs, the exactness oracle first."""
    if spec.reference is not None:
        return [("torch", reference_kwargs(spec))]
    if spec.params == "matrices" and spec.torch_counterpart:
        return [("torch", {})]  # Muon: torch.optim.Muon's loop (Newton-Schulz in our dtype) and torch's AdamW
    return [(EXACT_REFERENCE, {"compute_dtype": None}), (FP64_REFERENCE, {"compute_dtype": torch.float64})]


PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_variant(text: str) -> tuple[str, dict]:
    """``registry.parse_variant``, and each option one that the variant's reference runs take too (each curve is
    compared with its reference's): ValueError naming those it does not, and those it does."""
    name, options = registry.parse_variant(text)
    spec = registry.get(name)
    cls = reference_class(spec)
    taken = _keywords(cls)
    if spec.params == "matrices":  # (the recipe's reference lays out a param's matrices itself)
        taken |= {key for key, _ in ReferenceMuonRecipe.LAYOUT}
    refused = [key for key in options if key not in taken]
    if refused:
        shared = ", ".join(k for k in spec.rule.defaults if k in taken)
        raise ValueError(f"{text!r}: its reference ({cls.__name__}) takes no option {', '.join(map(repr, refused))}"
                         f"; a {name} variant takes: {shared}")
    return name, options


def _keywords(cls) -> set[str]:
    """The keyword arguments ``cls(...)`` takes: its ``__init__``'s, and its bases' where that passes **kwargs on."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        names.update(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break
    return names - {"self", "params"}


def _optimizer_kwargs(name: str, lr: float | None = None, options: dict | None = None) -> dict:
    """The rule's settings on this task, ``lr`` over its lr, then a variant's own ``options`` over both."""
    kwargs = dict(registry.get(name).cls.rule.curves_options)
    if lr is not None:
        kwargs["lr"] = lr
    return {**kwargs, **(options or {})}


def train(name: str, make_optimizer, steps: int, seed: int, batch_size: int = 64, context: int = 8,
          param_dtype: torch.dtype = torch.float32) -> list[float]:
    """The losses of ``steps`` steps. With ``param_dtype`` bf16 the model is initialised as in fp32 and then cast
    (the same starting point, rounded), and runs in bf16; the loss is taken in fp32 either way."""
    torch.manual_seed(seed)
    model = ByteMLP(context).to(param_dtype)
    opt = make_optimizer(model)
    tokens = data.corpus_tensor()
    losses = []
    for _, (x, y) in zip(range(steps), data.batches(tokens, batch_size, context, seed)):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y[:, -1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def precision_runs(impls: list[str], flat_impls: list[str], state_bits=(), roundings=()) -> list[dict]:
    """Every fastoptim run of ``run``, in order: each level (and each flat level) at 32-bit state and fp32 params,
    then each level (and each flat level) again at each of ``state_bits`` (fp32 params), and each non-flat level
    with bf16 params rounded by each of ``roundings`` (state kept as torch keeps it: in the params' dtype; flat
    mode rounds to nearest only, so it has no such runs)."""
    levels = [(i, False) for i in impls] + [(i, True) for i in flat_impls]
    runs = [dict(level=f"{i} flat" if flat else i, impl=i, flat=flat, state_bits=32, params="fp32",
                 rounding="nearest") for i, flat in levels]
    for impl, flat in levels:
        level = f"{impl} flat" if flat else impl
        runs += [dict(level=level, impl=impl, flat=flat, state_bits=bits, params="fp32", rounding="nearest")
                 for bits in state_bits if bits != 32]
        if not flat:
            runs += [dict(level=level, impl=impl, flat=False, state_bits=32, params="bf16", rounding=r)
                     for r in roundings]
    return runs


def _run_label(run: dict) -> str:
    if run["params"] != "fp32":
        return f"{run['level']} {run['params']} params, {run['rounding']}"
    bits = run["state_bits"]  # a width, or the name of a format registered beside its width's own
    return run["level"] if bits == 32 else f"{run['level']} {f'{bits}-bit' if isinstance(bits, int) else bits} state"


def run(optimizers: list[str], impls: list[str], flat_impls: list[str], steps: int = 200,
        seed: int = 0, progress=lambda: None, state_bits=(), roundings=(), lr: float | None = None) -> list[Curve]:
    """The references' curves and every run of ``precision_runs`` for each optimizer; ``lr`` replaces each
    optimizer's default learning rate (``LEARNING_RATES``). An optimizer may be a variant with options of its
    own, ``muon[ns_coefficients=polar_express,ns_method=gram]`` (``parse_variant``): its references
    and levels all take them, and its curves carry that text as their optimizer. A rule whose states are not
    param-shaped (NorMuon, Adafactor) gets no flat runs (flat=True refuses it)."""
    for bits in state_bits:
        storage.check_state_bits(bits)
    for rounding in roundings:
        storage.rounding.check_rounding(rounding)
    if lr is not None and not lr > 0:
        raise ValueError(f"Invalid learning rate: {lr!r} (must be > 0)")
    variants = [(text, *parse_variant(text)) for text in optimizers]  # (every name checked first)
    curves = []
    for name, rule_name, options in variants:
        spec = registry.get(rule_name)
        kwargs = _optimizer_kwargs(rule_name, lr, options)
        flats = flat_impls if spec.takes_flat() else []
        for label, extra in references(spec):
            curves.append(Curve(name, label, train(
                name, lambda m, extra=extra: _reference(spec, m, kwargs, extra), steps, seed), reference=True))
            progress()
        for r in precision_runs(impls, flats, state_bits, roundings):
            settings = dict(impl=r["impl"], flat=r["flat"], state_bits=r["state_bits"], rounding=r["rounding"])
            with levels.own_paths():  # each row is the level it names, not the path it would route to
                losses = train(name, lambda m, settings=settings: _ours(spec, m, settings, kwargs),
                               steps, seed, param_dtype=PARAM_DTYPES[r["params"]])
            curves.append(Curve(name, _run_label(r), losses, level=r["level"], state_bits=r["state_bits"],
                                params=r["params"], rounding=r["rounding"]))
            progress()
    return curves


def _ours(spec, model, settings: dict, kwargs: dict):
    if spec.params == "matrices":  # Muon: its recipe, AdamW for what is not a hidden matrix
        return create(model, spec.name, adamw_lr=MUON_ADAMW_LR, **settings, **kwargs)
    return spec.cls(model.parameters(), **settings, **kwargs)


def _reference(spec, model, kwargs: dict, extra: dict):
    if spec.params == "matrices":  # the recipe with the rule's oracle, at the rule's default weight decay as ours
        kwargs = {"weight_decay": spec.rule.defaults["weight_decay"], **kwargs}
        return ReferenceMuonRecipe(model, adamw_lr=MUON_ADAMW_LR, reference=reference_class(spec), **kwargs, **extra)
    return reference_class(spec)(model.parameters(), **kwargs, **extra)


def _max_diff(a: Curve, b: Curve) -> float:
    return max(abs(x - y) for x, y in zip(a.losses, b.losses))


def _references_by_optimizer(curves: list[Curve]) -> dict[str, list[Curve]]:
    refs: dict[str, list[Curve]] = {}
    for c in curves:
        if c.reference:
            refs.setdefault(c.optimizer, []).append(c)
    return refs


def max_differences(curves: list[Curve]) -> list[dict]:
    """Per fastoptim curve at 32-bit state and fp32 params: the largest |loss - reference loss| at any step
    against the exactness reference (torch.optim, or Lion's loop in the param dtype), and the final losses; for
    Lion also the same against the float64 reference (``max_abs_diff_fp64``)."""
    out = []
    refs = _references_by_optimizer(curves)
    for c in curves:
        if c.reference or not c.full_precision:
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


def final_loss(losses: list[float]) -> float:
    """The mean loss over the last tenth of the steps (at least one): the end of a curve, less one batch's luck."""
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def precision_gaps(curves: list[Curve]) -> list[dict]:
    """Per curve with low-bit state or bf16 params: its final loss (``final_loss``) against the same level's
    32-bit fp32 run, and the gap as a percentage of that run's (positive: ends higher)."""
    baselines = {(c.optimizer, c.level): c for c in curves if not c.reference and c.full_precision}
    out = []
    for c in curves:
        if c.reference or c.full_precision:
            continue
        base = baselines[(c.optimizer, c.level)]
        mine, theirs = final_loss(c.losses), final_loss(base.losses)
        out.append({"optimizer": c.optimizer, "curve": c.label, "reference": base.label, "state_bits": c.state_bits,
                    "params": c.params, "rounding": c.rounding, "final_loss": mine, "reference_final_loss": theirs,
                    "gap_percent": (mine - theirs) / theirs * 100, "max_abs_diff": _max_diff(c, base)})
    return out


def plot(curves: list[Curve], path: str) -> None:
    """One panel per optimizer: the levels over their references; where there are low-bit or bf16-param runs,
    a second panel below draws them over the 32-bit fp32 runs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(c.optimizer for c in curves))
    precision = any(not c.reference and not c.full_precision for c in curves)
    fig, axes = plt.subplots(2 if precision else 1, len(names), figsize=(5 * len(names), 8 if precision else 4),
                             squeeze=False)
    for ax, name in zip(axes[0], names):
        for c in (c for c in curves if c.optimizer == name and (c.reference or c.full_precision)):
            fp64 = c.label == FP64_REFERENCE
            ax.plot(c.losses, label=c.label, linewidth=2.5 if c.reference else 1,
                    linestyle=":" if fp64 else "--" if c.reference else "-",
                    color="grey" if fp64 else "black" if c.reference else None,
                    zorder=1 if c.reference else 2, alpha=0.9)
        sep = "\n" if len(name) > 20 else " "  # (a variant's options take a line of their own)
        ax.set_title(f"{name}:{sep}next-byte loss (pydoc text)", fontsize=10)
    if precision:
        for ax, name in zip(axes[1], names):
            levels_with_runs = {c.level for c in curves if c.optimizer == name and not c.full_precision}
            for c in (c for c in curves if c.optimizer == name and c.level in levels_with_runs):
                ax.plot(c.losses, label=c.label, linewidth=2 if c.full_precision else 1,
                        linestyle="--" if c.full_precision else "-", alpha=0.9)
            sep = "\n" if len(name) > 20 else " "
            ax.set_title(f"{name}:{sep}low-bit state and bf16 params vs 32-bit fp32", fontsize=10)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
