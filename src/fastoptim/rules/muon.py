r"""Muon: momentum orthogonalised by Newton-Schulz (Jordan et al. 2024; the update scaling of Liu et al. 2025,
"Muon is Scalable for LLM Training"), torch.optim.Muon's semantics.

    B <- mu B + (1 - mu) g                          (torch's ``buf.lerp_(g, 1 - mu)``)
    U <- g + mu (B - g)  if nesterov, else B
    X <- U / max(||U||_F, eps)
    k times:  A = X X^T;  X <- a X + (b A + c A A) X    (rows <= cols)
              A = X^T X;  X <- a X + X (b A + c A A)    (rows > cols: torch's iteration on X^T, transposed)
    O <- X
    p <- p (1 - lr wd) - lr r O,   r = sqrt(max(1, rows/cols)) ("original") or 0.2 sqrt(max(rows, cols))

Which matrices a param is (``matrix_blocks``): a 2-D param is one matrix. ``matrices="batch"`` takes a param of
3+ dims ``[..., M, N]`` as a batch of M x N matrices (MoE experts, stacked layers), ``"flatten"`` takes
``(d0, d1, ...)`` as the one matrix ``(d0, d1 * ...)`` (conv filters, as Jordan's Muon views them);
``"auto"`` batches 3-D params and flattens those of 4+ dims. ``split`` cuts each matrix's rows into blocks
(H equal ones: heads; or given sizes: a fused QKV), each orthogonalised, and its lr ratio r taken, as if it were
a param of its own.

torch runs Newton-Schulz in bf16. Here it runs in ``ns_dtype``: None picks what multiplies fast on the device
(``fast_matmul_dtype``): bf16 on CUDA and on CPUs with bf16 matrix instructions (AVX512-BF16, AMX), fp32 on
other CPUs, where bf16 products are emulated and far slower (docs/performance.md). A param
group with ``use_muon=False`` is stepped by AdamW with the group's lr, betas, eps and weight_decay (the usual
recipe: AdamW for embeddings, the output head and 1-D params; ``fastoptim.create(model, "muon")``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..eager import eager
from . import newton_schulz as ns
from .adam import AdamRule
from .base import Elementwise, PerTensor, Rule, _number, check_bool, check_nonnegative, register
# (fast_matmul_dtype: what ns_dtype=None takes, ``ns_dtype_for``; the tests read it from here too)
from .newton_schulz import fast_matmul_dtype, newton_schulz  # noqa: F401

NS_DTYPES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16}
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
MATRICES = ("auto", "batch", "flatten")


def ns_dtype_for(setting, device_type: str = "cpu") -> torch.dtype:
    """The dtype ``ns_dtype=setting`` (a name, a dtype, or None) multiplies in on ``device_type``."""
    return NS_DTYPES.get(setting, setting) or fast_matmul_dtype(device_type)


def muon_momentum(p, g, momentum_buffer, update,
                  eps, lr, decay_factor, one_minus_momentum, momentum,
                  NESTEROV, NS_COEFFICIENTS, NS_METHOD, NS_DTYPE, ADJUST_LR_FN, MAXIMIZE, MATRICES, SPLIT):
    if MAXIMIZE:  # (torch.optim.Muon has no maximize; every other torch.optim algorithm does)
        g = -g
    momentum_buffer = momentum_buffer + (g - momentum_buffer) * one_minus_momentum
    if NESTEROV:
        update = g + (momentum_buffer - g) * momentum
    else:
        update = momentum_buffer
    return p, momentum_buffer, update


def lr_ratio(rows: int, cols: int, adjust_lr_fn: str | None) -> float:
    """torch.optim.Muon's ``_adjust_lr``: how much a matrix of this shape scales lr."""
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols)) if cols else 1.0  # (an empty matrix: nothing to scale)


@dataclass(frozen=True)
class MatrixBlocks:
    """How a param is orthogonalised: ``count`` matrices of ``rows`` x ``cols`` (in memory order), each cut by
    rows into blocks; ``blocks`` lists, per block height, the row offsets where such blocks start."""
    count: int
    rows: int
    cols: int
    blocks: tuple[tuple[int, tuple[int, ...]], ...]


def check_matrices(matrices) -> None:
    if not isinstance(matrices, str) or matrices not in MATRICES:
        raise ValueError(f"Invalid matrices: {matrices!r} (must be one of {MATRICES})")


def check_split(split) -> int | tuple[int, ...] | None:
    """``split`` as a flag takes it (None, a number of heads, or a tuple of row sizes); ValueError naming it."""
    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1
    if split is None or whole(split):
        return split
    if isinstance(split, (tuple, list)) and split and all(whole(v) for v in split):
        return tuple(split)
    raise ValueError(f"Invalid split: {split!r} (must be None, a number of heads >= 1, or a tuple of row sizes "
                     ">= 1)")


def batched(shape: tuple, matrices: str) -> bool:
    """True: a param of ``shape`` is a batch of matrices (its leading dims, dim 0 among them, index them), so
    whole slices of dim 0 are whole matrices (an expert stack sharded on dim 0 steps where it lies)."""
    return len(shape) >= 3 and (matrices == "batch" or (matrices == "auto" and len(shape) == 3))


def matrix_view(shape: tuple, matrices: str = "auto") -> tuple[int, int, int]:
    """(count, rows, cols): the matrices a param of ``shape`` (2+ dims) is under ``matrices``."""
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if batched(shape, matrices):
        return math.prod(shape[:-2]), shape[-2], shape[-1]
    return 1, shape[0], math.prod(shape[1:])


def row_blocks(rows: int, split) -> tuple[int, ...] | None:
    """The heights ``split`` cuts ``rows`` rows into, top to bottom; None where it does not fit."""
    if split is None:
        return (rows,)
    if isinstance(split, int):
        return (rows // split,) * split if rows % split == 0 else None
    return tuple(split) if sum(split) == rows else None


def matrix_blocks(shape: tuple, matrices: str = "auto", split=None) -> MatrixBlocks:
    """The matrices of a param of ``shape`` (``matrix_view``) and their row blocks (``split``), blocks of one
    height together. ValueError where an option is invalid or ``split`` does not fit the matrices' rows."""
    check_matrices(matrices)
    return _matrix_blocks(tuple(shape), matrices, check_split(split))


@functools.lru_cache(maxsize=4096)  # (asked each step, per shape group)
def _matrix_blocks(shape: tuple, matrices: str, split) -> MatrixBlocks:
    count, rows, cols = matrix_view(shape, matrices)
    heights = row_blocks(rows, split)
    if heights is None:
        why = (f"not a multiple of {split}" if isinstance(split, int) else
               f"and the sizes sum to {sum(split)}")
        raise ValueError(f"split={split!r} does not fit a param of shape {tuple(shape)}: its matrices "
                         f"(matrices={matrices!r}) are {rows} x {cols}, {rows} rows, {why}")
    offsets: dict[int, list[int]] = {}
    start = 0
    for height in heights:
        offsets.setdefault(height, []).append(start)
        start += height
    return MatrixBlocks(count, rows, cols, tuple((h, tuple(o)) for h, o in offsets.items()))


@eager  # shape logic in Python around eager products: compiled, each shape would guard a graph of its own
def orthogonalise(update, coefficients: tuple, eps, method: str, dtype, adjust_lr_fn, matrices: str = "auto",
                  split=None, overwrite: bool = False):
    """Each block of each matrix of the batch ``update`` (n, *shape) orthogonalised on its own and times its
    own lr ratio, in ``update``'s shape: ``newton_schulz`` (the iterations ``coefficients``, one (a, b, c) each,
    by ``method``) once per block shape. Blocks that fill their matrices go in as views (no copy but
    ``newton_schulz``'s own); blocks of one height at several offsets are gathered. ``overwrite``: ``update`` is
    the caller's scratch, and a result in its dtype is written into it (no second tensor of its size)."""
    layout = _matrix_blocks(tuple(update.shape[1:]), matrices, split)  # (the flags: checked)
    n, rows, cols = len(update) * layout.count, layout.rows, layout.cols  # (sizes given: some may be 0)
    x = update.reshape(n, rows, cols)  # (a view of a contiguous batch)
    if len(layout.blocks) == 1:  # blocks of one height fill each matrix: all of them one view
        height, offsets = layout.blocks[0]
        out = newton_schulz(x.reshape(n * len(offsets), height, cols), coefficients, eps, dtype, method)
        ratio = lr_ratio(height, cols, adjust_lr_fn)
        if ratio == 1:
            return out.reshape(update.shape)  # (``out`` is newton_schulz's own)
        # converted, then scaled in the update's dtype
        return (update.copy_(out.view(update.shape)) if overwrite else out.to(update.dtype)).mul_(ratio)
    # (each block's rows are read, into newton_schulz's own copy, before any block's result is written)
    result = update if overwrite else torch.empty(update.shape, dtype=update.dtype, device=update.device)
    into = result.view(n, rows, cols)
    for height, offsets in layout.blocks:
        pieces = [x[:, o:o + height] for o in offsets]
        batch = pieces[0] if len(pieces) == 1 else torch.stack(pieces, 1).view(n * len(pieces), height, cols)
        out = newton_schulz(batch, coefficients, eps, dtype, method).reshape(n, len(offsets), height, cols)
        ratio = lr_ratio(height, cols, adjust_lr_fn)
        for k, o in enumerate(offsets):
            # converted, then scaled in the update's dtype, as for a param of the block's shape
            block = into[:, o:o + height].copy_(out[:, k])
            if ratio != 1:
                block.mul_(ratio)
    return result


def muon_orthogonalise(update, eps, lr, decay_factor, one_minus_momentum, momentum,
                       NESTEROV, NS_COEFFICIENTS, NS_METHOD, NS_DTYPE, ADJUST_LR_FN, MAXIMIZE, MATRICES, SPLIT):
    """The orthogonalised update times each block's lr ratio (in the update's dtype; 1 needs no pass)."""
    return (orthogonalise(update, NS_COEFFICIENTS, eps, NS_METHOD, NS_DTYPE, ADJUST_LR_FN, MATRICES, SPLIT,
                          overwrite=True),)  # (``update`` is scratch, or a stacked copy of it)


def muon_apply(p, g, update, eps, lr, decay_factor, one_minus_momentum, momentum,
               NESTEROV, NS_COEFFICIENTS, NS_METHOD, NS_DTYPE, ADJUST_LR_FN, MAXIMIZE, MATRICES, SPLIT):
    p = p * decay_factor - update * lr
    return p, update


@register
class MuonRule(Rule):
    """torch.optim.Muon, plus: every level (Newton-Schulz batched over same-shape matrices), ``ns_dtype``
    (None: bf16 on CUDA, fp32 elsewhere), params of 3+ dims (``matrices``: batched or flattened) and blocks of
    rows orthogonalised apart (``split``: heads, a fused QKV), and param groups with ``use_muon=False`` stepped
    by AdamW (their ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``), so one optimizer
    covers a whole model: ``fastoptim.create(model, "muon")``."""
    name = "muon"
    class_name = "Muon"
    # torch.optim.Muon has no single-tensor flag and always runs Newton-Schulz in bf16: the oracle is its loop
    # with Newton-Schulz in ns_dtype
    oracle = "fastoptim.reference.ReferenceMuon"
    torch_class = "Muon"
    signature = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn",
                 "*", "ns_method", "ns_dtype", "use_muon", "betas", "amsgrad", "maximize", "matrices", "split")
    # (Newton-Schulz in the device's fast dtype (bf16 here, where bf16 products are native), and pinned to fp32)
    option_sets = (
        dict(lr=2e-2),
        dict(lr=2e-2, nesterov=False, momentum=0.9, weight_decay=0.3, adjust_lr_fn="match_rms_adamw",
             ns_dtype="float32"),
        dict(lr=2e-2, ns_steps=3, ns_coefficients=(2.0, -1.5, 0.5), eps=1e-5, adjust_lr_fn="original",
             ns_dtype="float32", ns_method="standard"),
        dict(lr=2e-2, ns_coefficients="polar_express", ns_method="gram", ns_dtype="float32"),
        dict(lr=2e-2, ns_steps=4, ns_coefficients=[(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)], ns_dtype="float32"),
    )
    takes = "matrices"
    # params of 3+ dims too (batches of matrices, filters): the recipes route them here
    batched_matrices = True
    curves_options = dict(lr=0.02)
    tensor_hypers = ("lr", "momentum", "weight_decay")
    defaults = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                    ns_coefficients=ns.KELLER, eps=1e-7, ns_steps=5, adjust_lr_fn=None, ns_method="auto",
                    ns_dtype=None, use_muon=True, betas=(0.9, 0.95), amsgrad=False, maximize=False,
                    matrices="auto", split=None)
    group_only = frozenset({"betas", "amsgrad"})  # the AdamW groups' (schedulers then cycle Muon's momentum)
    state_names = ("momentum_buffer",)
    exports_step = False  # torch.optim.Muon keeps no step count
    scratch = ("update",)
    stages = (Elementwise(muon_momentum, ("momentum_buffer", "update")),
              PerTensor(muon_orthogonalise, ("update",), ("update",), local_rows=lambda shape, flags: batched(
                  shape, flags[MuonRule.flag_names.index("MATRICES")])),
              Elementwise(muon_apply, ("update",)))
    adamw = AdamRule(decoupled=True)

    def for_group(self, group):
        return self if group.get("use_muon", True) else self.adamw

    def validate(self, group):
        check_bool(group, "use_muon")
        if not group["use_muon"]:
            return self.adamw.validate(group)
        check_nonnegative(group, "lr", "weight_decay", "eps")
        _number("momentum", group["momentum"])
        if float(group["momentum"]) < 0:
            raise ValueError(f"Invalid momentum: {group['momentum']} (must be >= 0)")
        check_bool(group, "nesterov", "maximize")
        ns.check_coefficients(group["ns_coefficients"])
        if group["ns_method"] not in ns.METHODS:
            raise ValueError(f"Invalid ns_method: {group['ns_method']!r} (must be one of {ns.METHODS})")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(f"Invalid ns_steps: {steps!r} (must be a whole number in [0, 100))")
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(f"Invalid adjust_lr_fn: {group['adjust_lr_fn']!r} (must be one of {ADJUST_LR_FNS})")
        if group["ns_dtype"] not in NS_DTYPES:
            raise ValueError(f"Invalid ns_dtype: {group['ns_dtype']!r} (must be one of {tuple(NS_DTYPES)})")
        self.validate_layout(group)

    def validate_layout(self, group):
        check_matrices(group["matrices"])
        check_split(group["split"])

    def check_param(self, p, group) -> str | None:
        """Why ``p`` cannot be stepped by this group (None: it can)."""
        if not group.get("use_muon", True):
            return None
        if p.dim() < 2:
            return (f"Muon steps matrices only (params of 2 or more dims), got a param of shape "
                    f"{tuple(p.shape)}: put it in a group with use_muon=False (AdamW), as "
                    "fastoptim.create(model, 'muon') does")
        try:
            matrix_blocks(tuple(p.shape), group["matrices"], group["split"])
        except ValueError as e:
            return f"Muon: {e}"
        return None

    def check_stepped_param(self, p, group) -> str | None:
        # (torch.optim.Muon takes complex params and refuses them at its step; AdamW groups take them: for_group)
        if p.is_complex():
            return "Muon does not support complex parameters"
        return self.check_param(p, group)  # (a split loaded from a checkpoint, or set by hand since)

    def torch_group(self, group):
        # torch.optim.Muon takes one (a, b, c) for every iteration: a preset's name or a list of triples would load,
        # then fail its first step. A schedule that changes per iteration has no such form: kept, torch's step
        # refuses it
        schedule = set(ns.schedule(group["ns_coefficients"], max(group["ns_steps"], 1)))
        return dict(group, ns_coefficients=schedule.pop()) if len(schedule) == 1 else group

    def planned_settings(self, group):
        # (as tuples: a split list edited in place is a new value too)
        return group["matrices"], check_split(group["split"])

    def refuses_quantized_state(self, group):
        return None

    def named_flags(self, group):
        # the coefficients, one (a, b, c) per iteration, are constants of the product chain (``baddbmm`` takes them
        # as numbers)
        coefficients = ns.schedule(group["ns_coefficients"], group["ns_steps"])
        return dict(NESTEROV=group["nesterov"], NS_COEFFICIENTS=coefficients, NS_METHOD=group["ns_method"],
                    NS_DTYPE=NS_DTYPES[group["ns_dtype"]], ADJUST_LR_FN=group["adjust_lr_fn"],
                    MAXIMIZE=group["maximize"], MATRICES=group["matrices"], SPLIT=check_split(group["split"]))

    def named_scalars(self, group, step):
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        return dict(eps=group["eps"], lr=lr, decay_factor=1 - lr * wd, one_minus_momentum=1 - momentum,
                    momentum=momentum)
