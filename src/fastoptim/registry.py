"""The one list of optimizers, read off the registered rules (``fastoptim.rules.RULES``): exports, ``create()``,
CLI choices, the curves' settings and the test matrix all come from here.

``option_sets`` are the hyper-parameter combinations that together turn on every flag of the rule; the
test suite runs each of them at every level against the rule's ``oracle``: a torch.optim class
(``reference`` names it), or a plain reference loop of the published algorithm (``reference`` is None;
``fastoptim.reference.reference_class`` loads it).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import torch

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

    def takes_flat(self, shapes=((8, 16),)) -> bool:
        """Whether ``flat=True`` can hold its states for params of these shapes: every state is shaped like its
        param (flat mode keeps each state as a view of one buffer), not Adafactor's factors or NorMuon's rows."""
        rule = self.rule
        for shape in shapes:
            p = torch.empty(shape, device="meta")
            if any(rule.state_shape(n, p) not in (None, tuple(shape)) for n in rule.state_names):
                return False
        return True

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


def parse_variant(text: str) -> tuple[str, dict]:
    """An optimizer's name, or the name with group options in brackets: ``name[key=value,...]``, e.g.
    ``muon[ns_coefficients=polar_express,ns_method=gram]``. A value is a Python literal (``0.02``, ``None``,
    ``(2.0, -1.5, 0.5)``) or else taken as a word (a preset's name, ``float32``). Returns (name, options), the
    options checked against the rule's own; ValueError saying what is wrong."""
    text = text.strip()
    name, bracket, rest = text.partition("[")
    spec = get(name.strip())
    if not bracket:
        return spec.name, {}
    if not rest.endswith("]"):
        raise ValueError(f"{text!r}: options go in brackets, name[key=value,...]")
    options = {}
    for item in _top_level_split(rest[:-1]):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key:
            raise ValueError(f"{text!r}: {item.strip()!r} is not key=value")
        if key in options:  # (the last would win silently: a run not of the options it reads as)
            raise ValueError(f"{text!r}: {key} is given twice")
        if key not in spec.rule.defaults:
            raise ValueError(f"{text!r}: {spec.name} has no option {key!r}; its options: "
                             f"{', '.join(spec.rule.defaults)}")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            if not value.isidentifier():
                raise ValueError(f"{text!r}: cannot read the value of {key} ({value!r})") from None
            options[key] = value
    try:
        spec.rule.validate({**spec.rule.defaults, **options})
    except (ValueError, TypeError) as e:
        raise ValueError(f"{text!r}: {e}") from None
    return spec.name, options


def _top_level_split(text: str) -> list[str]:
    """``text`` cut at the commas outside brackets (a tuple's own commas stay in its value)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]
