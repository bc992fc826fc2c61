"""``fastoptim curves``: loss curves of the same model, seed and batches under torch.optim and fastoptim."""

from __future__ import annotations

import argparse
import json
import sys

from .. import curves, registry
from ..levels import LEVELS


def add_parser(sub) -> None:
    p = sub.add_parser("curves", help="learning curves vs torch.optim (PNG, table, JSON)", description=__doc__)
    p.add_argument("--optimizer", "-o", nargs="+", choices=list(registry.OPTIMIZERS),
                   default=["adamw", "sgd", "lion"], help="optimizers (default: adamw sgd lion)")
    p.add_argument("--impl", nargs="+", choices=list(LEVELS), default=list(LEVELS),
                   help="fastoptim levels (default: all)")
    p.add_argument("--flat", nargs="*", choices=list(LEVELS), default=["fused"],
                   help="levels to run again with flat=True (default: fused)")
    p.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="curves.png", help="PNG path (default: curves.png)")
    p.add_argument("--json", metavar="PATH", help="write the curves and the differences as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        print("fastoptim curves: --steps must be >= 1", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("fastoptim curves: the PNG needs matplotlib (pip install 'fastoptim[bench]')", file=sys.stderr)
        return 2
    result = curves.run(args.optimizer, args.impl, args.flat, args.steps, args.seed)
    diffs = curves.max_differences(result)
    curves.plot(result, args.out)
    _print(diffs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "seed": args.seed, "differences": diffs,
                       "curves": [{"optimizer": c.optimizer, "curve": c.label, "losses": c.losses}
                                  for c in result]}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


def _print(diffs: list[dict]) -> None:
    headers = ["optimizer", "curve", "vs", "max |loss diff| at any step", "final loss", "reference final"]
    rows = [[d["optimizer"], d["curve"], d["reference"], f"{d['max_abs_diff']:.3g}", f"{d['final_loss']:.4f}",
             f"{d['reference_final_loss']:.4f}"] for d in diffs]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print("  ".join(headers))
        for row in rows:
            print("  ".join(row))
        return
    table = Table(title="fastoptim vs reference, same seed and batches")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < 3 else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=120).print(table)
