import itertools
import math
import os
import sys
import threading

# Set before torch (and its OpenMP runtime) loads; the xdist workers inherit it. With `-n 2` on 2 cores each
# worker's OpenMP threads share the cores with the other worker's, and the runtime's default idle policy spins a
# while after every parallel region: torch's CPU fused kernels then took 20x longer on tiny tensors (an idle
# thread spins on the core the next region's thread needs). PASSIVE makes idle threads sleep instead: the same
# threads and the same code paths (the thread count is unchanged), without the spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from fastoptim import storage  # noqa: E402
from fastoptim.levels import LEVELS  # noqa: E402
from fastoptim.registry import OPTIMIZERS  # noqa: E402
from sampling import (cover, pytest_addoption, pytest_collection_modifyitems,  # noqa: E402, F401 (hooks)
                      pytest_configure, pytest_report_header)

# (optimizer name, option-set index, level): the parity matrix, straight from the registry
MATRIX = [(name, i, level)
          for name, spec in OPTIMIZERS.items()
          for i, level in itertools.product(range(len(spec.option_sets)), LEVELS)]
CASES = [(name, i) for name, spec in OPTIMIZERS.items() for i in range(len(spec.option_sets))]
# the optimizers whose math is one elementwise ``update`` (the others run ``stages``: Muon, Adafactor)
ELEMENTWISE = [name for name, spec in OPTIMIZERS.items() if not spec.cls.rule.stages]
ELEMENTWISE_CASES = [(name, i) for name, i in CASES if name in ELEMENTWISE]
# the optimizers that take flat=True (Adafactor refuses it: its factored states are not param-shaped; tested in
# test_parity.py::test_adafactor_refuses_flat_mode), and (name, flat) for every case a test can run
FLAT = [name for name, spec in OPTIMIZERS.items()
        if all(spec.cls.rule.state_shape(n, torch.empty(4, 3, device="meta")) in (None, (4, 3))
               for n in spec.cls.rule.state_names)]
NAME_FLAT = [(name, flat) for name in OPTIMIZERS for flat in (False, True) if not flat or name in FLAT]

# The devices the device-parametrized tests (parity, stateful, low-bit, rounding, integrations) run on: the CPU,
# plus CUDA where there is one. Only devices that exist are listed, so a CPU machine shows no skipped CUDA cases
# (nothing hidden behind a skip); a GPU machine runs the same tests against the same oracles on its real kernels
# (``-k cuda`` picks those out; a sampled matrix is sampled on each device, ``--full`` runs every case).
# FASTOPTIM_TEST_DEVICES=cuda (comma-separated) narrows the list.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# every stored format's ``state_bits`` (its width, or a named codec's name): 16, 8, 4, then "fp8_e4m3" ...
STORED = tuple(key for key in storage.codecs.keys() if key != 32)


def quantized(bits) -> bool:
    """Whether ``state_bits=bits`` keeps states as codes and scales (``QuantizedState``)."""
    return storage.codecs.for_bits(bits).quantized
if os.environ.get("FASTOPTIM_TEST_DEVICES"):
    DEVICES = [d for d in os.environ["FASTOPTIM_TEST_DEVICES"].split(",") if d in DEVICES]


def pairwise_with(cases, values):
    """``(*case, value)`` for a matrix too costly to run whole (each GPU build is seconds): every case with the
    first of ``values``, and each other value with as few cases as let it meet every value of every dimension
    of the cases (pairwise coverage: each case's kernel is built, each value is tried against each option, not
    every combination of the two)."""
    cases = [c if isinstance(c, tuple) else (c,) for c in cases]
    out = [(*c, values[0]) for c in cases]
    for value in values[1:]:
        needed = {(d, x) for c in cases for d, x in enumerate(c)}
        for c in cases:
            new = needed & set(enumerate(c))
            if new:
                out.append((*c, value))
                needed -= new
    return out


_early_builds = []


def pytest_sessionstart(session):
    """Under pytest-xdist the controller, idle while the workers start and collect, builds the C++ bookkeeping
    extension (fastoptim/native/bulk.py: about 20 s with cold caches) that the workers' first steps need; else one
    worker builds it while the other waits on its lock. A failure here says nothing: the workers build it again
    and report what fails."""
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        from fastoptim.native import bulk
        _early_builds.append(threading.Thread(target=bulk.unavailable, daemon=True))
        _early_builds[-1].start()


def pytest_sessionfinish(session):
    for thread in _early_builds:  # (a build cut off mid-way leaves its temporary file in the cache folder)
        thread.join()


@pytest.fixture(params=DEVICES)
def device(request):
    """Each device of ``DEVICES``, for a test that takes ``device`` (the integrations suite)."""
    return request.param


def make_params(seed=0, dtype=torch.float32, name=None, device="cpu"):
    """A mix of awkward params: 0-d, one element, empty, 2-D, 3-D, non-contiguous, plus a plain vector; for an
    optimizer of matrices (``name``'s registry entry says so) awkward matrices: tall, wide, 1x1, empty, shapes
    shared and not, non-contiguous. The values are drawn on the CPU and moved to ``device``: the same numbers on
    every device."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(), (1,), (0,), (7, 5), (3, 4, 2), (33,)]
    if name is not None and OPTIMIZERS[name].params == "matrices":
        shapes = [(7, 5), (5, 7), (0, 3), (7, 5), (1, 1), (3, 8)]
    elif name == "adafactor":  # torch.optim.Adafactor, the oracle, divides by zero on an empty param
        shapes.remove((0,))
        shapes.append((2, 3))
    params = [torch.randn(s, generator=g, dtype=torch.float32).to(device=device, dtype=dtype) for s in shapes]
    params.append(torch.randn(6, 9, generator=g).to(device=device, dtype=dtype).t())  # non-contiguous param
    return [torch.nn.Parameter(p) for p in params]


def matrix_shape(shape):
    """``shape`` as a matrix of the same number of elements, as near square as that number allows (a prime
    count gives one row; no elements, 0 rows): 2-D shapes stay as they are."""
    shape = tuple(shape)
    if len(shape) == 2:
        return shape
    n = math.prod(shape)
    if n == 0:
        return (0, max(1, shape[-1] if shape else 1))
    rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    return (rows, n // rows)


def shapes_for(name, shapes):
    """The param shapes a test wants, for optimizer ``name``: as given, or for an optimizer of matrices (its
    registry entry says so) each as a matrix of the same size (``matrix_shape``)."""
    if OPTIMIZERS[name].params == "matrices":
        return [matrix_shape(s) for s in shapes]
    return [tuple(s) for s in shapes]


def shape_for(name, shape):
    return shapes_for(name, [shape])[0]


def newton_schulz_in_bf16(name, opts):
    """Whether ``name`` with ``opts`` runs Muon's Newton-Schulz in bf16 on the CPU (ns_dtype None picks it where
    the CPU multiplies bf16 natively)."""
    if OPTIMIZERS[name].params != "matrices":
        return False
    from fastoptim.rules.muon import ns_dtype_for
    return ns_dtype_for(opts.get("ns_dtype")) == torch.bfloat16


# Muon with bf16 Newton-Schulz against ReferenceMuon (torch's loop, the same bf16 products): the two lay a tall
# matrix out differently for the product (ours transposes it contiguous, torch multiplies the strided view), so
# a bf16 product can round one spacing apart. An orthogonalised entry (below 1) then moves by up to 2^-8, the
# param by lr (0.02 in the registry) times the shape's lr ratio (sqrt(rows/cols) <= sqrt(1.5) in make_params)
# times that: 9.2e-5 measured. fp32 Newton-Schulz is held to the fp32 tolerance.
MUON_BF16_ATOL = 0.02 * math.sqrt(1.5) * 2.0 ** -8


def param_atol(name, opts):
    """The absolute tolerance of a parity check of params against the oracle: fp32's 1e-6, or for bf16
    Newton-Schulz ``MUON_BF16_ATOL`` (over a run, the spacings where the products round apart)."""
    return MUON_BF16_ATOL if newton_schulz_in_bf16(name, opts) else 1e-6


# A state made from the orthogonalised update (NorMuon's per-row second moment, a mean of its squares) takes a
# bf16 product's spacing apart with it: up to 2^-8 relatively. States made before Newton-Schulz (momentum) are as
# torch's to fp32's tolerance either way; this widens only the relative one, of every state, with bf16 products.
def state_rtol(name, opts, rtol=1e-5):
    """The relative tolerance of a parity check of states against the oracle: ``rtol``, or for bf16
    Newton-Schulz 2^-8."""
    return 2.0 ** -8 if newton_schulz_in_bf16(name, opts) else rtol


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def two_groups(params, opts):
    """Two param groups with different hyper-parameters."""
    second = dict(opts)
    second["lr"] = opts.get("lr", 1e-3) * 0.5
    return [{"params": params[:4]}, {"params": params[4:], **{k: v for k, v in second.items() if k == "lr"}}]


def set_grads(step, param_sets, seed=1, none_every=3):
    """Same grads for every param set (drawn on the CPU, put on each param's device); one param has grad None
    every few steps (it must be skipped)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    for i, ref in enumerate(param_sets[0]):
        if i == 1 and step % none_every == 0:
            grad = None
        else:
            grad = torch.randn(ref.shape, generator=g)
            if i == len(param_sets[0]) - 1:  # non-contiguous grad too
                grad = torch.randn(tuple(reversed(ref.shape)), generator=g).t()
        for params in param_sets:
            p = params[i]
            p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype, copy=True)


def same_random_grads(ours, theirs, g, scale=1.0):
    """One fresh random grad per param (from generator ``g``, times ``scale``), the same on both param lists."""
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn(a.shape, generator=g) * scale  # (times 1.0: the same bits)
        b.grad = a.grad.clone()


@pytest.fixture(autouse=True)
def _levels_run_their_own_paths(monkeypatch):
    """For speed, the compiled level runs buckets of small tensors on the fused level's path, and the
    foreach level runs the fused level's path on the CPU. Here every level runs its own path, so that is
    what the tests test; test_levels_extra's routing tests check the routing itself."""
    from fastoptim.engine import dispatch as levels
    monkeypatch.setattr(levels, "ROUTING", False)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == threads, "a test left torch's thread count changed for the tests after it"


def assert_state_close(actual, expected, msg="", atol=1e-6, rtol=1e-5):
    """State tensors (momentum buffers, second moments) can be far from 1 in size and cancel towards 0:
    the absolute tolerance scales with the tensor's largest magnitude, so one rounding difference in a
    buffer of size ~20 that happens to sit near 0 does not read as a 1e-3 relative error."""
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol, msg=lambda m: f"{msg}: {m}")


def assert_params_close(actual, expected, atol=1e-6, rtol=1e-5):
    """Two lists of params agree element for element (the issue's fp32 tolerance by default)."""
    for i, (a, b) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"param {i}: {m}")
