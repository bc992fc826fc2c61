r"""Muon: momentum orthogonalised by Newton-Schulz (Jordan et al. 2024; the update scaling of Liu et al. 2025,
"Muon is Scalable for LLM Training"), torch.optim.Muon's semantics.

    B <- mu B + (1 - mu) g                          (torch's ``buf.lerp_(g, 1 - mu)``)
    U <- g + mu (B - g)  if nesterov, else B
    X <- U / max(||U||_F, eps)
    k times:  A = X X^T;  X <- a X + (b A + c A A) X    (rows <= cols)
              A = X^T X;  X <- a X + X (b A + c A A)    (rows > cols: torch's iteration on X^T, transposed)
    O <- X
    p <- p (1 - lr wd) - lr r O,   r = sqrt(max(1, rows/cols)) ("original") or 0.2 sqrt(max(rows, cols))

torch runs Newton-Schulz in bf16. Here it runs in ``ns_dtype``: None picks what multiplies fast on the device
(``fast_matmul_dtype``): bf16 on CUDA and on CPUs with bf16 matrix instructions (AVX512-BF16, AMX), fp32 on
other CPUs, where bf16 products are emulated and far slower (docs/performance.md). A param
group with ``use_muon=False`` is stepped by AdamW with the group's lr, betas, eps and weight_decay (the usual
recipe: AdamW for embeddings, the output head and 1-D params; ``fastoptim.create(model, "muon")``).
"""

from __future__ import annotations

import functools
import math

import torch

from ..eager import eager
from .adam import AdamRule
from .base import Elementwise, PerTensor, Rule, _number, check_bool, check_nonnegative, register

NS_DTYPES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16}
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def muon_momentum(p, g, momentum_buffer, update,
                  eps, lr, decay_factor, one_minus_momentum, momentum,
                  NESTEROV, NS_COEFFICIENTS, NS_STEPS, NS_DTYPE, ADJUST_LR_FN, MAXIMIZE):
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


@functools.lru_cache(maxsize=None)
def fast_matmul_dtype(device_type: str) -> torch.dtype:
    """bf16 where the device multiplies bf16 matrices natively, else fp32. A fixed property of the machine (not
    a timing), so a run and its resume always take the same precision."""
    if device_type == "cuda":
        return torch.bfloat16
    if device_type == "cpu":
        # oneDNN "supports" bf16 on every AVX-512 CPU, emulating the products where the CPU lacks bf16 dot products
        # (slower than fp32 there: docs/performance.md); only
        # AVX512-BF16 and AMX multiply bf16 natively
        try:
            native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
            return torch.bfloat16 if native and torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
        except (AttributeError, RuntimeError):
            return torch.float32
    return torch.float32


@eager  # the chain is library GEMM calls either way; compiled, Inductor would round bf16 its own way
def newton_schulz(x, coefficients: tuple, eps, steps: int, dtype):
    """The orthogonalisation of each matrix of the batch ``x`` (n, rows, cols), in ``dtype`` (None: the device's
    ``fast_matmul_dtype``), with torch's operations (``baddbmm`` is ``addmm`` batched: the scaling and the sum in
    the product's own pass). torch iterates on a tall matrix's transpose, X^T <- a X^T + (b A + c A^2) X^T with
    A = X^T X; transposed back, that is X <- a X + X (b A + c A^2): the same products on the matrix as it lies,
    with no transposing copy of X in or out (transposing copies cost a sixth of the step on gpt's matrices)."""
    a, b, c = coefficients
    dtype = dtype or fast_matmul_dtype(x.device.type)
    tall = x.shape[-2] > x.shape[-1]
    x = x.to(dtype, copy=True)  # our own: normalised in place
    x.div_(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
    for _ in range(steps):
        if tall:
            gram = x.mT @ x
            x = torch.baddbmm(x, x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), beta=a)
        else:
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def muon_orthogonalise(update, eps, lr, decay_factor, one_minus_momentum, momentum,
                       NESTEROV, NS_COEFFICIENTS, NS_STEPS, NS_DTYPE, ADJUST_LR_FN, MAXIMIZE):
    """The orthogonalised update times the shape's lr ratio (in the update's dtype; 1 needs no pass)."""
    out = newton_schulz(update, NS_COEFFICIENTS, eps, NS_STEPS, NS_DTYPE)
    ratio = lr_ratio(*update.shape[-2:], ADJUST_LR_FN)
    return (out if ratio == 1 else out.to(update.dtype).mul_(ratio),)  # (``out`` is newton_schulz's own)


def muon_apply(p, g, update, eps, lr, decay_factor, one_minus_momentum, momentum,
               NESTEROV, NS_COEFFICIENTS, NS_STEPS, NS_DTYPE, ADJUST_LR_FN, MAXIMIZE):
    p = p * decay_factor - update * lr
    return p, update


@register
class MuonRule(Rule):
    """torch.optim.Muon, plus: every level (Newton-Schulz batched over same-shape matrices), ``ns_dtype``
    (None: bf16 on CUDA, fp32 elsewhere), and param groups with ``use_muon=False`` stepped by AdamW (their
    ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``), so one optimizer covers a whole
    model: ``fastoptim.create(model, "muon")``."""
    name = "muon"
    class_name = "Muon"
    # torch.optim.Muon has no single-tensor flag and always runs Newton-Schulz in bf16: the oracle is its loop
    # with Newton-Schulz in ns_dtype
    oracle = "fastoptim.reference.ReferenceMuon"
    torch_class = "Muon"
    signature = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn",
                 "*", "ns_dtype", "use_muon", "betas", "amsgrad", "maximize")
    # (Newton-Schulz in the device's fast dtype (bf16 here, where bf16 products are native), and pinned to fp32)
    option_sets = (
        dict(lr=2e-2),
        dict(lr=2e-2, nesterov=False, momentum=0.9, weight_decay=0.3, adjust_lr_fn="match_rms_adamw",
             ns_dtype="float32"),
        dict(lr=2e-2, ns_steps=3, ns_coefficients=(2.0, -1.5, 0.5), eps=1e-5, adjust_lr_fn="original",
             ns_dtype="float32"),
    )
    takes = "matrices"
    curves_options = dict(lr=0.02)
    tensor_hypers = ("lr", "momentum", "weight_decay")
    defaults = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                    ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None,
                    ns_dtype=None, use_muon=True, betas=(0.9, 0.95), amsgrad=False, maximize=False)
    group_only = frozenset({"betas", "amsgrad"})  # the AdamW groups' (schedulers then cycle Muon's momentum)
    state_names = ("momentum_buffer",)
    exports_step = False  # torch.optim.Muon keeps no step count
    scratch = ("update",)
    stages = (Elementwise(muon_momentum, ("momentum_buffer", "update")),
              PerTensor(muon_orthogonalise, ("update",), ("update",)),
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
        coefficients = group["ns_coefficients"]
        if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3:
            raise ValueError(f"Invalid ns_coefficients: {coefficients!r} (must be three numbers (a, b, c))")
        for name, value in zip("abc", coefficients):
            _number(f"ns_coefficients {name}", value)
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(f"Invalid ns_steps: {steps!r} (must be a whole number in [0, 100))")
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(f"Invalid adjust_lr_fn: {group['adjust_lr_fn']!r} (must be one of {ADJUST_LR_FNS})")
        if group["ns_dtype"] not in NS_DTYPES:
            raise ValueError(f"Invalid ns_dtype: {group['ns_dtype']!r} (must be one of {tuple(NS_DTYPES)})")

    def check_param(self, p, group) -> str | None:
        """Why ``p`` cannot be stepped by this group (None: it can)."""
        if group.get("use_muon", True) and p.dim() != 2:
            return (f"Muon steps 2-D matrices only, got a param of shape {tuple(p.shape)}: put it in a group "
                    "with use_muon=False (AdamW), as fastoptim.create(model, 'muon') does")
        return None

    def check_stepped_param(self, p, group) -> str | None:
        # (torch.optim.Muon takes complex params and refuses them at its step; AdamW groups take them: for_group)
        return "Muon does not support complex parameters" if p.is_complex() else None

    def refuses_quantized_state(self, group):
        return None

    def named_flags(self, group):
        # the coefficients are constants of the product chain (``baddbmm`` takes them as numbers)
        coefficients = tuple(float(c) for c in group["ns_coefficients"])
        return dict(NESTEROV=group["nesterov"], NS_COEFFICIENTS=coefficients, NS_STEPS=group["ns_steps"],
                    NS_DTYPE=NS_DTYPES[group["ns_dtype"]], ADJUST_LR_FN=group["adjust_lr_fn"],
                    MAXIMIZE=group["maximize"])

    def named_scalars(self, group, step):
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        return dict(eps=group["eps"], lr=lr, decay_factor=1 - lr * wd, one_minus_momentum=1 - momentum,
                    momentum=momentum)
