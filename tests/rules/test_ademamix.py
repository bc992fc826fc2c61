"""AdEMAMix against bitsandbytes' own (``bitsandbytes.optim.AdEMAMix``, 32-bit state, its CPU kernel): the same
params and states after every step, with and without the ``t_alpha``/``t_beta3`` warmups, at each level.

bitsandbytes stacks the fast and slow EMAs in ``state1`` (2, *shape) and keeps the second moment in ``state2``;
fastoptim keeps them as ``exp_avg``, ``exp_avg_slow`` and ``exp_avg_sq``. Both compute in fp32 with the same
operations in the same order (bitsandbytes' ``m.mul_(b).add_(g, alpha=1 - b)`` is ``m * b + g * (1 - b)``), so
the tolerance is the fp32 one of DESIGN.md (atol 1e-6, rtol 1e-5), and what was measured is far below it.
"""

import functools

import pytest
import torch

import fastoptim
from fastoptim.levels import LEVELS, record_paths

SHAPES = [(64, 1024), (80,), (1,)]
# the path each level takes on the CPU for fp32 state (a bucket this size is not routed to the small-tensor path)
PATH = {"loop": "loop", "foreach": "foreach", "fused": "compiled", "compiled": "compiled"}
STEPS = 20
OPTIONS = [
    dict(lr=1e-2),
    dict(lr=1e-2, betas=(0.8, 0.95, 0.999), alpha=2.0, weight_decay=0.1, eps=1e-6),
    dict(lr=1e-2, t_alpha=10, t_beta3=20),
    dict(lr=3e-3, t_alpha=5, t_beta3=7, weight_decay=0.0, alpha=8.0),
]


@functools.cache
def _bnb_ademamix():
    """bitsandbytes' AdEMAMix, imported by the first test that needs it (not at collection: the import takes
    seconds in every test process); the test is skipped where bitsandbytes or its CPU kernels are not here."""
    bnb = pytest.importorskip("bitsandbytes")
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    try:
        bnb.optim.AdEMAMix([p], optim_bits=32).step()
    except Exception as error:  # (a build without the CPU optimizer kernels)
        pytest.skip(f"bitsandbytes' AdEMAMix does not run on this CPU: {error}")
    return bnb.optim.AdEMAMix


@pytest.mark.sample("index", "level")
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("index", range(len(OPTIONS)))
def test_matches_bitsandbytes_every_step(index, level):
    opts = OPTIONS[index]
    g = torch.Generator().manual_seed(index)
    ours_p = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    theirs_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = fastoptim.AdEMAMix(ours_p, impl=level, **opts)
    theirs = _bnb_ademamix()(theirs_p, optim_bits=32, **opts)
    worst = 0.0
    for step in range(1, STEPS + 1):
        for a, b in zip(ours_p, theirs_p):
            a.grad = torch.randn(a.shape, generator=g) * (1e-3 if step % 3 == 0 else 1.0)  # small grads too
            b.grad = a.grad.clone()
        with record_paths() as paths:
            ours.step()
        theirs.step()
        assert PATH[level] in paths, (level, paths)
        for a, b in zip(ours_p, theirs_p):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
            worst = max(worst, (a - b).abs().max().item())
            mine, bits = ours.state[a], theirs.state[b]
            assert float(mine["step"]) == bits["step"] == step
            for name, value in (("exp_avg", bits["state1"][0]), ("exp_avg_slow", bits["state1"][1]),
                                ("exp_avg_sq", bits["state2"])):
                torch.testing.assert_close(mine[name], value, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    print(f"AdEMAMix vs bitsandbytes, options {index}, {level}: max |param difference| {worst:.3g}")


def test_the_warmups_are_bitsandbytes_schedules():
    """alpha rises linearly to alpha over t_alpha steps; beta3 moves from beta1 towards beta3, reaching it at
    t_beta3 and staying there (the paper's half-life interpolation)."""
    from fastoptim.rules.ademamix import warmed_up

    group = dict(betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=10, t_beta3=100)
    alphas, beta3s = zip(*(warmed_up(group, t) for t in range(1, 301)))
    assert alphas[0] == 0.5 and alphas[9:] == (5.0,) * 291
    assert beta3s[0] > 0.9 and all(a < b for a, b in zip(beta3s[:99], beta3s[1:100]))
    assert beta3s[99:] == (0.9999,) * 201
    assert warmed_up(dict(group, t_alpha=None, t_beta3=0), 1) == (5.0, 0.9999)


@pytest.mark.parametrize("kwargs,word", [(dict(betas=(0.9, 0.999)), "betas"), (dict(betas=(0.9, 0.999, 1.0)), "beta3"),
                                         (dict(t_alpha=-1), "t_alpha"), (dict(t_beta3=2.5), "t_beta3"),
                                         (dict(betas=(0.0, 0.999, 0.9999), t_beta3=10), "beta1 and beta3"),
                                         (dict(alpha="five"), "alpha")])
def test_bad_hyperparameter_is_named(kwargs, word):
    with pytest.raises((ValueError, TypeError), match=word):
        fastoptim.AdEMAMix([torch.nn.Parameter(torch.ones(3))], **kwargs)
