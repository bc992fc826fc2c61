"""What gradient release saves and costs in ``fastoptim train``: runs with and without ``--gradient-release`` side
by side, each in its own process, and prints a markdown table.

    python tools/release_memory.py [--config default|100m|both] [--bits 32,8] [--steps 6] [--rounds 1]
                                   [--malloc glibc|live]
    python tools/release_memory.py --many-tensors ROUNDS

Peak memory is the process's maximum resident memory over its whole life (``peak_rss_mb`` of the summary): the
runs differ only in the flag, so the difference is what release saves, set against the grads' bytes (fp32 params:
4 bytes each). Step time is the median over steps after the first two of each run; with ``--rounds N`` the
pairs alternate (off, on, on, off, ...) so a machine's drift falls on both alike, and the overhead is the median
of the per-round ratios. Clipping is off in both runs (release refuses it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CONFIGS = {  # the default GPT (``fastoptim train``'s defaults), and one of about 113M params
    "default": [],
    "100m": ["--n-layer", "16", "--n-head", "12", "--n-kv-head", "12", "--n-embd", "768", "--batch-size", "1",
             "--block-size", "64", "--grad-checkpointing"],
}
# glibc keeps freed blocks below its mmap threshold (which rises to 32 MiB as large blocks are freed) for reuse,
# so a process's resident peak also counts memory it no longer uses; "live" returns every block over 64 KiB to
# the system when freed, so the peak counts only what is in use
MALLOC = {"glibc": {}, "live": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def run(config: str, bits: int, release: bool, steps: int, out: str, malloc: str) -> dict:
    path = os.path.join(out, "summary.json")
    cmd = [sys.executable, "-m", "fastoptim", "train", *CONFIGS[config], "--state-bits", str(bits),
           "--steps", str(steps), "--warmup", "1", "--eval-every", str(steps), "--eval-batches", "1",
           "--save-every", str(10 * steps), "--sample-tokens", "0", "--no-progress", "--max-grad-norm", "none",
           "--out-dir", out, "--json", path] + (["--gradient-release"] if release else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **MALLOC[malloc]})
    with open(path) as f:
        summary = json.load(f)
    tokens = [e["tokens_per_s"] for e in summary["log"][2:]] or [summary["tokens_per_s"]]
    return {"rss": summary["peak_rss_mb"], "params": summary["params"], "tokens_per_s": statistics.median(tokens),
            "loss": summary["final_loss"]}


def many_tensors(rounds: int, layers: int = 2000, width: int = 32) -> None:
    """Buckets against a call per param: a stack of ``layers`` small Linear layers (2 tensors each), a training
    step (forward, backward, step) timed without release, with the default buckets, and with a bucket per param;
    the three alternate within each round, and each overhead is the median of its per-round ratios."""
    import time

    import torch

    import fastoptim

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    kinds = {"off": {}, "buckets": dict(gradient_release=True), "per param": dict(gradient_release=True,
                                                                                    release_bucket_mb=1e-6)}
    runs = {}
    for kind, extra in kinds.items():
        m = model()
        runs[kind] = (m, fastoptim.AdamW(m.parameters(), lr=1e-4, **extra))
    x = torch.randn(8, width)

    def step(kind):
        m, opt = runs[kind]
        t0 = time.perf_counter()
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    for kind in kinds:  # warm-up: states made, plans and tables built
        step(kind), step(kind)
    times = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in (list(kinds) if r % 2 == 0 else list(reversed(kinds))):
            times[kind].append(step(kind))
    base = times["off"]
    print(f"\n{layers * 2} tensors ({layers} Linear({width}, {width})), AdamW, a training step, median of {rounds}:")
    print("| release | step (ms) | overhead |\n|---|---|---|")
    for kind in kinds:
        ratio = statistics.median(t / b for t, b in zip(times[kind], base)) - 1
        print(f"| {kind} | {statistics.median(times[kind]) * 1e3:.1f} | {ratio:+.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=[*CONFIGS, "both"], default="both")
    ap.add_argument("--bits", default="32,8", help="state bits, comma-separated")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1, help="off/on pairs per configuration, alternating")
    ap.add_argument("--malloc", choices=list(MALLOC), default="glibc",
                    help="glibc: the allocator as it comes; live: freed blocks over 64 KiB go back to the system")
    ap.add_argument("--many-tensors", type=int, default=0, metavar="ROUNDS",
                    help="instead: buckets against a call per param on 4000 small tensors, ROUNDS rounds")
    args = ap.parse_args()
    if args.many_tensors:
        return many_tensors(args.many_tensors)
    configs = list(CONFIGS) if args.config == "both" else [args.config]
    print("| config | params | state | peak RSS off (MiB) | peak RSS on (MiB) | saved (MiB) | grad bytes (MiB) "
          "| saved / grad bytes | tokens/s off | tokens/s on | step-time overhead | same loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for config in configs:
        for bits in map(int, args.bits.split(",")):
            pairs = []
            with tempfile.TemporaryDirectory() as out:
                for r in range(args.rounds):
                    order = (False, True) if r % 2 == 0 else (True, False)
                    got = {release: run(config, bits, release, args.steps, out, args.malloc) for release in order}
                    pairs.append((got[False], got[True]))
            off = min((a for a, _ in pairs), key=lambda s: s["rss"])
            on = min((b for _, b in pairs), key=lambda s: s["rss"])
            grad_mib = off["params"] * 4 / 2 ** 20
            saved = off["rss"] - on["rss"]
            overhead = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] - 1 for a, b in pairs)
            same = all(a["loss"] == b["loss"] for a, b in pairs)
            print(f"| {config} | {off['params'] / 1e6:.1f}M | {bits}-bit | {off['rss']:.0f} | {on['rss']:.0f} | "
                  f"{saved:.0f} | {grad_mib:.0f} | {saved / grad_mib:.0%} | {statistics.median(a['tokens_per_s'] for a, _ in pairs):.0f} | "
                  f"{statistics.median(b['tokens_per_s'] for _, b in pairs):.0f} | {overhead:+.1%} | {same} |", flush=True)


if __name__ == "__main__":
    main()
