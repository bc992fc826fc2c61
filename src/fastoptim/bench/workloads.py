"""Parameter sets the bench steps: shapes only, filled with random values on demand."""

from __future__ import annotations

import math

import torch

WORKLOADS = ("mlp2000", "gpt", "flat", "rect4k", "square1k", "gpt256")

# matrix sets for Muon's Newton-Schulz (its cost grows with the short side and the aspect ratio): four 1 x 4
# matrices, four square ones, and the eight matrices of two GPT blocks at width 256
MATRIX_SETS = {
    "rect4k": [(4096, 1024)] * 2 + [(1024, 4096)] * 2,
    "square1k": [(1024, 1024)] * 4,
    "gpt256": [(768, 256), (256, 256), (1024, 256), (256, 1024)] * 2,
}


def mlp2000_shapes() -> list[tuple[int, ...]]:
    """The 2000-layer MLP of 64x64 Linear layers: 4000 small tensors (weights and biases), 8.3M params."""
    return [s for _ in range(2000) for s in ((64, 64), (64,))]


def gpt_shapes(n_params: int, n_layer: int = 12, vocab: int = 8192) -> list[tuple[int, ...]]:
    """GPT-shaped tensors (token embedding, per block: norm, fused qkv, proj, norm, mlp up/down; final norm)
    with the width chosen so the total is close to ``n_params``."""
    # 12 d^2 per block (qkv 3d^2 + proj d^2 + mlp 8d^2) plus the embedding: solve for d, round to 64
    a, b = 12 * n_layer, vocab
    d = (-b + math.sqrt(b * b + 4 * a * n_params)) / (2 * a)
    d = max(64, int(round(d / 64)) * 64)
    shapes: list[tuple[int, ...]] = [(vocab, d)]
    for _ in range(n_layer):
        shapes += [(d,), (3 * d, d), (d, d), (d,), (4 * d, d), (d, 4 * d)]
    shapes.append((d,))
    return shapes


def module_shapes(spec: str) -> list[tuple[int, ...]]:
    """The trainable param shapes of ``module:callable`` (a ``torch.nn.Module`` or a callable returning one)."""
    import importlib

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"a module workload is 'package.module:callable', got {spec!r}")
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load workload {spec!r}: {e}") from None
    model = target if isinstance(target, torch.nn.Module) else target()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"workload {spec!r} gave a {type(model).__name__}, not a torch.nn.Module")
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    if not shapes:
        raise ValueError(f"workload {spec!r} has no trainable parameters")
    return shapes


def check_workload(name: str) -> str:
    """A built-in name or ``module:callable``."""
    if name in WORKLOADS or ":" in name:
        return name
    raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}, or package.module:callable")


def shapes_for(name: str, n_params: int) -> list[tuple[int, ...]]:
    if ":" in name:
        return module_shapes(name)
    if name == "mlp2000":
        return mlp2000_shapes()
    if name == "gpt":
        return gpt_shapes(n_params)
    if name == "flat":
        return [(n_params,)]
    if name in MATRIX_SETS:
        return list(MATRIX_SETS[name])
    raise ValueError(f"Unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")


def numel(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def make_params(shapes: list[tuple[int, ...]], seed: int = 0, dtype=torch.float32, device="cpu"):
    """Params with fixed random grads attached (a step never clears them, so steps can repeat)."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g).to(dtype=dtype, device=device))
        p.grad = torch.randn(s, generator=g).to(dtype=dtype, device=device) * 1e-2
        params.append(p)
    return params


def parse_count(text: str) -> int:
    """'25M', '1.5B', '300k', '1000' -> int."""
    text = text.strip().upper()
    scale = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"not a parameter count: {text!r} (examples: 25M, 1.5B, 300k)") from None
    if value < 1:
        raise ValueError(f"parameter count must be >= 1, got {text!r}")
    return int(value)
