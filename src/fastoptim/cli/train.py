"""``fastoptim train``: the flags are TrainConfig's fields (``--batch-size`` for ``batch_size``), one place."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
import typing

from . import state_format
from ..levels import IMPLS
from ..registry import OPTIMIZERS
from ..storage import codecs
from ..storage.rounding import ROUNDINGS
from ..train.loop import DTYPES, SCHEDULES, TrainConfig, check_config

CHOICES = {"optimizer": tuple(OPTIMIZERS), "dtype": tuple(DTYPES), "param_dtype": tuple(DTYPES),
           "rounding": ROUNDINGS, "schedule": SCHEDULES, "impl": IMPLS,
           "compile_mode": ("default", "reduce-overhead", "max-autotune"), "device": ("auto", "cpu", "cuda"),
           "state_bits": (32, 16, 8, 4), "state_format": tuple(state_format.names())}


def _optional_float(text: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def _field_comments() -> dict[str, str]:
    """The comment after each TrainConfig field: the flags' help text comes from the config itself."""
    import inspect
    import re

    return {m.group(1): m.group(2).strip() for m in
            re.finditer(r"^\s+(\w+): [^=]+=[^#]*#(.*)$", inspect.getsource(TrainConfig), re.MULTILINE)}


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a small GPT with fastoptim (CPU by default, on Python's own text)",
                       description=__doc__)
    hints = typing.get_type_hints(TrainConfig)
    helps = _field_comments()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind, help_text = hints[f.name], f"{helps.get(f.name, '')} (default: {f.default})"
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif f.name == "max_grad_norm":
            p.add_argument(flag, type=_optional_float, default=f.default, help=help_text)
        elif f.name in state_format.OTHER:  # one setting, two spellings: given both, they must agree
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            p.add_argument(flag, type=base, default=None, choices=CHOICES[f.name], action=state_format.Agreeing,
                           help=help_text)
        else:
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            p.add_argument(flag, type=base, default=f.default, choices=CHOICES.get(f.name), help=help_text)
    p.add_argument("--json", metavar="PATH", help="write the summary and the loss log as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of the train and validation loss")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # the one format the two flags name (the parser checked that they agree), the config's default where neither
    (chosen,) = state_format.resolve(args.state_bits, args.state_format) or [codecs.for_bits(TrainConfig.state_bits)]
    args.state_bits, args.state_format = chosen.key, chosen.name
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    try:
        check_config(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # a bad setting: its message says it all
        print(f"fastoptim train: {e}", file=sys.stderr)
        return 2
    from ..train import main
    try:
        summary = main(cfg)
    except Exception as e:  # noqa: BLE001 - reported whole, with the rank that raised it
        report_failure(e)
        return 1
    if summary["rank"] != 0:
        return 0
    mfu = f"{summary['mfu']:.1%}" if summary["mfu"] is not None else "n/a on this device (no peak FLOP/s entry)"
    print(f"params {summary['params']:,} ({summary['param_dtype']})  steps {summary['steps']}  "
          f"train loss {summary['final_loss']:.4f}  "
          f"val loss {summary['val_loss']:.4f}")
    print(f"{summary['tokens_per_s']:.0f} tokens/s, {summary['achieved_gflops']:.1f} GFLOP/s achieved, MFU {mfu}, "
          f"optimizer step {summary['optimizer_share']:.1%} of the iteration"
          + (" (with --gradient-release most of it runs inside backward)" if args.gradient_release else ""))
    print(f"peak resident memory {summary['peak_rss_mb']:.0f} MiB (the whole process)")
    if "sample" in summary:
        print("--- sample ---")
        print(summary["sample"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if args.plot:
        plot_losses(summary["log"], args.plot)
    return 0


def report_failure(error: BaseException) -> None:
    """A failure during training: the whole traceback (chained causes included) and which rank raised it.
    Under torchrun it also goes to the error file, so torchrun's summary shows the traceback of the rank
    that failed first (the root cause), not only the collective errors that followed on the others."""
    rank = os.environ.get("RANK")
    where = f" on rank {rank} of {os.environ.get('WORLD_SIZE', '?')}" if rank is not None else ""
    lines = traceback.format_exception(error)
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"fastoptim train failed{where}: {type(error).__name__}: {error}\n"
          + "".join(prefix + line for chunk in lines for line in chunk.splitlines(keepends=True)),
          file=sys.stderr, end="")
    if rank is not None and "by peer" in str(error):
        print(f"{prefix}this rank lost its connection to another rank, which most likely failed first: "
              "its own report (and torchrun's root cause) names the error", file=sys.stderr)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(error)


def plot_losses(log: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([e["step"] for e in log], [e["loss"] for e in log], linewidth=0.6, alpha=0.6, label="train (batch)")
    val = [e for e in log if "val_loss" in e]
    ax.plot([e["step"] for e in val], [e["val_loss"] for e in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy per byte")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
