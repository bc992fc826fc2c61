"""The one list of optimizers, read off the registered rules (``fastoptim.rules.RULES``): exports, ``create()``,
CLI choices, the curves' settings and the test matrix all come from here.

``option_sets`` are the hyper-parameter combinations that together turn on every flag of the rule; the
test suite runs each of them at every level against the rule's ``oracle``: a torch.optim class
(``reference`` names it), or a plain reference loop of the published algorithm (``reference`` is None;
``fastoptim.reference.reference_class`` loads it).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import optimizers
from .optimizer import FastOptimizer
from .rules import RULES, Rule, register

TORCH = "torch.optim."


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    cls: type[FastOptimizer]
    reference: str | None
    option_sets: tuple[dict, ...]
    # the params it takes: "any", or "matrices" (2+ dims: Muon); the tests give it 2-D ones
    params: str = "any"
    # the torch.optim class of the same algorithm where it is not the oracle (torch.optim.Muon: no
    # single-tensor flag, its Newton-Schulz always in bf16; the oracle is fastoptim.reference.ReferenceMuon)
    torch_class: str | None = None

    @property
    def torch_counterpart(self) -> str | None:
        """The torch.optim class name of this algorithm, if torch has one."""
        return self.reference or self.torch_class

    @property
    def rule(self) -> Rule:
        return self.cls.rule

    @property
    def oracle(self) -> str:
        """The dotted name of the oracle class (``torch.optim.AdamW``, ``fastoptim.reference.ReferenceLion``)."""
        return self.rule.oracle


def spec_of(rule: Rule, cls: type[FastOptimizer]) -> OptimizerSpec:
    reference = rule.oracle[len(TORCH):] if rule.oracle.startswith(TORCH) else None
    return OptimizerSpec(rule.name, cls, reference, tuple(rule.option_sets), rule.takes, rule.torch_class)


OPTIMIZERS: dict[str, OptimizerSpec] = {name: spec_of(rule, optimizers.CLASSES[name]) for name, rule in RULES.items()}


def add(rule: Rule) -> OptimizerSpec:
    """Registers a rule after import (a test's, a user's own): it gets a class (``OPTIMIZERS[name].cls``, not an
    attribute of ``fastoptim``), ``create()`` and, where added before the tests are collected, the test matrix."""
    register(rule)
    spec = spec_of(rule, optimizers.public_class(rule, module=type(rule).__module__))
    OPTIMIZERS[rule.name] = spec
    return spec


def get(name: str) -> OptimizerSpec:
    spec = OPTIMIZERS.get(name.lower())
    if spec is None:
        raise ValueError(f"Unknown optimizer {name!r}; valid names: {', '.join(OPTIMIZERS)}")
    return spec
