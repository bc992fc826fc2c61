"""The CPU kernel alone: AdamW's fused step at each stored format, ns an element, without the optimizer's Python.

A step of the optimizer runs once, its kernel call is kept (``kernels.run``'s arguments), and that call alone
is timed: the fastest of ``--rounds``, one tensor of ``--rows`` x ``--cols``, ``--threads`` threads (1 by
default). torch's fused fp32 step on the same tensor is timed beside it (its Python is a small part there).
``--avx2`` builds the kernel without AVX-512. Row length decides the blocks of the block-scaled formats (rows of
64 make blocks of 64, as mlp2000's layers do).

    python tools/kernel_speed.py [--rows 1024 --cols 1024] [--formats bf16 dynamic8 fp8 dynamic4] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

import fastoptim
from fastoptim.paths.cpu_kernel import kernels


def kernel_call(fmt: str, shape: tuple[int, int]):
    """The kernel call of one AdamW step at ``fmt`` (its states hold real values: the second step's)."""
    p = torch.nn.Parameter(torch.randn(shape) * 0.02)
    p.grad = torch.randn(shape) * 1e-3
    opt = fastoptim.AdamW([p], lr=1e-3, impl="fused", state_format=fmt, min_quant_size=0)
    opt.step()
    calls = []
    real = kernels.run

    def keep(*args):
        calls.append(args)
        return real(*args)

    kernels.run = keep
    try:
        opt.step()
    finally:
        kernels.run = real
    if len(calls) != 1:
        raise RuntimeError(f"{fmt}: the step made {len(calls)} kernel calls, not one (did it run staged?)")
    return (p, opt), calls[0]


def fastest(step, rounds: int) -> float:
    step()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["bf16", "dynamic8", "fp8", "dynamic4"])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--avx2", action="store_true")
    args = ap.parse_args(argv)
    if args.avx2:
        kernels.CXXFLAGS = kernels.CXXFLAGS + ("-mno-avx512f",)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = (args.rows, args.cols)
    n = args.rows * args.cols
    p = torch.nn.Parameter(torch.randn(shape) * 0.02)
    p.grad = torch.randn(shape) * 1e-3
    reference = torch.optim.AdamW([p], lr=1e-3, fused=True)
    times = {"torch fused fp32 (whole step)": fastest(reference.step, args.rounds)}
    for fmt in args.formats:
        owners, call = kernel_call(fmt, shape)  # (the call's table holds addresses: its tensors must live)
        times[f"{fmt} (kernel)"] = fastest(lambda: kernels.run(*call), args.rounds)
        del owners, call
    build = "AVX2" if args.avx2 else "native"
    print(f"{build} build, {args.threads} thread(s), one {args.rows}x{args.cols} tensor, fastest of {args.rounds}")
    for label, seconds in times.items():
        print(f"| {label} | {seconds * 1e9 / n:.2f} ns an element |")


if __name__ == "__main__":
    main()
