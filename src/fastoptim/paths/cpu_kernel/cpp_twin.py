"""The rule's ``update`` as C++: traced once with symbolic values, each operator one fp32 statement.

``update`` uses arithmetic operators and ``prims`` only (the rule contract), and its FLAGS are Python
booleans, so running it on ``Sym`` values records exactly the operations the loop level performs, in the
same order. Each becomes one C++ statement on a type the kernel chooses (``LANE_TYPE``: a register's fp32 lanes,
``native/lanes.hpp``, or one ``float``): with FMA contraction off, IEEE division and square root, every
operation is rounded once, correctly, so the C++ twin gives the rule's IEEE fp32 math
exactly (torch's CPU ``sqrt`` is off by an ulp in some lanes; its other operators agree). Scalars (a Python
number in the source, or one of the step's scalars) are fp32, as torch rounds a Python scalar to a float
tensor's dtype.
"""

from __future__ import annotations

from typing import Callable

from ... import native

_literal = native.float_literal  # shared with the codecs' C++ hooks
LANE_TYPE = "FO_T"  # each statement's type: the kernel fills in ``Lanes`` (a register's worth) or ``float``


class Sym:
    """One fp32 value of the traced update: the name of a C++ variable holding it."""

    def __init__(self, tracer: "Tracer", name: str):
        self.tracer, self.name = tracer, name

    def _op(self, template: str, *args) -> "Sym":
        return self.tracer.emit(template.format(*(self.tracer.operand(a) for a in args)))

    def __add__(self, other):
        return self._op("{} + {}", self, other)

    def __radd__(self, other):
        return self._op("{} + {}", other, self)

    def __sub__(self, other):
        return self._op("{} - {}", self, other)

    def __rsub__(self, other):
        return self._op("{} - {}", other, self)

    def __mul__(self, other):
        return self._op("{} * {}", self, other)

    def __rmul__(self, other):
        return self._op("{} * {}", other, self)

    def __truediv__(self, other):
        return self._op("{} / {}", self, other)

    def __rtruediv__(self, other):
        return self._op("{} / {}", other, self)

    def __neg__(self):
        return self._op("-{}", self)

    # the prims (``rules.prims`` dispatches through these methods)
    def sqrt(self):
        return self._op("fo_sqrt({})", self)

    def sign(self):  # torch.sign: 0 for NaN and for either zero
        return self._op("fo_sign({})", self)

    def maximum(self, other):  # torch.maximum: NaN wins
        return self._op("fo_maximum({}, {})", self, other)

    def clamp(self, lo, hi):  # torch.clamp: NaN stays NaN
        return self._op("fo_minimum(fo_maximum({}, {}), {})", self, lo, hi)

    def __bool__(self):
        raise TypeError("a rule's update branches on FLAGS only, never on a tensor's values")


class Tracer:
    def __init__(self):
        self.lines: list[str] = []

    def operand(self, value) -> str:
        if isinstance(value, Sym):
            return value.name
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"a rule's update may combine tensors with numbers only, got {type(value).__name__}")
        return _literal(value)

    def emit(self, expression: str) -> Sym:
        name = f"t{len(self.lines)}"
        self.lines.append(f"const {LANE_TYPE} {name} = {expression};")
        return Sym(self, name)


def trace(update: Callable, inputs: list[str], scalars: list[str], flags: tuple) -> tuple[list[str], list]:
    """``update`` on C++ variables ``inputs`` (p, g, each state; ``""`` for an inactive state) and scalar
    expressions ``scalars``: (statements, one output per result: a variable name, or None)."""
    tracer = Tracer()
    args = [Sym(tracer, name) if name else None for name in inputs]
    scalar_args = [Sym(tracer, expr) for expr in scalars]
    outputs = update(*args, *scalar_args, *flags)
    return tracer.lines, [None if out is None else tracer.operand(out) for out in outputs]
