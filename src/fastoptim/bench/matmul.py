"""Muon's physical limit is matrix-multiply throughput: Newton-Schulz FLOPs per step, and the rate this
machine multiplies the same matrices at (torch's batched products, same dtype, same run)."""

from __future__ import annotations

import statistics
from collections import Counter

import torch

from .. import timing


def _oriented(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the products Newton-Schulz takes of a matrix, wide: a tall one iterates on its right-hand
    Gram, which takes the same products as its transpose would."""
    rows, cols = shape
    return (rows, cols) if rows <= cols else (cols, rows)


def newton_schulz_flops(shapes: list[tuple[int, ...]], steps: int) -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations on every matrix: X X^T (2 a^2 b), A A (2 a^3), B X (2 a^2 b)
    for an a x b matrix, a <= b. The scaled additions (O(a^2 + ab)) are left out."""
    total = 0
    for shape in shapes:
        a, b = _oriented(shape)
        total += steps * (4 * a * a * b + 2 * a ** 3)
    return total


def gemm_rate(shapes: list[tuple[int, ...]], dtype=torch.float32, device="cpu", rounds: int = 5) -> float:
    """FLOP/s of the products of one Newton-Schulz iteration on ``shapes``, batched by shape as the fused level
    batches them (``torch.bmm``), median of ``rounds``: the rate the step's products could reach here."""
    groups = Counter(_oriented(s) for s in shapes)
    operands = []
    for (a, b), n in groups.items():
        x = torch.randn(n, a, b, dtype=dtype, device=device)
        gram = torch.randn(n, a, a, dtype=dtype, device=device)
        operands.append((x, gram))
    flops = sum(n * (4 * a * a * b + 2 * a ** 3) for (a, b), n in groups.items())
    now = timing.clock([device])

    def once() -> float:
        t0 = now()
        for x, gram in operands:
            torch.bmm(x, x.mT)
            torch.bmm(gram, gram)
            torch.bmm(gram, x)
        return now() - t0

    once()  # warm-up
    return flops / statistics.median(once() for _ in range(rounds))
