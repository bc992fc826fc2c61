"""Every optimizer x option set x level matches torch.optim (single-tensor) after each of 20 steps."""

import pytest
import torch

from conftest import (CASES, MATRIX, assert_params_close, assert_state_close, clone_params, make_params, set_grads,
                      two_groups)
from fastoptim.levels import LEVELS
from fastoptim.registry import OPTIMIZERS
from fastoptim.reference import ReferenceLion, reference_class, reference_kwargs

STEPS = 20


def _pair(name, index, level, dtype=torch.float32, flat=False):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    ours_p = make_params(dtype=dtype)
    ref_p = clone_params(ours_p)
    ours = spec.cls(two_groups(ours_p, opts), impl=level, flat=flat, **opts)
    ref = reference_class(spec)(two_groups(ref_p, opts), **opts, **reference_kwargs(spec))
    return ours, ours_p, ref, ref_p


def _assert_state_close(ours, ref, ours_p, ref_p, **tol):
    for a, b in zip(ours_p, ref_p):
        sa, sb = ours.state[a], ref.state[b]
        for k, vb in sb.items():
            if k == "step":
                assert float(sa["step"]) == float(vb)
            elif isinstance(vb, torch.Tensor):
                assert_state_close(sa[k], vb, msg=f"state {k!r}", **tol)


@pytest.mark.parametrize("name,index,level", MATRIX)
def test_matches_reference_every_step(name, index, level):
    ours, ours_p, ref, ref_p = _pair(name, index, level)
    for step in range(1, STEPS + 1):
        set_grads(step, [ours_p, ref_p])
        ours.step()
        ref.step()
        for i, (a, b) in enumerate(zip(ours_p, ref_p)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m: f"step {step}, param {i}: {m}")
    _assert_state_close(ours, ref, ours_p, ref_p, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name,index", CASES)
def test_levels_agree_on_params_and_state(name, index, level):
    """Level parity: each level against the loop level, params and state, every step."""
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    base_p = make_params()
    other_p = clone_params(base_p)
    base = spec.cls(two_groups(base_p, opts), impl="loop", **opts)
    other = spec.cls(two_groups(other_p, opts), impl=level, **opts)
    for step in range(1, 8):
        set_grads(step, [base_p, other_p])
        base.step()
        other.step()
        assert_params_close(base_p, other_p)
        _assert_state_close(other, base, other_p, base_p, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_low_precision_params_track_torch(name, level, dtype):
    """bf16/fp16 params, state in the param dtype as torch keeps it. Levels that do the math in fp32 (fused,
    compiled) drift from torch's per-op-rounded eager path, so the oracle is the same run in float64: ours
    must be no further from it than torch's own low-precision path is (with a small floor)."""
    spec = OPTIMIZERS[name]
    ours, ours_p, ref, ref_p = _pair(name, 1, level, dtype=dtype)
    opts = spec.option_sets[1]
    exact_p = [torch.nn.Parameter(p.detach().double()) for p in ours_p]
    exact = reference_class(spec)(two_groups(exact_p, opts), **opts, **reference_kwargs(spec))
    for step in range(1, 11):
        set_grads(step, [ours_p, ref_p, exact_p])
        ours.step()
        ref.step()
        exact.step()
    for a, b, e in zip(ours_p, ref_p, exact_p):
        assert a.dtype == dtype
        if not a.numel():
            continue
        ours_err = (a.double() - e).abs().max().item()
        torch_err = (b.double() - e).abs().max().item()
        assert ours_err <= max(2 * torch_err, 2e-2), (ours_err, torch_err)
    for p in ours_p:
        for k, v in ours.state[p].items():
            if isinstance(v, torch.Tensor):
                assert v.dtype == dtype, (name, k)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["sgd", "adam", "rmsprop", "adagrad"])
def test_complex_params_match_torch(name, level):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[1]
    g = torch.Generator().manual_seed(3)
    ours_p = [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64, generator=g))]
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl=level, **opts)
    ref = reference_class(spec)(ref_p, **opts, **reference_kwargs(spec))
    for _ in range(5):
        grad = torch.randn(4, 3, dtype=torch.complex64, generator=g)
        ours_p[0].grad, ref_p[0].grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
        torch.testing.assert_close(ours_p[0], ref_p[0], atol=1e-6, rtol=1e-5)


def test_lion_reference_is_not_trivially_equal():
    """Guard on the Lion oracle: a different beta1 must produce different params (the check can fail)."""
    spec = OPTIMIZERS["lion"]
    a_p = make_params()
    b_p = clone_params(a_p)
    a = spec.cls(a_p, lr=1e-2)
    b = reference_class(spec)(b_p, lr=1e-2, betas=(0.5, 0.99))
    for step in range(1, 4):
        set_grads(step, [a_p, b_p], none_every=100)
        a.step()
        b.step()
    assert any(not torch.allclose(x, y) for x, y in zip(a_p, b_p) if x.numel())


@pytest.mark.parametrize("level", LEVELS)
def test_lion_levels_compute_the_fp32_published_loop_and_differ_from_float64_by_sign_flips(level):
    """Why Lion's exactness oracle is the published loop in the param dtype, and float64 only a closeness one
    (``fastoptim curves``): where b1*m + (1-b1)*g is within a rounding of 0, float32 and float64 give it
    different signs and the weight moves 2*lr apart. After a first step with g = 100, m = 1 exactly; then
    g = -9 makes b1*m + (1-b1)*g exactly 0 in real arithmetic, 0.9f - 0.90000004f = -6e-8 in float32 and
    +2e-16 in float64. lr = 2^-10 keeps every other rounding out of the way."""
    lr = 2.0 ** -10

    def run(make):
        p = torch.nn.Parameter(torch.zeros(3))
        opt = make([p])
        for grad in ([100.0, 100.0, 100.0], [-9.0, 1.0, -1.0]):
            p.grad = torch.tensor(grad)
            opt.step()
        return p.detach()
    ours = run(lambda ps: OPTIMIZERS["lion"].cls(ps, impl=level, lr=lr))
    fp32 = run(lambda ps: ReferenceLion(ps, lr=lr, compute_dtype=None))
    fp64 = run(lambda ps: ReferenceLion(ps, lr=lr))
    assert torch.equal(ours, fp32), (ours, fp32)
    assert fp32.tolist() == [0.0, -2 * lr, -2 * lr] and fp64.tolist() == [-2 * lr, -2 * lr, -2 * lr], (fp32, fp64)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_cache_blocked_large_tensors_match_torch(name, level):
    """Tensors larger than a CPU block run piece by piece; contiguous, transposed and ragged sizes."""
    from fastoptim.levels.blocking import BLOCK_NUMEL
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[1]
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(3 * BLOCK_NUMEL + 17, generator=g), torch.randn(BLOCK_NUMEL // 7, 9, generator=g).t(),
               torch.randn(5, generator=g)]
    ours_p = [torch.nn.Parameter(t) for t in tensors]
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl=level, **opts)
    ref = reference_class(spec)(ref_p, **opts, **reference_kwargs(spec))
    for _ in range(3):
        for a, b in zip(ours_p, ref_p):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        ours.step()
        ref.step()
    assert_params_close(ours_p, ref_p)


@pytest.mark.parametrize("name,index,level", MATRIX)
def test_flat_mode_matches_reference_every_step(name, index, level):
    """flat=True: params, grads and states as views of one buffer per bucket; same numbers as torch.
    (Every param has a grad here: in flat mode a missing grad counts as zeros.)"""
    ours, ours_p, ref, ref_p = _pair(name, index, level, flat=True)
    for step in range(1, 11):
        set_grads(step, [ours_p, ref_p], none_every=10 ** 9)
        ours.step()
        ref.step()
        for i, (a, b) in enumerate(zip(ours_p, ref_p)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m: f"step {step}, param {i}: {m}")
    _assert_state_close(ours, ref, ours_p, ref_p, atol=1e-6, rtol=1e-5)
