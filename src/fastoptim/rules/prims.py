"""The primitives a rule's ``update`` may call besides arithmetic operators.

Each dispatches through a method, so one rule source runs on a ``torch.Tensor`` (loop level) and on a
``TensorList`` (foreach level). The fused level swaps these module globals for Triton's.
"""

from torch import Tensor


def sqrt(x):
    return x.sqrt()


def sign(x):
    return x.sign()


def maximum(a, b):
    """torch.maximum: NaN wins. ``b`` is a tensor or a scalar (``maximum(sqrt(v), eps)``); a torch.Tensor's
    ``maximum`` takes no scalar, and ``clamp_min`` is the same operation on one."""
    if isinstance(a, Tensor) and isinstance(b, (int, float)):
        return a.clamp_min(b)
    return a.maximum(b)


def clamp(x, lo, hi):
    """``min(max(x, lo), hi)`` as torch.clamp: NaN stays NaN; ``lo`` and ``hi`` are scalars."""
    return x.clamp(lo, hi)
