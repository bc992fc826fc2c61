"""The ``fastoptim`` command: ``fastoptim bench | curves | train``."""

from __future__ import annotations

import argparse
import sys

from . import bench, curves, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastoptim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_parser(sub)
    curves.add_parser(sub)
    train.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
