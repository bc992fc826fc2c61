"""Peak memory of a whole training process at each state format, as a user sees it (the first step included).

The model has one 8M-element tensor: an ``Embedding(8192, 1024)`` and 16 ``Linear(1024, 1024)`` (24.1M params).
Each run is a process of its own (AdamW, 4 steps, one thread) and reports its peak resident memory, its first
optimizer step's time and its state's bytes; ``--load`` first loads a torch.optim AdamW checkpoint (fp32 state,
saved by a run before) into the optimizer. Run it twice: with glibc as it comes, and with freed blocks returned
(``MALLOC_MMAP_THRESHOLD_=65536``), since glibc's rising mmap threshold keeps a freed temporary's pages.

    python tools/low_bit_memory.py [--formats fp32 dynamic8 fp8 dynamic4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

CHECKPOINT = os.path.join(tempfile.gettempdir(), "fastoptim_low_bit_memory_torch_adamw.pt")


def model():
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Embedding(8192, 1024)]
    for _ in range(16):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def step(net, opt) -> float:
    """One training step; returns the optimizer step's own seconds."""
    import torch

    tokens = torch.randint(0, 8192, (8, 64), generator=torch.Generator().manual_seed(1))
    net(tokens).square().mean().backward()
    start = time.perf_counter()
    opt.step()
    seconds = time.perf_counter() - start
    opt.zero_grad()
    return seconds


def child(fmt: str, load: bool) -> dict:
    import torch

    import fastoptim
    from fastoptim import storage

    torch.set_num_threads(1)
    net = model()
    if fmt == "torch":
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    else:
        opt = fastoptim.AdamW(net.parameters(), lr=1e-3, state_format=fmt, impl="fused")
    if load:
        opt.load_state_dict(torch.load(CHECKPOINT, weights_only=True))
    first = step(net, opt)
    for _ in range(3):
        step(net, opt)
    if fmt == "torch" and not load and not os.path.exists(CHECKPOINT):
        torch.save(opt.state_dict(), CHECKPOINT)
    state = sum(storage.nbytes(v) for s in opt.state.values() for k, v in s.items() if k != "step")
    return {"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "first_step_ms": 1e3 * first,
            "state_mib": state / 2 ** 20}


def run(fmt: str, load: bool, env: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", fmt] + (["--load"] if load else []), env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["fp32", "dynamic8", "fp8", "dynamic4"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.load)))
        return
    if os.path.exists(CHECKPOINT):
        os.remove(CHECKPOINT)
    run("torch", False, dict(os.environ))  # writes the torch.optim checkpoint
    rows = [("torch", False)] + [(f, False) for f in args.formats] + [(f, True) for f in args.formats]
    print("| state | load torch ckpt | glibc as it comes: peak MiB | freed blocks returned: peak MiB | first step ms "
          "| state MiB |\n|---|---|---|---|---|---|")
    for fmt, load in rows:
        results = {}
        for label, extra in (("glibc", {}), ("returned", {"MALLOC_MMAP_THRESHOLD_": "65536"})):
            got = [run(fmt, load, {**os.environ, **extra}) for _ in range(args.repeats)]
            results[label] = got
        peaks = {k: statistics.median(r["peak_mib"] for r in v) for k, v in results.items()}
        first = statistics.median(r["first_step_ms"] for v in results.values() for r in v)
        print(f"| {fmt} | {'yes' if load else ''} | {peaks['glibc']:.0f} | {peaks['returned']:.0f} | {first:.1f} | "
              f"{results['glibc'][0]['state_mib']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
