"""The walk of one steady step through fastoptim's modules: every call from one of its modules into another
(torch's frames between them skipped), counted with ``sys.setprofile``, and the modules entered. An AdamW at 8-bit state on a small model (an embedding,
two linear layers, a norm), after three steps (its plans made, its kernels built). ``--release`` walks one
backward with ``gradient_release=True`` instead, whose one bucket steps at its end.

    python tools/step_walk.py [--release] [--calls]
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

import fastoptim


def module_of(frame) -> str | None:
    path = frame.f_code.co_filename
    return path.split("fastoptim/", 1)[1] if "/fastoptim/" in path and "/tools/" not in path else None


def caller_module(frame) -> str | None:
    """The nearest fastoptim module up the stack (past torch's frames between them: a ``no_grad`` decorator, the
    autograd engine's hooks), or None."""
    frame = frame.f_back
    while frame is not None and module_of(frame) is None:
        frame = frame.f_back
    return None if frame is None else module_of(frame)


def walk(release: bool) -> tuple[list[str], set[str]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 128), torch.nn.LayerNorm(128),
                                torch.nn.Linear(128, 64))
    opt = fastoptim.AdamW(model.parameters(), lr=1e-3, state_bits=8, min_quant_size=1024, gradient_release=release,
                          **({"release_bucket_mb": 1e9} if release else {}))

    def loss():
        return model(torch.randint(0, 1000, (8,))).square().mean()

    for _ in range(3):
        loss().backward()
        opt.step()
        opt.zero_grad()
    calls, modules = [], set()

    def seen(frame, event, arg):
        if event != "call" or (callee := module_of(frame)) is None:
            return
        modules.add(callee)
        caller = caller_module(frame)
        if caller != callee:
            calls.append(f"{caller} -> {callee}: {frame.f_code.co_name}")

    value = loss()
    if not release:
        value.backward()
    sys.setprofile(seen)
    try:
        value.backward() if release else opt.step()
    finally:
        sys.setprofile(None)
    return calls, modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="store_true", help="walk a released bucket's backward instead")
    parser.add_argument("--calls", action="store_true", help="list the calls between modules, with their counts")
    args = parser.parse_args()
    calls, modules = walk(args.release)
    print(f"{'released bucket' if args.release else '8-bit step'}: {len(calls)} calls between modules, "
          f"{len(modules)} modules: {', '.join(sorted(modules))}")
    if args.calls:
        for call, n in collections.Counter(calls).most_common():
            print(f"{n:4d}  {call}")


if __name__ == "__main__":
    main()
