"""clip_grad_norm_ against torch's, and clipping fused into the step at every level."""

import pytest
import torch

import fastoptim
from conftest import NAME_FLAT, assert_params_close, clone_params, make_params, set_grads
from fastoptim.levels import IMPLS, LEVELS, record_paths
from fastoptim.paths.torch_fused import TorchFused
from fastoptim.registry import OPTIMIZERS
from fastoptim.reference import reference_class, reference_kwargs


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(norm_type, max_norm):
    ours = make_params()
    if norm_type == float("inf"):  # torch's own clip_grad_norm_ fails on empty grads here; ours skips them
        ours = [p for p in ours if p.numel()]
    ours.append(torch.nn.Parameter(torch.randn(5, dtype=torch.float64)))  # a second dtype
    ref = clone_params(ours)
    set_grads(1, [ours, ref], none_every=10 ** 9)
    total = fastoptim.clip_grad_norm_(ours, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for a, b in zip(ours, ref):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_clip_grad_norm_edge_cases():
    assert fastoptim.clip_grad_norm_([], 1.0).item() == 0.0
    empty = torch.nn.Parameter(torch.ones(0))
    empty.grad = torch.ones(0)
    assert fastoptim.clip_grad_norm_([empty], 1.0, norm_type=float("inf")).item() == 0.0
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("nan"), 2.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        fastoptim.clip_grad_norm_(p, 1.0, error_if_nonfinite=True)
    q = torch.nn.Parameter(torch.ones(2))
    q.grad = torch.tensor([3.0, 4.0])
    assert fastoptim.clip_grad_norm_(q, 1.0).item() == pytest.approx(5.0)  # a single tensor works too
    torch.testing.assert_close(q.grad, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=0)


@pytest.mark.sample(("name", "flat"), ("flat", "level"))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name,flat", NAME_FLAT)
def test_max_grad_norm_in_step_matches_clip_then_step(name, level, flat):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[1]
    ours_p = make_params(name=name)
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl=level, flat=flat, max_grad_norm=0.7, **opts)
    ref = reference_class(spec)(ref_p, **opts, **reference_kwargs(spec))
    clipped = 0
    for step in range(1, 6):
        set_grads(step, [ours_p, ref_p], none_every=10 ** 9)
        norm = torch.nn.utils.clip_grad_norm_(ref_p, 0.7)
        clipped += norm.item() > 0.7
        ours.step()
        ref.step()
        torch.testing.assert_close(ours.last_grad_norm, norm, rtol=1e-6, atol=0)
        assert_params_close(ours_p, ref_p)
    assert clipped  # the clip really bit


def _cpu_path(rule, impl: str, routing: bool, dtype: torch.dtype) -> str:
    """The path a CPU bucket of small tensors runs on at ``impl`` (``engine.dispatch.plain_route``)."""
    if impl == "loop":
        return "loop"
    if impl in ("foreach", "compiled") and not routing:
        return impl
    return "torch_fused" if TorchFused.declared(rule, dtype) else "foreach"


@pytest.mark.sample("name", ("impl", "routing"), "dtypes")
@pytest.mark.parametrize("routing", [False, True], ids=["own_paths", "routed"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "lion", "adagrad", "rmsprop"])
@pytest.mark.parametrize("dtypes", [(torch.float64,) * 3, (torch.float32, torch.float64, torch.float32)],
                         ids=["fp64", "fp32+fp64"])
def test_max_grad_norm_on_fp64_grads_matches_clip_then_step(monkeypatch, dtypes, name, impl, routing):
    """An fp64 grad makes the clip factor fp64 (torch's norm is taken in the grads' dtypes, stacked): each bucket
    steps with it in its own dtype, as ``clip_grad_norm_``'s ``_foreach_mul_`` casts it, torch's fused kernels
    included (they read the scale as fp32: an fp64 bucket's grads are scaled in fp64 first). fp64 params match
    to a few ulps; ``routed``: the paths users get (the foreach and compiled levels on the fused level's)."""
    from fastoptim.engine import dispatch

    monkeypatch.setattr(dispatch, "ROUTING", routing)
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[1]  # (SGD: with momentum)
    g = torch.Generator().manual_seed(0)
    ours_p = [torch.nn.Parameter(torch.randn(shape, generator=g, dtype=dtype))
              for shape, dtype in zip([(6, 5), (7,), (3, 2)], dtypes)]
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl=impl, max_grad_norm=0.5, **opts)
    ref = reference_class(spec)(ref_p, **opts, **reference_kwargs(spec))
    expected = {_cpu_path(spec.cls.rule, impl, routing, dtype) for dtype in dtypes}
    for _ in range(4):
        for a, b in zip(ours_p, ref_p):
            a.grad = 3 * torch.randn(a.shape, generator=g, dtype=a.dtype)
            b.grad = a.grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(ref_p, 0.5)
        with record_paths() as paths:
            ours.step()
        ref.step()
        assert set(paths) == expected, paths
        torch.testing.assert_close(ours.last_grad_norm, norm, rtol=1e-12 if norm.dtype == torch.float64 else 1e-6,
                                   atol=0)
        for i, (a, b) in enumerate(zip(ours_p, ref_p)):
            tight = a.dtype == torch.float64
            torch.testing.assert_close(a, b, atol=1e-13 if tight else 1e-6, rtol=1e-12 if tight else 1e-5,
                                       msg=lambda m: f"param {i} ({a.dtype}): {m}")
            for key, value in ref.state[b].items():
                if key != "step" and isinstance(value, torch.Tensor):
                    torch.testing.assert_close(ours.state[a][key], value, atol=1e-13 if tight else 1e-6,
                                               rtol=1e-12 if tight else 1e-5, msg=lambda m: f"{key} {i}: {m}")


@pytest.mark.parametrize("level", LEVELS)
def test_max_grad_norm_with_grad_scaler_uses_unscaled_norm(level):
    torch.manual_seed(0)
    ours_p = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    ref_p = clone_params(ours_p)
    x = torch.randn(6, 4)
    ours = fastoptim.AdamW(ours_p, impl=level, max_grad_norm=0.5, lr=1e-2)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, foreach=False)
    s_ours = torch.amp.GradScaler("cpu", init_scale=1024.0)
    s_ref = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(4):
        for params, opt, scaler in ((ours_p, ours, s_ours), (ref_p, ref, s_ref)):
            opt.zero_grad()
            scaler.scale((x @ params[0] + params[1]).pow(2).sum()).backward()
            if opt is ref:
                scaler.unscale_(ref)
                norm = torch.nn.utils.clip_grad_norm_(ref_p, 0.5)
            scaler.step(opt)
            scaler.update()
        torch.testing.assert_close(ours.last_grad_norm, norm, rtol=1e-5, atol=0)
        assert_params_close(ours_p, ref_p)


@pytest.mark.parametrize("bad", [0, -1.0, "1", True])
def test_bad_max_grad_norm_is_refused(bad):
    with pytest.raises(ValueError, match="max_grad_norm"):
        fastoptim.SGD(make_params(), max_grad_norm=bad)
