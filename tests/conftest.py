import itertools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from fastoptim.levels import LEVELS  # noqa: E402
from fastoptim.registry import OPTIMIZERS  # noqa: E402

# (optimizer name, option-set index, level): the parity matrix, straight from the registry
MATRIX = [(name, i, level)
          for name, spec in OPTIMIZERS.items()
          for i, level in itertools.product(range(len(spec.option_sets)), LEVELS)]
CASES = [(name, i) for name, spec in OPTIMIZERS.items() for i in range(len(spec.option_sets))]


def make_params(seed=0, dtype=torch.float32):
    """A mix of awkward params: 0-d, one element, empty, 2-D, 3-D, non-contiguous, plus a plain vector."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(), (1,), (0,), (7, 5), (3, 4, 2), (33,)]
    params = [torch.randn(s, generator=g, dtype=torch.float32).to(dtype) for s in shapes]
    params.append(torch.randn(6, 9, generator=g).to(dtype).t())  # non-contiguous (transposed) param
    return [torch.nn.Parameter(p) for p in params]


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def two_groups(params, opts):
    """Two param groups with different hyper-parameters."""
    second = dict(opts)
    second["lr"] = opts.get("lr", 1e-3) * 0.5
    return [{"params": params[:4]}, {"params": params[4:], **{k: v for k, v in second.items() if k == "lr"}}]


def set_grads(step, param_sets, seed=1, none_every=3):
    """Same grads for every param set; one param has grad None every few steps (it must be skipped)."""
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
            p.grad = None if grad is None else grad.to(p.dtype).clone()


@pytest.fixture(autouse=True)
def _levels_run_their_own_paths(monkeypatch):
    """For speed, the compiled level runs buckets of small tensors on the fused level's path, and the
    foreach level runs the fused level's path on the CPU. Here every level runs its own path, so that is
    what the tests test; test_levels_extra's routing tests check the routing itself."""
    from fastoptim import levels
    monkeypatch.setattr(levels, "ROUTING", False)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


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
