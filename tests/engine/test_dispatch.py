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


def _bucket(*numels: int, dtype=torch.float32) -> Bucket:
    """Two params of ``numels[0]`` elements, or one param of each size given."""
    params = [torch.zeros(numel, dtype=dtype) for numel in (numels * 2 if len(numels) == 1 else numels)]
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
    # a bucket of a large and a small tensor: each tensor by its own size (the large one compiled)
    ("fused", (1 << 15, 100), torch.float32, fastoptim.Lion, ["compiled", "foreach"]),
    ("fused", (1 << 14, 1 << 15), torch.float32, fastoptim.Lion, ["compiled", "foreach"]),
    ("fused", (1 << 15, 100), torch.float32, fastoptim.AdamW, ["torch_fused", "foreach"]),
    ("compiled", (1 << 15, 100), torch.float32, fastoptim.Lion, ["compiled", "foreach"]),
    ("compiled", (1 << 14, 1 << 15), torch.float32, fastoptim.Lion, ["compiled"]),
    ("compiled", (1 << 15, 100), torch.float32, fastoptim.AdamW, ["compiled", "torch_fused", "foreach"]),
])
def test_plain_routes_on_the_cpu(routing, impl, numel, dtype, cls, expected):
    numels = numel if isinstance(numel, tuple) else (numel,)
    assert _names(dispatch.plain_route(impl, _bucket(*numels, dtype=dtype), cls.rule)) == expected


@pytest.mark.parametrize("impl, cls, large_path, small_path", [
    ("auto", fastoptim.NAdam, "compiled", "foreach"),  # no fused kernel of torch's: large tensors compiled
    ("compiled", fastoptim.NAdam, "compiled", "foreach"),
    ("auto", fastoptim.AdamW, "torch_fused", "torch_fused"),  # torch's fused kernel, whatever the size
    ("compiled", fastoptim.AdamW, "compiled", "torch_fused"),
])
@pytest.mark.parametrize("shapes", [[(100, 200), (100,)], [(100, 400), (100,)]], ids=["mean_under", "mean_over"])
@pytest.mark.parametrize("split", ["two_optimizers", "release"])
def test_a_param_steps_the_same_bits_whatever_shares_its_bucket(routing, impl, cls, large_path, small_path,
                                                                shapes, split):
    """A param's path is chosen by its own size (at least ``MIN_NUMEL`` elements: compiled), never by the other
    tensors of its bucket, whose mean size may fall either side of it: the params stepped in separate buckets
    (two optimizers over a large and a small param, or gradient release's per-param buckets) end bit for bit
    where one bucket of both leaves them, params and state, and each ran the path its size says."""
    from fastoptim.levels import record_paths

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=g) for shape in shapes]
    together, apart = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    opts = dict(lr=1e-2, weight_decay=0.1, impl=impl)
    one = cls(together, **opts)
    if split == "release":
        several = [cls(apart, gradient_release=True, release_bucket_mb=1e-6, **opts)]  # a bucket per param
    else:
        several = [cls([p], **opts) for p in apart]
    owner = {id(p): opt for opt in several for group in opt.param_groups for p in group["params"]}
    for step in range(3):
        weights = [torch.randn(shape, generator=g) for shape in shapes]
        with record_paths() as paths_apart:
            for params in (apart, together):
                sum((torch.tanh(p) * w).sum() for p, w in zip(params, weights)).backward()
        with record_paths() as paths_together:
            one.step()
        with record_paths() as each:
            for opt in several:
                opt.step()  # (release: backward stepped them already)
        paths_apart += each
        for opt in (one, *several):
            opt.zero_grad()
        for a, b in zip(together, apart, strict=True):
            assert torch.equal(a, b), f"step {step}: {tuple(a.shape)} differs by {(a - b).abs().max().item()}"
            state = owner[id(b)].state[b]
            assert one.state[a].keys() == state.keys()
            for k, v in one.state[a].items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(state[k])), f"step {step}: state {k!r} differs"
        assert sorted(paths_apart) == sorted([large_path, small_path]), paths_apart
        assert sorted(set(paths_together)) == sorted({large_path, small_path}), paths_together


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


@pytest.mark.parametrize("cls", [fastoptim.NAdam, fastoptim.LAMB])
def test_a_bucket_of_temporaries_splits_by_size_each_step(routing, cls):
    """fp16 params with 16-bit state step through fp32 temporaries, new each step (``paths.staged``; LAMB's
    elementwise stages too): the part compiled and the part left to foreach are the step's own temporaries,
    never the ones a first step cached. One bucket of a large and a small param ends as a bucket per param does."""
    from fastoptim.levels import record_paths

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=g).half() for n in (1 << 15, 100)]
    together, apart = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    one = cls(together, lr=1e-2, state_bits=16)
    several = [cls([p], lr=1e-2, state_bits=16) for p in apart]
    for step in range(3):
        for a, b in zip(together, apart):
            a.grad = torch.randn(a.shape, generator=g).half()
            b.grad = a.grad.clone()
        with record_paths() as paths:
            one.step()
        for opt in several:
            opt.step()
        assert {"compiled", "foreach"} <= set(paths), paths
        for a, b in zip(together, apart, strict=True):
            assert torch.equal(a, b), f"step {step}: {tuple(a.shape)} differs by {(a - b).abs().max().item()}"
