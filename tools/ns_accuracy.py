"""How close each Newton-Schulz method and coefficient schedule gets to the polar factor, against an SVD.

    python tools/ns_accuracy.py [--dtype bfloat16 float32] [--markdown PATH]

For each matrix kind and shape (two seeded matrices each) and each (schedule, method), in each dtype:
  * polar: ||O - U V^T||_F / ||U V^T||_F, the distance to the polar factor of the SVD X = U S V^T (float64);
  * orth F: ||O O^T - I||_F / sqrt(m) (m the short side: the RMS of s^2 - 1 over O's singular values s);
  * orth 2: ||O O^T - I||_2 (the worst singular value).
"torch.optim.Muon" is torch's own Newton-Schulz (bf16, its coefficients, 5 iterations), whatever --dtype says.
The table in docs/muon-adafactor.md is this script's output.
"""

from __future__ import annotations

import argparse
import math

import torch

from fastoptim.rules import newton_schulz as ns

KINDS = {
    # i.i.d. Gaussian: singular values spread as Marchenko-Pastur's law
    "gaussian": lambda m, n, g: torch.randn(m, n, generator=g),
    # what gradients look like: a decaying rank-16 part plus a little noise (most singular values tiny)
    "low-rank + 5% noise": lambda m, n, g: _low_rank(m, n, g, 0.05),
    "low-rank + 30% noise": lambda m, n, g: _low_rank(m, n, g, 0.3),
}
SHAPES = ((256, 1024), (1024, 256), (512, 512))
CONFIGS = (("keller", "standard"), ("keller", "gram"), ("polar_express", "standard"), ("polar_express", "gram"))


def _low_rank(m: int, n: int, g: torch.Generator, noise: float) -> torch.Tensor:
    r = 16
    low = torch.randn(m, r, generator=g) @ torch.diag(torch.logspace(0, -1.5, r)) @ torch.randn(r, n, generator=g)
    return low / low.norm() + noise * torch.randn(m, n, generator=g) / math.sqrt(m * n)


def errors(x: torch.Tensor, out: torch.Tensor) -> tuple[float, float, float]:
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    polar = u @ vh
    out = out.double()
    wide = out if out.shape[0] <= out.shape[1] else out.T
    gram = wide @ wide.T - torch.eye(wide.shape[0], dtype=torch.float64)
    return ((out - polar).norm() / polar.norm()).item(), (gram.norm() / math.sqrt(wide.shape[0])).item(), \
        torch.linalg.matrix_norm(gram, ord=2).item()


def torch_muon(x: torch.Tensor) -> torch.Tensor:
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(x, ns.KELLER, 5, 1e-7)


def table(dtypes: list[str]) -> str:
    rows = [("torch.optim.Muon", "bfloat16", torch_muon)]
    for dtype in dtypes:
        for coefficients, method in CONFIGS:
            schedule = ns.schedule(coefficients, 5)
            rows.append((f"{coefficients} / {method}", dtype, lambda x, s=schedule, m=method, d=dtype: ns.newton_schulz(
                x[None], s, 1e-7, getattr(torch, d), m)[0]))
    matrices = [(kind, shape, [make(*shape, torch.Generator().manual_seed(seed)) for seed in (0, 1)])
                for kind, make in KINDS.items() for shape in SHAPES]
    header = "| schedule / method | dtype | " + " | ".join(f"{k} {m}x{n}" for k, (m, n), _ in matrices) + " |"
    lines = [header, "|" + "---|" * (2 + len(matrices))]
    for name, dtype, fn in rows:
        cells = []
        for _, _, xs in matrices:
            e = [errors(x, fn(x)) for x in xs]
            polar, orth_f, orth_2 = (sum(v) / len(v) for v in zip(*e))
            cells.append(f"{polar:.3f} / {orth_f:.3f} / {orth_2:.2f}")
        lines.append(f"| {name} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()
    text = "cells: polar distance / orth F / orth 2, each the mean of two matrices\n\n" + table(args.dtype)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
