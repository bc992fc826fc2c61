"""What a rule declares for the rest of the library besides its math: the public class (``fastoptim.registry``
makes it), the oracle and option sets the tests run, ``fastoptim curves``' settings and the tests' hints. The math
itself, and what the levels read, is ``base.Rule``, which takes these from here. Beside them, the plain pieces the
oracles share: ``ReferenceLoop`` and ``reference_newton_schulz`` (torch.optim.Muon's loop, one matrix at a time)."""

from __future__ import annotations

from typing import ClassVar, Iterator

import torch


class Declared:
    # the public class, ``fastoptim.<class_name>``
    class_name: ClassVar[str]
    # torch.optim's constructor parameters after ``params``, in its order, "*" where the keyword-only ones start;
    # None: ``defaults`` in order, ``maximize`` keyword-only. fastoptim's own options follow (optimizers.py).
    signature: ClassVar[tuple[str, ...] | None] = None
    # the oracle the tests and ``fastoptim curves`` compare with: "torch.optim.<Class>" (its single-tensor path),
    # or "<module>.<Class>" of a plain reference loop that takes ``compute_dtype`` (fastoptim.reference's)
    oracle: ClassVar[str]
    # the torch.optim class of the same algorithm where it is not the oracle (Muon's)
    torch_class: ClassVar[str | None] = None
    # hyper-parameter sets that together turn on every flag: the tests run each at every level against the oracle
    option_sets: ClassVar[tuple[dict, ...]] = ()
    # the params it takes: "any", or "matrices" (2+ dims: Muon); the tests give it 2-D ones
    takes: ClassVar[str] = "any"
    # ``fastoptim curves``' settings for this optimizer (its learning rate on the byte-level task, ...)
    curves_options: ClassVar[dict] = {"lr": 1e-3}
    # what ``fastoptim curves`` prints under the gap between the fp32 and fp64 reference loops, where it needs saying
    curves_note: ClassVar[str | None] = None
    # test hints: hyper-parameters that may be 0-d tensors; options for the 16-bit parity test (None: the
    # second option set), and what fp16 adds to them
    tensor_hypers: ClassVar[tuple[str, ...]] = ("lr",)
    low_precision_options: ClassVar[dict | None] = None
    fp16_options: ClassVar[dict] = {}


class ReferenceLoop(torch.optim.Optimizer):
    """The base of an oracle that is a plain loop of a published algorithm, one tensor at a time in
    ``compute_dtype`` (float64 by default; None: each param's own dtype): its ``step`` walks ``stepping``."""

    def __init__(self, params, defaults: dict, compute_dtype: torch.dtype | None):
        super().__init__(params, defaults)
        self.compute_dtype = compute_dtype

    def stepping(self, *state_names: str, counted: bool = True) -> Iterator[tuple]:
        """Each (group, param, its state, compute dtype, steps before this one) of the params with a grad; a new
        state is zeros for each of ``state_names`` (and, where ``counted``, a step count that this moves on)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update({name: torch.zeros_like(p) for name in state_names})
                    if counted:
                        state["step"] = torch.tensor(0.0)
                before = int(state["step"]) if counted else 0
                if counted:
                    state["step"] += 1
                yield group, p, state, self.compute_dtype or p.dtype, before


def reference_newton_schulz(update, coefficients, steps: int, eps: float, dtype, method: str = "auto"):
    """torch.optim.Muon's Newton-Schulz of one matrix (a tall one iterated as its transpose, ``addmm``), in
    ``dtype``, with fastoptim's schedules (a preset's name, one triple per iteration) and Gram iterations."""
    from . import newton_schulz as ns

    schedule = ns.schedule(coefficients, steps)
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    if schedule and ns.resolve_method(method, *x.shape, schedule, x.dtype) == "gram":
        x = _gram_newton_schulz(x, schedule)
    else:
        for a, b, c in schedule:
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _gram_newton_schulz(x, schedule):
    """Gram Newton-Schulz on a wide matrix, literally: R = X X^T, B = a I + b R + c R^2, Q <- B Q, R <- B R B,
    and before each iteration of ``restarts`` X <- Q X, R <- X X^T, Q <- I; the result Q X."""
    from .newton_schulz import restarts

    eye = torch.eye(x.shape[0], dtype=x.dtype)
    r, q = x @ x.T, eye
    for i, (a, b, c) in enumerate(schedule):
        if i in restarts(schedule):
            x = q @ x
            r, q = x @ x.T, eye
        poly = torch.addmm(r, r, r, beta=b, alpha=c) + a * eye
        q = poly @ q
        r = poly @ r @ poly
    return q @ x
