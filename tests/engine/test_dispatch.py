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


def _stored(opt, params) -> list[torch.Tensor]:
    """Each param and its states' codes and absmax, copied."""
    out = []
    for p in params:
        out.append(p.detach().clone())
        for value in opt.state[p].values():
            if isinstance(value, fastoptim.storage.QuantizedState):
                out += [value.codes.clone(), value.absmax.clone()]
    return out


def test_a_step_the_kernels_skip_stores_nothing_on_the_staged_part(monkeypatch):
    """GradScaler's found_inf goes into the kernels (Triton's interpreter here): a part of the bucket no kernel
    takes (fp16 params with 8-bit state) steps staged, which cannot skip by itself, so the dispatcher reads the
    flag before it; a skipped step leaves that param and its codes as they were, like the kernel's part."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from fastoptim.levels import record_paths

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 64, generator=g).half()),
              torch.nn.Parameter(torch.randn(4, 64, generator=g))]
    opt = fastoptim.AdamW(params, lr=1e-2, impl="fused", state_bits=8, min_quant_size=0)
    assert opt._step_supports_amp_scaling  # found_inf reaches the paths: none is read before the step
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    with record_paths() as paths:
        opt.step()  # the fp16 param through fp32 temporaries (the plain kernel), the fp32 one stored in its kernel
    assert paths == ["triton", "triton_stored"], paths
    before = _stored(opt, params)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
    opt.step()
    del opt.grad_scale, opt.found_inf
    after = _stored(opt, params)
    assert len(after) == len(before) == 10
    assert all(torch.equal(a, b) for a, b in zip(before, after))
