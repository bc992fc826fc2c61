"""``fastoptim curves``: loss curves of the same model, seed and batches under torch.optim and fastoptim; with
``--state-format`` (or ``--state-bits``) / ``--rounding`` also each level with low-bit state or bf16 params, against
its 32-bit fp32 run."""

from __future__ import annotations

import argparse
import json
import sys

from . import state_format
from .. import curves, registry
from ..levels import LEVELS
from ..storage.rounding import ROUNDINGS


def add_parser(sub) -> None:
    p = sub.add_parser("curves", help="learning curves vs torch.optim (PNG, table, JSON)", description=__doc__)
    p.add_argument("--optimizer", "-o", nargs="+", type=_variant, metavar="OPTIMIZER",
                   default=["adamw", "sgd", "lion"],
                   help=f"optimizers: {', '.join(registry.OPTIMIZERS)}; a variant takes group options in brackets, "
                        "e.g. 'muon[ns_coefficients=polar_express,ns_method=gram]' (quoted for the shell), and "
                        "is run and labelled as written (default: adamw sgd lion)")
    p.add_argument("--impl", nargs="+", choices=list(LEVELS), default=list(LEVELS),
                   help="fastoptim levels (default: all)")
    p.add_argument("--flat", nargs="*", choices=list(LEVELS), default=["fused"],
                   help="levels to run again with flat=True (default: fused)")
    p.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-format", nargs="+", default=None, choices=state_format.names(), metavar="FORMAT",
                   action=state_format.Agreeing,
                   help="run each level again with its state kept in these formats: "
                        f"{', '.join(state_format.names())} (state_format=); the final-loss gap to its 32-bit run "
                        "is printed as a percentage")
    p.add_argument("--state-bits", type=int, nargs="+", default=None, choices=(16, 8, 4), metavar="BITS",
                   action=state_format.Agreeing, help="--state-format by width: 16 (bf16), 8, 4 (state_bits=)")
    p.add_argument("--rounding", nargs="+", default=[], choices=ROUNDINGS,
                   help="run each level again with bf16 params (no fp32 master copy) rounded back this way: "
                        "nearest (as torch.optim does), stochastic, kahan; compared with its fp32-param run")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate of every optimizer (default: each optimizer's own, "
                        + ", ".join(f"{k} {v:g}" for k, v in curves.LEARNING_RATES.items()) + ")")
    p.add_argument("--out", default="curves.png", help="PNG path (default: curves.png)")
    p.add_argument("--json", metavar="PATH", help="write the curves and the differences as JSON")
    p.set_defaults(func=run)


def _variant(text: str) -> str:
    """An optimizer's name or ``name[key=value,...]`` (``curves.parse_variant``), checked; kept as written."""
    try:
        curves.parse_variant(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip()


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        print("fastoptim curves: --steps must be >= 1", file=sys.stderr)
        return 2
    if args.lr is not None and not args.lr > 0:
        print(f"fastoptim curves: --lr must be > 0, got {args.lr}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("fastoptim curves: the PNG needs matplotlib (pip install 'fastoptim[bench]')", file=sys.stderr)
        return 2
    formats = state_format.resolve(args.state_bits, args.state_format)  # (the parser checked they agree)
    args.state_bits, args.state_format = [c.key for c in formats], [c.name for c in formats]
    result = curves.run(args.optimizer, args.impl, args.flat, args.steps, args.seed, state_bits=args.state_bits,
                        roundings=args.rounding, lr=args.lr)
    diffs = curves.max_differences(result)
    gaps = curves.reference_gaps(result)
    precision = curves.precision_gaps(result)
    curves.plot(result, args.out)
    _print(diffs)
    _print_gaps(gaps, diffs)
    if precision:
        _print_precision(precision)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "seed": args.seed, "lr": args.lr, "state_format": args.state_format,
                       "state_bits": args.state_bits, "differences": diffs,
                       "reference_gaps": gaps, "precision_gaps": precision,
                       "curves": [{"optimizer": c.optimizer, "curve": c.label, "losses": c.losses,
                                   "state_bits": c.state_bits, "params": c.params, "rounding": c.rounding}
                                  for c in result]}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


def _print(diffs: list[dict]) -> None:
    headers = ["optimizer", "curve", "vs", "max |loss diff| at any step", "vs reference fp64", "final loss",
               "reference final"]
    rows = [[d["optimizer"], d["curve"], d["reference"], f"{d['max_abs_diff']:.3g}",
             f"{d['max_abs_diff_fp64']:.3g}" if "max_abs_diff_fp64" in d else "-", f"{d['final_loss']:.4f}",
             f"{d['reference_final_loss']:.4f}"] for d in diffs]
    _table("fastoptim vs reference, same seed and batches", headers, rows, text_columns=3)


def _print_precision(precision: list[dict]) -> None:
    headers = ["optimizer", "curve", "vs", "final loss", "vs final", "gap", "max |loss diff| at any step"]
    rows = [[d["optimizer"], d["curve"], d["reference"], f"{d['final_loss']:.4f}", f"{d['reference_final_loss']:.4f}",
             f"{d['gap_percent']:+.2f}%", f"{d['max_abs_diff']:.3g}"] for d in precision]
    _table("low-bit state and bf16 params vs the same level at 32-bit state and fp32 params "
           "(final loss: mean of the last tenth of the steps)", headers, rows, text_columns=3)


def _table(title: str, headers: list[str], rows: list[list[str]], text_columns: int) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(headers))
        for row in rows:
            print("  ".join(row))
        return
    from rich.markup import escape

    table = Table(title=title)
    for i, h in enumerate(headers):
        # a name with no spaces folds onto more lines rather than being cut: variants differ at its end
        text = i < text_columns
        table.add_column(h, justify="left" if text else "right", overflow="fold" if text else "ellipsis")
    for row in rows:
        table.add_row(*map(escape, row))  # (a variant's options are in brackets, rich's markup)
    Console(width=120).print(table)


def _print_gaps(gaps: list[dict], diffs: list[dict]) -> None:
    """The distance the table's exactness column does not show: fp32 arithmetic against float64 (Lion)."""
    for gap in gaps:
        name = gap["optimizer"]
        levels = max((d["max_abs_diff"] for d in diffs if d["optimizer"] == name), default=float("nan"))
        apart = gap["first_step_apart"]
        when = f"first apart at step {apart}" if apart else "never apart"
        print(f"{name}: the levels match the {gap['curve']} loop to {levels:.3g}; that loop is up to "
              f"{gap['max_abs_diff']:.3g} from the {gap['reference']} loop ({when}; final losses "
              f"{gap['final_loss']:.4f} vs {gap['reference_final_loss']:.4f}).")
        note = registry.get(registry.parse_variant(name)[0]).cls.rule.curves_note
        if note:
            print(f"  {note}")
