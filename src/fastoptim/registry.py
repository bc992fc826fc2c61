"""The one list of optimizers. Exports, ``create()``, CLI choices and the test matrix all come from here.

``option_sets`` are the hyper-parameter combinations that together turn on every flag of the rule; the
test suite runs each of them at every level against ``reference`` (a torch.optim class name, or None when
fastoptim's loop level is checked against a plain reference loop in the tests instead: ``fastoptim.reference``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import optimizers
from .optimizer import FastOptimizer


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    cls: type[FastOptimizer]
    reference: str | None
    option_sets: tuple[dict, ...]
    # the params it takes: "any", or "matrices" (2-D only: Muon); the tests give it such params
    params: str = "any"
    # the torch.optim class of the same algorithm where it is not the oracle (torch.optim.Muon: no
    # single-tensor flag, its Newton-Schulz always in bf16; the oracle is fastoptim.reference.ReferenceMuon)
    torch_class: str | None = None

    @property
    def torch_counterpart(self) -> str | None:
        """The torch.optim class name of this algorithm, if torch has one."""
        return self.reference or self.torch_class


OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec for spec in (
    OptimizerSpec("sgd", optimizers.SGD, "SGD", (
        dict(lr=0.1),
        dict(lr=0.05, momentum=0.9),
        dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1),
        dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.05, maximize=True),
    )),
    OptimizerSpec("adam", optimizers.Adam, "Adam", (
        dict(lr=1e-2),
        dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, eps=1e-6),
        dict(lr=1e-2, amsgrad=True, maximize=True, weight_decay=0.05),
    )),
    OptimizerSpec("adamw", optimizers.AdamW, "AdamW", (
        dict(lr=1e-2),
        dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.3),
        dict(lr=1e-2, amsgrad=True, maximize=True, weight_decay=0.0),
    )),
    OptimizerSpec("rmsprop", optimizers.RMSprop, "RMSprop", (
        dict(lr=1e-2),
        dict(lr=1e-2, momentum=0.9, weight_decay=0.1),
        dict(lr=1e-2, centered=True, alpha=0.9, maximize=True),
        dict(lr=1e-2, centered=True, momentum=0.5, eps=1e-4),
    )),
    OptimizerSpec("adagrad", optimizers.Adagrad, "Adagrad", (
        dict(lr=1e-1),
        dict(lr=1e-1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1),
        dict(lr=1e-1, maximize=True, eps=1e-6),
    )),
    OptimizerSpec("adamax", optimizers.Adamax, "Adamax", (
        dict(lr=1e-2),
        dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, eps=1e-6),
        dict(lr=1e-2, maximize=True, weight_decay=0.05),
    )),
    OptimizerSpec("adadelta", optimizers.Adadelta, "Adadelta", (
        dict(lr=1.0),
        dict(lr=0.5, rho=0.8, weight_decay=0.1, eps=1e-4),
        dict(lr=1.0, maximize=True, weight_decay=0.05),
    )),
    OptimizerSpec("radam", optimizers.RAdam, "RAdam", (
        dict(lr=1e-2),
        dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, eps=1e-6),
        dict(lr=1e-2, weight_decay=0.3, decoupled_weight_decay=True, maximize=True),
    )),
    OptimizerSpec("nadam", optimizers.NAdam, "NAdam", (
        dict(lr=1e-2),
        dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, momentum_decay=0.05, eps=1e-6),
        dict(lr=1e-2, weight_decay=0.3, decoupled_weight_decay=True, maximize=True),
    )),
    OptimizerSpec("rprop", optimizers.Rprop, "Rprop", (
        dict(lr=1e-2),
        dict(lr=1e-2, etas=(0.4, 1.5), step_sizes=(1e-3, 0.05)),
        dict(lr=1e-2, maximize=True),
    )),
    OptimizerSpec("asgd", optimizers.ASGD, "ASGD", (
        dict(lr=1e-2),
        dict(lr=5e-2, lambd=0.1, alpha=0.5, t0=5, weight_decay=0.1),
        dict(lr=1e-2, t0=2, maximize=True),
    )),
    OptimizerSpec("adafactor", optimizers.Adafactor, "Adafactor", (
        dict(lr=1e-2),
        dict(lr=1e-2, weight_decay=0.1, beta2_decay=-0.5, eps=(1e-4, 1e-3), d=2.0),
        dict(lr=1e-2, maximize=True, weight_decay=0.05),
    )),
    # (Newton-Schulz in the device's fast dtype (bf16 here, where bf16 products are native), and pinned to fp32)
    OptimizerSpec("muon", optimizers.Muon, None, (
        dict(lr=2e-2),
        dict(lr=2e-2, nesterov=False, momentum=0.9, weight_decay=0.3, adjust_lr_fn="match_rms_adamw",
             ns_dtype="float32"),
        dict(lr=2e-2, ns_steps=3, ns_coefficients=(2.0, -1.5, 0.5), eps=1e-5, adjust_lr_fn="original",
             ns_dtype="float32"),
    ), params="matrices", torch_class="Muon"),
    OptimizerSpec("lion", optimizers.Lion, None, (
        dict(lr=1e-3),
        dict(lr=1e-3, betas=(0.95, 0.98), weight_decay=0.5),
        dict(lr=1e-3, maximize=True, weight_decay=0.1),
    )),
)}


def get(name: str) -> OptimizerSpec:
    spec = OPTIMIZERS.get(name.lower())
    if spec is None:
        raise ValueError(f"Unknown optimizer {name!r}; valid names: {', '.join(OPTIMIZERS)}")
    return spec
