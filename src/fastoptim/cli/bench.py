"""``fastoptim bench``: one optimizer step, every level and torch.optim side by side, in one process."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from . import state_format
from .. import bench, levels, registry
from ..levels import LEVELS


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time optimizer steps: fastoptim levels vs torch.optim vs the flat floor",
                       description=__doc__)
    p.add_argument("--workload", "-w", nargs="+", type=_argtype(bench.check_workload), default=["mlp2000", "gpt"],
                   help=f"parameter sets to step: {', '.join(bench.WORKLOADS)}, or the params of any "
                        "torch.nn.Module as package.module:callable (default: mlp2000 gpt)")
    p.add_argument("--optimizer", "-o", nargs="+", choices=list(registry.OPTIMIZERS), default=["adamw"],
                   help="optimizers to time (default: adamw)")
    p.add_argument("--impl", nargs="+", choices=list(LEVELS), default=list(LEVELS),
                   help="fastoptim levels to time (default: all)")
    p.add_argument("--flat", nargs="*", choices=list(LEVELS), default=["fused", "compiled"],
                   help="levels to time again with flat=True buffers (default: fused compiled)")
    p.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                   help="clip the global grad norm: fastoptim in the step (max_grad_norm), torch with "
                        "clip_grad_norm_ first; adds a fastoptim row with the separate clip pass")
    p.add_argument("--no-schedulers", action="store_true", help="skip the scheduler-overhead table")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of the results (needs matplotlib)")
    p.add_argument("--params", type=_argtype(bench.parse_count), default=25_000_000,
                   help="size of the gpt and flat workloads, e.g. 25M, 1.5B (default: 25M)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default: 7)")
    p.add_argument("--steps", type=int, default=3, help="steps per round (default: 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (default: 2)")
    p.add_argument("--quick", action="store_true", help="seconds, not minutes: small sizes, 3 rounds of 1 step")
    p.add_argument("--peers", choices=bench.PEER_MODES, default="fp32",
                   help="none; torch (torch.optim loop/foreach/fused); fp32 (also installed libraries' "
                        "full-precision optimizers: optimi, heavyball, bitsandbytes); all (also their 8/4-bit "
                        "optimizers, torchao's, and torch.compile of torch's step) (default: fp32)")
    p.add_argument("--no-peers", action="store_const", const="none", dest="peers",
                   help="same as --peers none")
    p.add_argument("--state-format", nargs="+", default=None, choices=state_format.names(), metavar="FORMAT",
                   action=state_format.Agreeing,
                   help="time each level again with its state kept in these formats: "
                        f"{', '.join(state_format.names())} (state_format=)")
    p.add_argument("--state-bits", type=int, nargs="+", default=None, choices=(16, 8, 4), metavar="BITS",
                   action=state_format.Agreeing,
                   help="--state-format by width: 16 (bf16), 8, 4 (state_bits=)")
    p.add_argument("--own-paths", action="store_true",
                   help="every level runs its own path (no routing to a faster level's path)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the params live; auto: cuda if there is one, else cpu (default: auto)")
    p.add_argument("--json", metavar="PATH", help="write results as JSON (schema in docs/bench.md)")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    p.set_defaults(func=run)


def _argtype(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:  # argparse shows an ArgumentTypeError's own words
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__
    return convert


def run(args: argparse.Namespace) -> int:
    # torch's profiler (kineto) logs two lines as it starts and stops, and the peak-memory pass starts it once a row
    # on the CPU; a level above its own (read at its first start) keeps them out of the tables' output
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    threads = torch.get_num_threads()
    try:
        with levels.own_paths(args.own_paths):
            return _run(args)
    finally:  # ``--threads`` is this run's: a caller in the same process keeps its own
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        print("fastoptim bench: --rounds and --steps must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    if args.clip is not None and not args.clip > 0:
        print(f"fastoptim bench: --clip must be > 0, got {args.clip}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fastoptim bench: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else (
        "cpu" if args.device == "auto" else args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = state_format.resolve(args.state_bits, args.state_format)  # (the parser checked they agree)
    args.state_bits, args.state_format = [c.key for c in formats], [c.name for c in formats]
    if args.quick:
        args.params = min(args.params, 2_000_000)
        args.rounds, args.steps, args.warmup = 3, 1, 1
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("fastoptim bench: --plot needs matplotlib (pip install 'fastoptim[bench]')", file=sys.stderr)
            return 2
    jobs = []
    for workload in args.workload:
        try:
            shapes = bench.shapes_for(workload, args.params)
        except ValueError as e:
            print(f"fastoptim bench: {e}", file=sys.stderr)
            return 2
        if args.quick and workload == "mlp2000":
            shapes = shapes[:400]  # 200 layers
        for optimizer in args.optimizer:
            spec = registry.get(optimizer)
            taken = shapes
            if spec.params == "matrices":  # Muon steps the workload's matrices
                taken = [s for s in shapes if len(s) == 2]
                if not taken:
                    print(f"fastoptim bench: {optimizer} steps matrices; workload {workload} has none",
                          file=sys.stderr)
                    return 2
            flat = args.flat
            if flat and not spec.takes_flat(set(taken)):
                print(f"fastoptim bench: no flat rows for {optimizer} on {workload}: flat=True keeps param-shaped "
                      "states only", file=sys.stderr)
                flat = []
            rows = bench.rows_for(optimizer, args.impl, flat, args.peers, args.clip, tuple(args.state_bits))
            jobs.append((workload, optimizer, taken, rows))
    total = sum(len(rows) * (2 + args.rounds) for *_, rows in jobs)  # first step, rounds, peak memory
    results = []
    with _progress(total) as advance:
        for workload, optimizer, shapes, rows in jobs:
            bench.run_workload(shapes, rows, args.rounds, args.steps, args.warmup, advance, device)
            results.append(bench.to_dict(workload, optimizer, bench.numel(shapes), len(shapes), rows,
                                         _matmul(optimizer, shapes, device, rows)))
    schedulers = None if args.no_schedulers else bench.time_schedulers(rounds=3 if args.quick else 7)
    print(bench.environment_line(bench.environment()))
    bench.print_tables(results, schedulers)
    config = {k: v for k, v in vars(args).items() if k != "func"} | {"device": device}
    if args.json:
        bench.write_json(args.json, results, config, schedulers)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(bench.markdown(results, schedulers))
    if args.plot:
        bench.plot(results, args.plot)
    return 0


def _matmul(optimizer: str, shapes: list, device: str, rows: list) -> dict | None:
    """For a rule with Newton-Schulz (Muon, NorMuon): its FLOPs per step with the default settings, each row's
    own (``Row.flops``: per method and preset), and the GEMM rate on the same matrices, measured now (in the
    dtype ``ns_dtype=None`` picks on ``device``)."""
    spec = registry.get(optimizer)
    if "ns_steps" not in spec.rule.defaults:
        return None
    group = {**spec.rule.defaults, **spec.option_sets[0]}
    flops, method, dtype = bench.settings_flops(shapes, {k: group[k] for k in bench.NS_OPTIONS}, device)
    bench.newton_schulz_rows(rows, shapes, device)
    return {"flops_per_step": flops, "method": method, "dtype": str(dtype).replace("torch.", ""),
            "gemm_gflops": bench.gemm_rate(shapes, dtype, device) / 1e9}


class _progress:
    """A rich progress bar when rich is installed, silence otherwise."""

    def __init__(self, total: int):
        self.total = total
        self.bar = None

    def __enter__(self):
        try:
            from rich.progress import Progress
        except ImportError:
            return lambda: None
        self.bar = Progress(transient=True)
        self.bar.start()
        task = self.bar.add_task("timing optimizer steps", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
