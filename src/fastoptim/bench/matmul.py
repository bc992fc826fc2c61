"""Muon's physical limit is matrix-multiply throughput: Newton-Schulz FLOPs per step (per method: standard or
Gram iterations), and the rate this machine multiplies the same matrices at (torch's batched products, same
dtype, same run)."""

from __future__ import annotations

import statistics
from collections import Counter

import torch

from .. import timing
from ..rules import newton_schulz as ns


def _oriented(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the products Newton-Schulz takes of a matrix, wide: a tall one iterates on its right-hand
    Gram, which takes the same products as its transpose would."""
    rows, cols = shape
    return (rows, cols) if rows <= cols else (cols, rows)


def newton_schulz_flops(shapes: list[tuple[int, ...]], steps: int, coefficients=ns.KELLER, method: str = "standard",
                        dtype: torch.dtype = torch.float32) -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations (``coefficients``: a preset's name or triples, as
    ``ns_coefficients`` takes) on every matrix, by the method each takes (``method`` "auto" resolves per shape
    and ``dtype`` as the step does): standard, X X^T (2 a^2 b), A A (2 a^3), B X (2 a^2 b) per iteration for an
    a x b matrix, a <= b (``newton_schulz.standard_cost``); Gram, ``newton_schulz.gram_cost``. The scaled
    additions (O(a^2 + ab)) are left out."""
    schedule = ns.schedule(coefficients, steps)
    if not schedule:
        return 0
    total = 0
    for shape in shapes:
        a, b = _oriented(shape)
        if ns.resolve_method(method, a, b, schedule, dtype) == "gram":
            total += ns.gram_cost(a, b, schedule)
        else:
            total += ns.standard_cost(a, b, steps)
    return total


def method_label(shapes: list[tuple[int, ...]], steps: int, coefficients, method: str,
                 dtype: torch.dtype) -> str:
    """``coefficients/method`` as a row runs them: "keller/standard", "polar_express/gram"; "auto" says what it
    resolved to on these shapes ("keller/auto: gram on 12 of 49")."""
    schedule = ns.schedule(coefficients, steps)
    if isinstance(coefficients, str):
        name = coefficients
    else:
        name = next((k for k, make in ns.PRESETS.items() if tuple(make(steps)) == schedule), "custom")
    if method != "auto":
        return f"{name}/{method}"
    gram = sum(bool(schedule) and ns.resolve_method(method, *_oriented(s), schedule, dtype) == "gram" for s in shapes)
    resolved = "standard" if not gram else "gram" if gram == len(shapes) else f"gram on {gram} of {len(shapes)}"
    return f"{name}/auto: {resolved}"


def settings_flops(shapes: list[tuple[int, ...]], settings: dict, device="cpu") -> tuple[int, str, torch.dtype]:
    """(FLOPs per step, method label, dtype) of Newton-Schulz with ``settings`` (``runner.NS_OPTIONS``) on
    ``shapes``, in the dtype it runs in on ``device`` (``ns_dtype`` None: ``fast_matmul_dtype``)."""
    from ..rules.muon import ns_dtype_for

    dtype = ns_dtype_for(settings["ns_dtype"], torch.device(device).type)
    how = (shapes, settings["ns_steps"], settings["ns_coefficients"], settings["ns_method"], dtype)
    return newton_schulz_flops(*how), method_label(*how), dtype


def newton_schulz_rows(rows, shapes: list[tuple[int, ...]], device="cpu") -> None:
    """Each row that runs Newton-Schulz (``Row.ns``) gets its FLOPs per step on ``shapes`` and its method's
    label (``settings_flops``)."""
    for row in rows:
        if row.ns is not None:
            row.flops, row.method, _ = settings_flops(shapes, row.ns, device)


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
