"""Two fastoptim trees side by side in ONE process: is a change slower than the tree before it?

    python tools/ab.py OLD_SRC [--workload gpt] [--rounds 21] [--bits 32,8,4] [--clip 1.0]
    python tools/ab.py OLD_SRC --tiny 4000x4x4 --threads 1    (host time: 4000 tensors of 4x4 elements)

OLD_SRC is another checkout's ``src`` folder (``git worktree add --detach ../old REV``, then ``../old/src``). Its
``fastoptim`` is imported under the name ``fastoptim_old`` (the engine imports itself relatively), this
checkout's as ``fastoptim``. For each configuration both step the same params and grads, and timing rounds
alternate old/new (ABBA), so the machine's drift falls on both alike; the answer is the median of the per-round
time ratios new/old, with their interquartile range. Separate bench runs of two trees differ by more than the
few percent asked about on a shared machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def _import_old(src: str):
    spec = importlib.util.spec_from_file_location("fastoptim_old", os.path.join(src, "fastoptim", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(src, "fastoptim")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["fastoptim_old"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old_src", help="the other checkout's src folder")
    ap.add_argument("--workload", default="mlp2000", help="a bench workload (default: mlp2000)")
    ap.add_argument("--params", type=int, default=25_000_000, help="size of the gpt workload")
    ap.add_argument("--optimizer", default="AdamW")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--steps", type=int, default=3, help="steps per round")
    ap.add_argument("--bits", default="32,8,4", help="state widths, comma-separated")
    ap.add_argument("--impls", default="foreach,fused,compiled")
    ap.add_argument("--flat", default="fused,compiled", help="levels to time again with flat=True ('' for none)")
    ap.add_argument("--clip", type=float, default=None, help="max_grad_norm")
    ap.add_argument("--tiny", default=None, metavar="NxSHAPE", help="N tensors of SHAPE instead of a workload "
                    "(the step's host time: 4000x4x4)")
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads")
    args = ap.parse_args()

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
    warnings.filterwarnings("ignore")
    import torch

    import fastoptim as new
    from fastoptim.bench.workloads import shapes_for

    old = _import_old(os.path.abspath(args.old_src))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        count, *shape = map(int, args.tiny.lower().split("x"))
        shapes, args.workload = [tuple(shape)] * count, f"{count} tensors of {tuple(shape)}"
    else:
        shapes = shapes_for(args.workload, args.params)

    def params():
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        return ps

    configs = [(impl, flat, bits) for bits in map(int, args.bits.split(","))
               for flat, impls in ((False, args.impls), (True, args.flat)) for impl in filter(None, impls.split(","))]
    print(f"{args.workload}, {args.optimizer}, clip={args.clip}: {args.rounds} rounds of {args.steps} steps; "
          f"new/old is the median of per-round ratios (IQR)", flush=True)
    for impl, flat, bits in configs:
        kw = dict(impl=impl, flat=flat, lr=1e-3)
        if bits != 32:
            kw["state_bits"] = bits
            if args.tiny:
                kw["min_quant_size"] = 0  # (tiny tensors keep plain state otherwise)
        if args.clip:
            kw["max_grad_norm"] = args.clip
        opts = {}
        for name, module in (("old", old), ("new", new)):
            opts[name] = getattr(module, args.optimizer)(params(), **kw)
            for _ in range(3):  # builds, compiles, warm-up
                opts[name].step()
        times = {"old": [], "new": []}
        for r in range(args.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                start = time.perf_counter()
                for _ in range(args.steps):
                    opts[name].step()
                times[name].append((time.perf_counter() - start) / args.steps * 1e3)
        ratios = [n / o for n, o in zip(times["new"], times["old"])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"{impl:9s} {'flat' if flat else '    '} {bits:2d}-bit  old {statistics.median(times['old']):8.2f} ms"
              f"  new {statistics.median(times['new']):8.2f} ms  new/old {statistics.median(ratios):.3f}"
              f" ({q1:.3f}-{q3:.3f})", flush=True)
        del opts


if __name__ == "__main__":
    main()
