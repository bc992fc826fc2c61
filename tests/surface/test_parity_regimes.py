"""Parity in the regimes test_parity.py does not reach: grads small enough that eps decides the step, and a
long run. The oracle and the setup are test_parity's (torch.optim's single-tensor path, or the reference
written from the paper; its params in two groups); the optimizers and option sets come from the registry.

* Small grads. With unit-scale grads an eps of 1e-8 is a 1e-8 share of a denominator near 1, below any fp32
  test: an eps added in the wrong place passes. Here every grad element is drawn at a scale spread
  log-uniformly over 1e-3 .. 1e-10, and each param has its own extra factor down to 1e-6 (a per-tensor rule,
  Muon's norm, Adafactor's factors, sees a whole tensor at a small scale), so every eps of the registry's
  optimizers (1e-10 .. 1e-3; Adadelta's under a square root, where grads near sqrt(eps) matter) meets grads
  of its own size. Every optimizer with an eps, at every level (``EPS_CASES`` says which option sets).
* A long run: 300 steps on a small param, where bias corrections and step-dependent schedules (NAdam's
  momentum decay, ASGD's averaging after t0, RAdam's rectification, Adafactor's beta2_t) have moved far from
  their first steps. Every optimizer, at the loop level and the fused level (``LONG_CASES``).
"""

import pytest
import torch

from conftest import assert_state_close, clone_params, make_params, param_atol, set_grads, two_groups
from fastoptim.levels import LEVELS
from fastoptim.reference import reference_class, reference_kwargs
from fastoptim.registry import OPTIMIZERS
from test_parity import _assert_state_close


def _pair(name, index, level):
    """fastoptim at ``level`` and its oracle, on the same params, with option set ``index``."""
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    ours_p = make_params(name=name)
    ref_p = clone_params(ours_p)
    ours = spec.cls(two_groups(ours_p, opts), impl=level, **opts)
    ref = reference_class(spec)(two_groups(ref_p, opts), **opts, **reference_kwargs(spec))
    return ours, ours_p, ref, ref_p

SMALL_STEPS = 10  # RAdam divides by sqrt(v) + eps only once rho_t > 5: from step 6 at its default betas
LONG_STEPS = 300
# fp32 rounding compounds over a long run: a weight decayed by a factor rounded to fp32 (up to 2^-24 off) drifts
# from the float64 reference's product by up to 2^-24 of itself per step, 1.8e-5 after 300 steps (Lion,
# decaying by 1 - lr wd, was measured 1.13e-5 off after 220 steps); test_parity's rtol over its 20 steps is 1e-5
LONG_RTOL = 1e-5 + LONG_STEPS * 2.0 ** -24
# every option set at the loop level (the rule's own math and scalars()), the first one (the optimizer's default
# eps) at the others: their math is the same rule's, and the compiled level compiles for seconds per option set
EPS_CASES = [(name, i, level) for name, spec in OPTIMIZERS.items() if "eps" in spec.cls.rule.defaults
             for i in range(len(spec.option_sets)) for level in LEVELS if level == "loop" or i == 0]
# the richer option set (weight decay, other betas) where there is one, at the loop level (the rule's math and
# scalars() as written) and the fused level (the CPU kernel, or torch's fused one)
LONG_CASES = [(name, min(1, len(spec.option_sets) - 1), level) for name, spec in OPTIMIZERS.items()
              for level in ("loop", "fused")]


def _small_grads(step, param_sets):
    """set_grads' grads, each element scaled by 10^-U(3, 10) and each param by 10^-(2 (i mod 4))."""
    set_grads(step, param_sets, none_every=10 ** 9)
    g = torch.Generator().manual_seed(7919 + step)
    for i, ref in enumerate(param_sets[0]):
        scale = 10.0 ** (-3.0 - 7.0 * torch.rand(ref.shape, generator=g, dtype=torch.float64))
        scale = (scale * 10.0 ** (-2 * (i % 4))).float()
        for params in param_sets:
            params[i].grad.mul_(scale)


def _assert_state_relatively_close(ours, ref, ours_p, ref_p):
    """test_parity's state check, with the absolute tolerance scaled to each tensor's own size (its states are
    as small as the grads here: a tolerance of 1e-6 would pass any of them)."""
    _assert_state_close(ours, ours_p, [ref.state[b] for b in ref_p], atol=1e-6, rtol=1e-5)
    for a, b in zip(ours_p, ref_p):
        for k, vb in ref.state[b].items():
            if k != "step" and k not in ours.rule.host_states and isinstance(vb, torch.Tensor) and vb.numel():
                size = vb.abs().max().item()
                if size > 0:
                    assert_state_close(ours.state[a][k] / size, vb / size, msg=f"state {k!r} (over {size:.1e})")


@pytest.mark.parametrize("name,index,level", EPS_CASES)
def test_small_grads_where_eps_decides_the_step(name, index, level):
    ours, ours_p, ref, ref_p = _pair(name, index, level)
    atol = param_atol(name, OPTIMIZERS[name].option_sets[index])
    moved = 0.0
    for step in range(1, SMALL_STEPS + 1):
        before = [p.detach().clone() for p in ref_p]
        _small_grads(step, [ours_p, ref_p])
        ours.step()
        ref.step()
        for i, (a, b) in enumerate(zip(ours_p, ref_p)):
            torch.testing.assert_close(a, b, atol=atol, rtol=1e-5, msg=lambda m: f"step {step}, param {i}: {m}")
        moved = max([moved] + [(p - b).abs().max().item() for p, b in zip(ref_p, before) if p.numel()])
        _assert_state_relatively_close(ours, ref, ours_p, ref_p)
    # the params moved far more than the tolerance: the steps (where eps decides them) are being compared
    assert moved > 100 * atol, moved


@pytest.mark.parametrize("name,index,level", LONG_CASES)
def test_long_run_matches_reference(name, index, level):
    """One small param (a matrix, for every optimizer takes one), 300 steps, against the same oracle."""
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    g = torch.Generator().manual_seed(5)
    ours_p = [torch.nn.Parameter(torch.randn(6, 5, generator=g))]
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl=level, **opts)
    ref = reference_class(spec)(ref_p, **opts, **reference_kwargs(spec))
    atol = param_atol(name, opts)
    for step in range(1, LONG_STEPS + 1):
        set_grads(step, [ours_p, ref_p], none_every=10 ** 9)
        ours.step()
        ref.step()
        if step % 10 == 0:
            torch.testing.assert_close(ours_p[0], ref_p[0], atol=atol, rtol=LONG_RTOL,
                                       msg=lambda m: f"step {step}: {m}")
    _assert_state_close(ours, ours_p, [ref.state[b] for b in ref_p], atol=1e-6, rtol=LONG_RTOL)
