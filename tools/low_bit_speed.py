"""AdamW's step at each state format against torch's fused fp32 step, interleaved in one process.

Default: the gpt workload's shapes (24.4M params), torch's threads, the median of 11 rounds. ``--per-element``:
one thread, one 256x1024 tensor (its data in L2), the fastest of 30 rounds as ns an element: the compute cost
apart from the machine's memory bandwidth. ``--avx2`` builds the CPU kernel without AVX-512.

    python tools/low_bit_speed.py [--per-element] [--avx2] [--formats bf16 dynamic8 fp8 dynamic4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fastoptim
from fastoptim.bench.workloads import gpt_shapes
from fastoptim.paths.cpu_kernel import kernels


def optimizer(kind: str, shapes: list[tuple[int, ...]]):
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    if kind == "torch fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    return fastoptim.AdamW(params, lr=1e-3, impl="fused", state_format=kind, min_quant_size=0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["bf16", "dynamic8", "fp8", "dynamic4"])
    ap.add_argument("--per-element", action="store_true")
    ap.add_argument("--avx2", action="store_true")
    args = ap.parse_args(argv)
    if args.avx2:
        kernels.CXXFLAGS = kernels.CXXFLAGS + ("-mno-avx512f",)
    torch.manual_seed(0)
    if args.per_element:
        torch.set_num_threads(1)
    shapes = [(256, 1024)] if args.per_element else gpt_shapes(25_000_000)
    kinds = ["torch fused", *args.formats]
    opts = {k: optimizer(k, shapes) for k in kinds}
    for opt in opts.values():  # builds, state, warm caches
        opt.step()
        opt.step()
    times = {k: [] for k in kinds}
    for _ in range(30 if args.per_element else 11):
        for kind, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            times[kind].append(time.perf_counter() - start)
    build = "AVX2" if args.avx2 else "native"
    elements = sum(torch.Size(s).numel() for s in shapes)
    print(f"{build} build, {torch.get_num_threads()} threads, {elements / 1e6:.1f}M params")
    if args.per_element:
        for kind in kinds:
            print(f"| {kind} | {min(times[kind]) * 1e9 / elements:.2f} ns an element |")
        return
    base = statistics.median(times["torch fused"])
    for kind in kinds:
        median = statistics.median(times[kind])
        print(f"| {kind} | {median * 1e3:.2f} ms | {median / base:.2f}x torch fused |")


if __name__ == "__main__":
    main()
