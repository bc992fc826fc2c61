r"""Newton-Schulz orthogonalisation: the polar factor U V^T of each matrix of a batch, by odd quintic iterations,
two ways of evaluating them, and coefficient schedules by name.

Each iteration maps every singular value s of X to p(s) = a s + b s^3 + c s^5, in matrix form

    X <- a X + (b A + c A^2) X,   A = X X^T   (rows <= cols; a tall X takes its right-hand Gram, X^T X)

* ``standard`` evaluates exactly that: per iteration 4 m^2 n + 2 m^3 FLOPs for an m x n matrix, m <= n.
* ``gram`` iterates on the small m x m Gram matrix instead (Gram Newton-Schulz): with R = X X^T and
  B = a I + b R + c R^2, the iteration is X <- B X, so after k of them X_k = Q_k X_0 with Q_k = B_k ... B_0, and
  R_{k+1} = B_k R_k B_k. Only the first Gram (X_0 X_0^T) and the last product (Q X_0) touch the m x n matrix: per
  iteration 8 m^3 instead of 4 m^2 n + 2 m^3, cheaper where n > 1.5 m. In bf16 the iterated R drifts (its small
  eigenvalues sit under bf16's resolution and go negative), so the iteration *restarts* (``restarts``):
  X <- Q X, R <- X X^T, Q <- I, two more m x n products. Restarting too early leaves the smallest singular values
  still under R's resolution, too late lets the first, steep polynomials amplify R's drift: the first restart
  comes after the first iteration that lifts the smallest singular values the schedule is made for (1e-3 of the
  largest) past ``RESTART_FLOOR``, and then every as many iterations (with one restart only, Polar Express's
  worst singular value in bf16 came out up to 0.89 from 1 where torch's is 0.52: docs/muon-adafactor.md).
* ``auto``: ``gram`` where it takes fewer FLOPs for the matrix's shape (``gram_is_cheaper``) and the iterations
  run in fp32, where it is as accurate as the standard form (to rounding); ``standard`` in bf16, where Gram
  iterations with torch's coefficients came out up to 5% further from the polar factor than standard ones on
  some matrices and closer on others (docs/muon-adafactor.md). ``gram`` asks for it in bf16 too: with Polar
  Express it is more accurate than torch's default, and takes a third fewer FLOPs on 1 x 4 matrices.

Coefficient schedules: one (a, b, c) for every iteration, as torch.optim.Muon takes, or one per iteration.
``PRESETS`` names them: ``"keller"`` is torch.optim.Muon's (3.4445, -4.7750, 2.0315) at each iteration;
``"polar_express"`` is the Polar Express schedule (Amsel et al. 2025), derived here for the run's number of
iterations (``polar_express``): each iteration's polynomial is the odd quintic that best approximates 1, in the
max norm, on the interval the singular values are known to lie in after the iterations before it.
"""

from __future__ import annotations

import functools
import math

import torch

from ..eager import eager

KELLER = (3.4445, -4.7750, 2.0315)
METHODS = ("auto", "standard", "gram")
# Gram iterations restart once the schedule has lifted singular values of 1e-3 past this, and as often again
# (measured in bf16 on low-rank-plus-noise matrices: Polar Express restarts after 2 iterations, torch's
# coefficients after 3; one iteration later, Polar Express's steep first polynomials blew R's drift up; one
# earlier, either lost the small singular values: docs/muon-adafactor.md)
RESTART_FLOOR = 0.03
SMALLEST = 1e-3


def best_quintic(lo: float, hi: float) -> tuple[float, float, float]:
    """The odd quintic p(s) = a s + b s^3 + c s^5 minimising max |1 - p(s)| over [lo, hi] (0 < lo <= hi).

    Remez exchange: the optimum equioscillates at lo, q, r, hi (q < r the interior extrema, p'(s) = 0), so solve
    p(s) + (-1)^i E = 1 at those four points for (a, b, c, E), move q and r to the roots of p', repeat."""
    if lo / hi >= 1 - 5e-6:  # (the limit as lo -> hi: the Taylor polynomial of 1 about hi, degree 5, odd)
        return 15 / 8 / hi, -10 / 8 / hi ** 3, 3 / 8 / hi ** 5
    q, r = (3 * lo + hi) / 4, (lo + 3 * hi) / 4
    error = None
    for _ in range(100):
        points = ((lo, 1.0), (q, -1.0), (r, 1.0), (hi, -1.0))
        system = torch.tensor([[s, s ** 3, s ** 5, sign] for s, sign in points], dtype=torch.float64)
        a, b, c, new_error = torch.linalg.solve(system, torch.ones(4, dtype=torch.float64)).tolist()
        root = math.sqrt(9 * b * b - 20 * a * c)
        q, r = math.sqrt((-3 * b - root) / (10 * c)), math.sqrt((-3 * b + root) / (10 * c))
        if error is not None and abs(new_error - error) <= 1e-15:
            break
        error = new_error
    return a, b, c


@functools.lru_cache(maxsize=None)
def polar_express(steps: int, lower: float = 1e-3, cushion: float = 0.02407327424182761,
                  safety: float = 1.01) -> tuple:
    """The Polar Express schedule for ``steps`` iterations on singular values in [``lower``, 1].

    Greedy: each iteration takes the best quintic on [max(lo, cushion * hi), hi] (the cushion keeps the first
    polynomials from overshooting on tiny singular values), rescaled so it is centred on 1 over [lo, hi]; the
    values then lie in [p(lo), 2 - p(lo)]. Every polynomial but the last is stretched by ``safety`` (p(s/safety)),
    so singular values up to 1% above 1 (a bf16 rounding of the norm) still converge. The defaults are the
    paper's (its published schedule is this one, before the safety stretch: tests/rules/test_newton_schulz.py)."""
    lo, hi, schedule = lower, 1.0, []
    for i in range(steps):
        a, b, c = best_quintic(max(lo, cushion * hi), hi)
        if cushion * hi > lo:
            scale = 2 / (a * lo + b * lo ** 3 + c * lo ** 5 + a * hi + b * hi ** 3 + c * hi ** 5)
            a, b, c = a * scale, b * scale, c * scale
        if i < steps - 1:
            a, b, c = a / safety, b / safety ** 3, c / safety ** 5
        schedule.append((a, b, c))
        lo = a * lo + b * lo ** 3 + c * lo ** 5
        hi = 2 - lo
    return tuple(schedule)


PRESETS = {"keller": lambda steps: (KELLER,) * steps, "polar_express": polar_express}


def schedule(coefficients, steps: int) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of each of ``steps`` iterations: ``coefficients`` is a preset's name, one (a, b, c) for every
    iteration, or one per iteration (a schedule shorter than ``steps`` repeats its last entry)."""
    if isinstance(coefficients, str):
        return tuple(PRESETS[coefficients](steps))
    if len(coefficients) and not isinstance(coefficients[0], (tuple, list)):
        coefficients = (coefficients,)
    entries = tuple(tuple(float(c) for c in entry) for entry in coefficients)
    return tuple(entries[min(i, len(entries) - 1)] for i in range(steps))


def check_coefficients(coefficients) -> None:
    """Raises ValueError unless ``coefficients`` is a preset's name, (a, b, c), or a non-empty sequence of them."""
    if isinstance(coefficients, str):
        if coefficients not in PRESETS:
            raise ValueError(f"Invalid ns_coefficients: {coefficients!r} (a preset must be one of {tuple(PRESETS)})")
        return
    message = (f"Invalid ns_coefficients: {coefficients!r} (must be three numbers (a, b, c), one such triple per "
               f"iteration, or a preset: {', '.join(map(repr, PRESETS))})")
    if not isinstance(coefficients, (tuple, list)) or not coefficients:
        raise ValueError(message)
    entries = coefficients if isinstance(coefficients[0], (tuple, list)) else (coefficients,)
    for entry in entries:
        if not isinstance(entry, (tuple, list)) or len(entry) != 3 or not all(
                isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in entry):
            raise ValueError(message)


@functools.lru_cache(maxsize=None)
def restarts(coefficients: tuple) -> frozenset[int]:
    """The iterations Gram iterations restart before: every k-th, k the number of iterations that takes singular
    values of ``SMALLEST`` past ``RESTART_FLOOR`` (none where the schedule never does)."""
    s = SMALLEST
    for k, (a, b, c) in enumerate(coefficients[:-1], 1):
        s = a * s + b * s ** 3 + c * s ** 5
        if s >= RESTART_FLOOR:
            return frozenset(range(k, len(coefficients), k))
    return frozenset()


def standard_cost(m: int, n: int, steps: int) -> int:
    """FLOPs of ``steps`` standard iterations on an m x n matrix (m <= n): X X^T, A A, B X."""
    return steps * (4 * m * m * n + 2 * m ** 3)


def gram_cost(m: int, n: int, coefficients: tuple) -> int:
    """FLOPs of Gram iterations on an m x n matrix (m <= n): the Gram and the final product (2 m^2 n each), at
    the restart the same two again, per iteration R^2 and B Q (2 m^3 each; the first iteration after a start has
    Q = B, free) and, unless the next one restarts or none follows, B R B (4 m^3)."""
    starts, steps = restarts(coefficients) | {0}, len(coefficients)
    total = 4 * m * m * n
    for i in range(steps):
        if i and i in starts:
            total += 4 * m * m * n
        total += 2 * m ** 3 * (1 + (i not in starts))
        if i + 1 < steps and i + 1 not in starts:
            total += 4 * m ** 3
    return total


def gram_is_cheaper(rows: int, cols: int, coefficients: tuple) -> bool:
    """True where Gram iterations take fewer FLOPs than standard ones on a rows x cols matrix."""
    m, n = min(rows, cols), max(rows, cols)
    return gram_cost(m, n, coefficients) < standard_cost(m, n, len(coefficients))


def resolve_method(method: str, rows: int, cols: int, coefficients: tuple, dtype: torch.dtype) -> str:
    """"standard" or "gram": what ``method`` ("auto" included) runs on a rows x cols matrix in ``dtype``."""
    if method == "auto":
        cheaper = dtype == torch.float32 and gram_is_cheaper(rows, cols, coefficients)
        return "gram" if cheaper else "standard"
    return method


@functools.lru_cache(maxsize=None)
def fast_matmul_dtype(device_type: str) -> torch.dtype:
    """bf16 where the device multiplies bf16 matrices natively, else fp32. A fixed property of the machine (not
    a timing), so a run and its resume always take the same precision."""
    if device_type == "cuda":
        return torch.bfloat16
    if device_type == "cpu":
        # oneDNN "supports" bf16 on every AVX-512 CPU, emulating the products where the CPU lacks bf16 dot products
        # (slower than fp32 there: docs/performance.md); only AVX512-BF16 and AMX multiply bf16 natively
        try:
            native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
            return torch.bfloat16 if native and torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
        except (AttributeError, RuntimeError):
            return torch.float32
    return torch.float32


@eager  # the chain is library GEMM calls either way; compiled, Inductor would round bf16 its own way
def newton_schulz(x, coefficients: tuple, eps, dtype, method: str = "standard"):
    """The orthogonalisation of each matrix of the batch ``x`` (count, rows, cols) by the iterations
    ``coefficients`` (one (a, b, c) each), in ``dtype`` (None: the device's ``fast_matmul_dtype``). ``method``:
    "standard", "gram" or "auto" (module docstring). Returns a new tensor in ``dtype``."""
    dtype = dtype or fast_matmul_dtype(x.device.type)
    if not coefficients or not x.numel():
        return _normalised(x, dtype, eps)
    run = _gram if resolve_method(method, x.shape[-2], x.shape[-1], coefficients, dtype) == "gram" else _standard
    if dtype == torch.bfloat16 and x.device.type == "cpu":  # 2-D products (``_one_by_one``)
        if len(x) == 1:  # (the normalised copy as an argument: freed once the iterations have moved on from it)
            return run(_normalised(x, dtype, eps)[0], coefficients).unsqueeze(0)
        if torch.get_num_threads() == 1:
            return _one_by_one(run, _normalised(x, dtype, eps), coefficients)
    return run(_normalised(x, dtype, eps), coefficients)


def _one_by_one(run, x, coefficients: tuple):
    """``run`` on each matrix of ``x`` in 2-D, each result written over its input. In bf16 on the CPU, 2-D products
    round as batched ones do (in fp32 MKL's ``mm`` rounds small matrices apart from its batched products), and
    oneDNN ran them faster: a batch of one times a transposed view took a slow path, and on one thread batched
    products were slower than one matrix after another; on two, batches are faster (they split their matrices over
    the threads). The measurements: docs/muon-adafactor.md. (``newton_schulz`` normalises the batch as one: a norm
    over a matrix's two dims may sum in another order.)"""
    for i, matrix in enumerate(x):
        x[i] = run(matrix, coefficients)
    return x


def _normalised(x, dtype, eps):
    """A copy of ``x`` in ``dtype``, each matrix divided by its Frobenius norm (at least ``eps``)."""
    x = x.to(dtype, copy=True)
    return x.div_(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))


def _addmm(input, a, b, beta, alpha=1.0):
    """beta * input + alpha * (a @ b), for one matrix or a batch."""
    return (torch.addmm if input.dim() == 2 else torch.baddbmm)(input, a, b, beta=beta, alpha=alpha)


def _standard(x, coefficients: tuple):
    """torch iterates on a tall matrix's transpose, X^T <- a X^T + (b A + c A^2) X^T with A = X^T X; transposed
    back, that is X <- a X + X (b A + c A^2): the same products on the matrix as it lies, with no transposing copy
    of X in or out (``addmm``: the scaling and the sum in the product's own pass). ``x``: a matrix or a batch."""
    tall = x.shape[-2] > x.shape[-1]
    for a, b, c in coefficients:
        if tall:
            gram = x.mT @ x
            x = _addmm(x, x, _addmm(gram, gram, gram, beta=b, alpha=c), beta=a)
        else:
            gram = x @ x.mT
            x = _addmm(x, _addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def _gram(x, coefficients: tuple):
    """Gram Newton-Schulz (module docstring). A tall X takes its right-hand Gram X^T X and the products on the
    right (X <- X B): every B is a polynomial in the same R, so B, R and Q commute, and the order of the products
    only changes rounding."""
    tall = x.shape[-2] > x.shape[-1]

    def gram_of(x):
        return x.mT @ x if tall else x @ x.mT

    def apply(q, x):
        return x @ q if tall else q @ x

    starts = restarts(coefficients)
    r, q = gram_of(x), None
    for i, (a, b, c) in enumerate(coefficients):
        if i in starts:  # the iterate from X itself
            x = apply(q, x)
            r, q = gram_of(x), None
        poly = _addmm(r, r, r, beta=b, alpha=c)
        poly.diagonal(dim1=-2, dim2=-1).add_(a)  # B = a I + b R + c R^2
        q = poly if q is None else poly @ q
        if i + 1 < len(coefficients) and i + 1 not in starts:
            r = poly @ r @ poly
    return apply(q, x)
