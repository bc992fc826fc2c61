"""The dispatcher's routes (``fastoptim.engine.dispatch``): which chain of paths each level takes on the CPU, by
dtype, tensor size and state format, as the levels have always routed."""

import warnings

import pytest
import torch

import fastoptim
from fastoptim.engine import dispatch
from fastoptim.paths.base import Bucket


def _names(chain):
    return [path.name for path in chain]


def _bucket(numel: int, dtype=torch.float32) -> Bucket:
    params = [torch.zeros(numel, dtype=dtype) for _ in range(2)]
    return Bucket(params, [torch.zeros_like(p) for p in params], [])


@pytest.fixture
def routing(monkeypatch):
    monkeypatch.setattr(dispatch, "ROUTING", True)
    monkeypatch.setattr(dispatch, "_said", set())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


@pytest.mark.parametrize("impl, numel, dtype, cls, expected", [
    ("loop", 1 << 15, torch.float32, fastoptim.AdamW, ["loop"]),
    ("foreach", 1 << 15, torch.float32, fastoptim.AdamW, ["torch_fused", "foreach"]),  # the fused level's route
    ("fused", 1 << 15, torch.float32, fastoptim.AdamW, ["torch_fused", "foreach"]),
    ("auto", 1 << 15, torch.bfloat16, fastoptim.AdamW, ["compiled", "foreach"]),  # not torch's: wrong in bf16
    ("fused", 1 << 15, torch.float32, fastoptim.Lion, ["compiled", "foreach"]),
    ("fused", 100, torch.float32, fastoptim.Lion, ["foreach"]),  # too small to compile
    ("compiled", 1 << 15, torch.float32, fastoptim.Lion, ["compiled"]),
    ("compiled", 100, torch.float32, fastoptim.Lion, ["foreach"]),  # small tensors: the fused level's route
])
def test_plain_routes_on_the_cpu(routing, impl, numel, dtype, cls, expected):
    assert _names(dispatch.plain_route(impl, _bucket(numel, dtype), cls.rule)) == expected


def test_routing_off_runs_each_level_on_its_own_path(monkeypatch):
    monkeypatch.setattr(dispatch, "ROUTING", False)
    assert _names(dispatch.plain_route("foreach", _bucket(100), fastoptim.AdamW.rule)) == ["foreach"]
    assert _names(dispatch.plain_route("compiled", _bucket(100), fastoptim.AdamW.rule)) == ["compiled"]


@pytest.mark.parametrize("impl, rounding, expected", [
    ("auto", "nearest", "cpu_kernel"), ("fused", "nearest", "cpu_kernel"), ("foreach", "nearest", "cpu_kernel"),
    ("compiled", "nearest", "cpu_kernel"), ("loop", "nearest", None), ("fused", "kahan", None),
])
def test_stored_state_meets_the_cpu_kernel_where_the_fused_level_runs(routing, impl, rounding, expected):
    path = dispatch.stored_path(impl, torch.device("cpu"), rounding)
    assert (path and path.name) == expected
