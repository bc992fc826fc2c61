"""Muon's step against torch.optim.Muon's on the matrix sets of ``fastoptim bench``'s workloads (rect4k,
square1k, gpt256), in one process, rounds interleaved:

    python tools/muon_speed.py rect4k torch keller-auto polar_express-gram --threads 2 --rounds 21

A config is ``torch`` or ``COEFFICIENTS-METHOD`` (``keller`` or ``polar_express``; ``auto``, ``standard`` or
``gram``). Each line: the median step time, and the median over rounds of the first config's time over this
one's (each round times every config once, so a ratio compares steps taken moments apart on a noisy machine),
with its quartiles.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fastoptim
from fastoptim.bench.workloads import MATRIX_SETS


def make(config: str, shapes: list) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    if config == "torch":
        return torch.optim.Muon(params, lr=0.02)
    coefficients, method = config.rsplit("-", 1)
    return fastoptim.Muon(params, lr=0.02, ns_coefficients=coefficients, ns_method=method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("matrices", choices=sorted(MATRIX_SETS))
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    optimizers = {c: make(c, MATRIX_SETS[args.matrices]) for c in args.configs}
    for opt in optimizers.values():  # (first steps: state, plans, builds)
        opt.step()
        opt.step()
    times: dict[str, list[float]] = {c: [] for c in args.configs}
    for _ in range(args.rounds):
        for c, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            times[c].append(time.perf_counter() - start)
    first = times[args.configs[0]]
    for c, ts in times.items():
        ratios = sorted(a / b for a, b in zip(first, ts))
        q = len(ratios) // 4
        print(f"{args.matrices} threads={args.threads} {c:20s} {statistics.median(ts) * 1e3:8.1f} ms   "
              f"{args.configs[0]}/this {statistics.median(ratios):.2f}x (quartiles {ratios[q]:.2f}-{ratios[-q - 1]:.2f})")


if __name__ == "__main__":
    main()
