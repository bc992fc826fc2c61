"""What gradient release saves and costs in ``fastoptim train``: runs with and without ``--gradient-release`` side
by side, each in its own process, and prints a markdown table.

    python tools/release_memory.py [--config default,100m,small-batch] [--bits 32,8] [--steps 6]
                                   [--rounds 1] [--malloc glibc|live|tensors]
    python tools/release_memory.py --many-tensors ROUNDS
    python tools/release_memory.py --in-process ROUNDS [--config ...] [--bits ...]

Peak memory is the process's maximum resident memory over its whole life (``peak_rss_mb`` of the summary), or
with ``--malloc tensors`` the peak of the bytes held by live tensors, from torch's memory profiler over the whole
run (the allocator's own keeping left out): the runs differ only in the flag, so the difference is what release
saves, set against the grads' bytes (fp32 params: 4 bytes each). Step time is the median over steps after the
first two of each run; with ``--rounds N`` the pairs alternate (off, on, on, off, ...) so a machine's drift falls on
both alike, and the overhead is the median of the per-round ratios (none under the profiler). Clipping is off in
both runs (each would clip its own way: release by a measuring backward).
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
    # the default GPT at a batch of 1 x 8 tokens: its activations weigh less than its grads
    "small-batch": ["--batch-size", "1", "--block-size", "8"],
    "100m": ["--n-layer", "16", "--n-head", "12", "--n-kv-head", "12", "--n-embd", "768", "--batch-size", "1",
             "--block-size", "64", "--grad-checkpointing"],
}
# the released runs' own flags: the small batch's grads (3 MiB) in buckets of 64 KiB, not 1 MiB (a third of them)
RELEASE_FLAGS = {"small-batch": ["--release-bucket-mb", "0.0625"]}
# glibc keeps freed blocks below its mmap threshold (which rises to 32 MiB as large blocks are freed) for reuse,
# so a process's resident peak also counts memory it no longer uses; "live" returns every block over 64 KiB to
# the system when freed, so the peak counts only what is in use
# the system when freed, so the peak counts only what is in use; "tensors" counts live tensors' bytes instead
MALLOC = {"glibc": {}, "live": {"MALLOC_MMAP_THRESHOLD_": "65536"}, "tensors": {}}


def profiled(summary_path: str, argv: list[str]) -> None:
    """Runs ``fastoptim train`` with ``argv`` under torch's memory profiler and adds the peak of the live tensors'
    bytes (allocations minus frees, in time order, from the start of the run) to its JSON summary."""
    from torch.profiler import ProfilerActivity, profile

    from fastoptim.bench.memory import profiled_peak
    from fastoptim.cli import main as cli

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        rc = cli(["train", *argv])
    if rc:
        sys.exit(rc)
    peak = profiled_peak(prof)
    if peak is None:
        sys.exit("release_memory.py: torch's profiler recorded no memory events here; --malloc tensors needs them")
    with open(summary_path) as f:
        summary = json.load(f)
    summary["peak_tensors_mb"] = peak / 2 ** 20
    with open(summary_path, "w") as f:
        json.dump(summary, f)


def run(config: str, bits: int, release: bool, steps: int, out: str, malloc: str) -> dict:
    path = os.path.join(out, "summary.json")
    cmd = [sys.executable, "-m", "fastoptim", "train", *CONFIGS[config], "--state-bits", str(bits),
           "--steps", str(steps), "--warmup", "1", "--eval-every", str(steps), "--eval-batches", "1",
           "--save-every", str(10 * steps), "--sample-tokens", "0", "--no-progress", "--max-grad-norm", "none",
           "--out-dir", out, "--json", path]
    if release:
        cmd += ["--gradient-release", *RELEASE_FLAGS.get(config, [])]
    if malloc == "tensors":
        cmd[1:4] = [__file__, "--profiled", path, "--"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **MALLOC[malloc]})
    with open(path) as f:
        summary = json.load(f)
    tokens = [e["tokens_per_s"] for e in summary["log"][2:]] or [summary["tokens_per_s"]]
    return {"rss": summary["peak_tensors_mb" if malloc == "tensors" else "peak_rss_mb"], "params": summary["params"],
            "tokens_per_s": statistics.median(tokens),
            "loss": summary["final_loss"]}


def side_by_side(title: str, build, loss_of, kinds: dict, rounds: int) -> None:
    """A training step (forward, backward, step, zero_grad) of each kind of optimizer, on models built alike, in
    one process: the kinds alternate within each round (ABBA), and each overhead is the median of its per-round
    ratios to the first kind (with the middle half of those ratios, to show the spread), so the machine's drift
    falls on all alike."""
    import time

    import torch

    runs = {kind: build(extra) for kind, extra in kinds.items()}

    def step(kind):
        model, opt = runs[kind]
        t0 = time.perf_counter()
        loss_of(model).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    for kind in kinds:  # warm-up: states made, plans and tables built
        step(kind), step(kind)
    times = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in (list(kinds) if r % 2 == 0 else list(reversed(kinds))):
            times[kind].append(step(kind))
    base = times[next(iter(kinds))]
    print(f"\n{title}, a training step, median of {rounds} rounds (torch threads: {torch.get_num_threads()}):")
    print("| release | step (ms) | overhead | its middle half |\n|---|---|---|---|")
    for kind in kinds:
        ratios = [t / b - 1 for t, b in zip(times[kind], base)]
        q1, q2, q3 = statistics.quantiles(ratios, n=4) if rounds > 1 else ratios * 3
        print(f"| {kind} | {statistics.median(times[kind]) * 1e3:.1f} | {q2:+.1%} | {q1:+.1%} .. {q3:+.1%} |",
              flush=True)


def many_tensors(rounds: int, layers: int = 2000, width: int = 32) -> None:
    """Buckets against a call per param: a stack of ``layers`` small Linear layers (2 tensors each)."""
    import torch

    import fastoptim

    def build(extra):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        return model, fastoptim.AdamW(model.parameters(), lr=1e-4, **extra)

    x = torch.randn(8, width)
    kinds = {"off": {}, "buckets": dict(gradient_release=True),
             "per param": dict(gradient_release=True, release_bucket_mb=1e-6)}
    side_by_side(f"{layers * 2} tensors ({layers} Linear({width}, {width})), AdamW", build,
                 lambda m: m(x).square().mean(), kinds, rounds)


def gpt(rounds: int, config: str, bits: int) -> None:
    """``fastoptim train``'s GPT (its defaults, or the 100M config) with AdamW as train makes it, no clipping."""
    import dataclasses

    import torch

    from fastoptim import factory
    from fastoptim.train.loop import TrainConfig
    from fastoptim.train.model import GPT, GPTConfig

    sizes = dict(zip(CONFIGS[config][0::2], CONFIGS[config][1::2]))
    cfg = TrainConfig(**{k[2:].replace("-", "_"): int(v) for k, v in sizes.items() if k != "--grad-checkpointing"})
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    model_cfg = GPTConfig(**{k: v for k, v in dataclasses.asdict(cfg).items() if k in fields})
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (cfg.batch_size, cfg.block_size), generator=g)
    y = torch.randint(0, 256, (cfg.batch_size, cfg.block_size), generator=g)

    def build(extra):
        torch.manual_seed(0)
        model = GPT(model_cfg)
        return model, factory.create(model, "adamw", lr=1e-4, weight_decay=0.1, state_bits=bits, **extra)

    side_by_side(f"the {config} GPT, {bits}-bit state", build, lambda m: m(x, y)[1],
                 {"off": {}, "buckets": dict(gradient_release=True)}, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="default,100m", help=f"comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--bits", default="32,8", help="state bits, comma-separated")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1, help="off/on pairs per configuration, alternating")
    ap.add_argument("--malloc", choices=list(MALLOC), default="glibc",
                    help="glibc: the allocator as it comes; live: freed blocks over 64 KiB go back to the system; "
                         "tensors: the peak of live tensors' bytes (torch's memory profiler), not resident memory")
    ap.add_argument("--many-tensors", type=int, default=0, metavar="ROUNDS",
                    help="instead: buckets against a call per param on 4000 small tensors, ROUNDS rounds")
    ap.add_argument("--in-process", type=int, default=0, metavar="ROUNDS",
                    help="instead: step time of the GPT configs with and without release, alternating in one process")
    ap.add_argument("--profiled", metavar="SUMMARY", help=argparse.SUPPRESS)  # the child of --malloc tensors
    args, rest = ap.parse_known_args()
    if args.profiled:
        return profiled(args.profiled, rest[1:] if rest[:1] == ["--"] else rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    configs = args.config.split(",")
    if unknown := set(configs) - set(CONFIGS):
        ap.error(f"--config: no config {', '.join(sorted(unknown))} (choose from {', '.join(CONFIGS)})")
    if args.many_tensors:
        return many_tensors(args.many_tensors)
    if args.in_process:
        for config in configs:
            for bits in map(int, args.bits.split(",")):
                gpt(args.in_process, config, bits)
        return None
    what = "tensors" if args.malloc == "tensors" else "RSS"
    print(f"| config | params | state | peak {what} off (MiB) | peak {what} on (MiB) | saved (MiB) | grad bytes (MiB) "
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
            speed = (f"{statistics.median(a['tokens_per_s'] for a, _ in pairs):.0f} | "
                     f"{statistics.median(b['tokens_per_s'] for _, b in pairs):.0f} | {overhead:+.1%}")
            if args.malloc == "tensors":  # (the profiler's own cost swamps the step)
                speed = "(profiled) | (profiled) | (profiled)"
            print(f"| {config} | {off['params'] / 1e6:.1f}M | {bits}-bit | {off['rss']:.1f} | {on['rss']:.1f} | "
                  f"{saved:.1f} | {grad_mib:.1f} | {saved / grad_mib:.0%} | {speed} | {same} |", flush=True)


if __name__ == "__main__":
    main()
