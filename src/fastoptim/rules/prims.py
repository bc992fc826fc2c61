"""The primitives a rule's ``update`` may call besides arithmetic operators.

Each dispatches through a method, so one rule source runs on a ``torch.Tensor`` (loop level) and on a
``TensorList`` (foreach level). The fused level swaps these module globals for Triton's.
"""


def sqrt(x):
    return x.sqrt()


def sign(x):
    return x.sign()


def maximum(a, b):
    return a.maximum(b)


def clamp(x, lo, hi):
    """``min(max(x, lo), hi)`` as torch.clamp: NaN stays NaN; ``lo`` and ``hi`` are scalars."""
    return x.clamp(lo, hi)
