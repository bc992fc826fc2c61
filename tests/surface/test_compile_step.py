"""``torch.compile`` of a function that calls ``opt.step()``, as PyTorch's docs teach.

The step is a clean graph break (it runs eagerly, the rest of the function compiles): the numbers are eager's bit
for bit, ``fullgraph=True`` says why it cannot hold, and repeated calls with an LR schedule do not recompile.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import fastoptim
from fastoptim.registry import OPTIMIZERS

from conftest import clone_params, shape_for


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # each test's compiled function starts with no cache (and no recompile count)
    yield
    torch._dynamo.reset()


def _params(name, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 12), (12,), (3, 4, 2)]
    return [torch.nn.Parameter(torch.randn(shape_for(name, s), generator=g)) for s in shapes]


def _compiled_and_eager(make, name, steps=3, **compile_kwargs):
    """The same optimizer stepped through a compiled ``step()`` and eagerly, with an LR schedule stepping
    between steps; returns both runs' params and optimizers."""
    ours_p = _params(name)
    eager_p = clone_params(ours_p)
    runs = []
    for params, compiled in ((ours_p, True), (eager_p, False)):
        opt = make(params)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))

        def step():
            opt.step()
        run = torch.compile(step, **compile_kwargs) if compiled else step
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            run()
            sched.step()
        runs.append((params, opt))
    return runs


def _assert_bitwise_equal(runs):
    (ours_p, ours), (eager_p, eager) = runs
    for a, b in zip(ours_p, eager_p):
        assert torch.equal(a, b)
    ours_sd, eager_sd = ours.state_dict()["state"], eager.state_dict()["state"]
    assert set(ours_sd) == set(eager_sd)
    for i, entry in eager_sd.items():
        for k, v in entry.items():
            mine = ours_sd[i][k]
            assert torch.equal(mine, v) if isinstance(v, torch.Tensor) else mine == v, (i, k)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_steps_under_torch_compile_as_eagerly(name):
    spec = OPTIMIZERS[name]
    runs = _compiled_and_eager(lambda ps: spec.cls(ps, **spec.option_sets[1]), name)
    _assert_bitwise_equal(runs)


@pytest.mark.parametrize("impl,flat,bits", [("loop", False, 32), ("foreach", False, 32), ("fused", False, 32),
                                            ("compiled", False, 32), ("auto", True, 32), ("auto", False, 8),
                                            ("compiled", True, 8), ("foreach", True, 32)])
def test_impls_flat_and_low_bit_state_with_clipping_step_as_eagerly(impl, flat, bits):
    make = lambda ps: fastoptim.AdamW(ps, lr=1e-2, impl=impl, flat=flat, state_bits=bits,  # noqa: E731
                                      min_quant_size=16, max_grad_norm=0.5)
    runs = _compiled_and_eager(make, "adamw")
    _assert_bitwise_equal(runs)
    assert runs[0][1].last_grad_norm is not None


@pytest.mark.parametrize("name", ["lion", "muon"])
def test_low_bit_state_of_other_rules_steps_as_eagerly(name):
    spec = OPTIMIZERS[name]
    runs = _compiled_and_eager(lambda ps: spec.cls(ps, **spec.option_sets[0], state_bits=8, min_quant_size=16), name)
    _assert_bitwise_equal(runs)


def test_fullgraph_says_why_the_step_cannot_be_in_the_graph():
    params = _params("adamw")
    opt = fastoptim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]

    @torch.compile(fullgraph=True)
    def step():
        opt.step()
    with pytest.raises(Exception, match="fastoptim's step and zero_grad run eagerly under torch.compile"):
        step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))  # nothing ran


@pytest.mark.parametrize("flat", [False, True])
def test_a_compiled_train_step_compiles_around_the_step_and_does_not_recompile(flat):
    """A train step with work before and after ``opt.step()`` (forward, loss, zero_grad), called 5 times with a
    schedule stepping in between: one graph for the forward, no recompiles after the first call, eager's
    numbers."""
    results = []
    for compiled in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        opt = fastoptim.AdamW(model.parameters(), lr=1e-2, flat=flat, max_grad_norm=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))

        def train_step():
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        run = torch.compile(train_step) if compiled else train_step
        counters.clear()
        losses, compiles = [], []
        for _ in range(5):
            losses.append(run())
            sched.step()
            compiles.append((counters["frames"]["total"], counters["stats"]["unique_graphs"]))
        if compiled:  # (Dynamo counts every frame it compiles, recompiles included, and every graph it makes)
            assert compiles[0][1] >= 1  # the forward compiled
            assert compiles[1:] == [compiles[0]] * 4, compiles  # nothing compiled again after the first call
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (ours_losses, ours_p), (eager_losses, eager_p) = results
    torch.testing.assert_close(ours_losses, eager_losses, atol=1e-6, rtol=1e-5)  # (Inductor's forward: not bitwise)
    for a, b in zip(ours_p, eager_p):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_the_compiled_level_still_compiles_its_own_kernel_inside_the_graph_break():
    """The step runs eagerly under an outer torch.compile, but the compiled level's own compiled kernel still runs
    (the outer function makes no graph of its own: the one graph is the level's)."""
    from fastoptim.levels import record_paths

    params = [torch.nn.Parameter(torch.randn(200, 100))]  # large enough that the level is not routed elsewhere
    eager_p = clone_params(params)
    ours, eager = (fastoptim.AdamW(ps, lr=1e-2, impl="compiled") for ps in (params, eager_p))
    compiled_step = torch.compile(lambda: ours.step())
    g = torch.Generator().manual_seed(0)
    counters.clear()
    with record_paths() as paths:
        for _ in range(3):
            grad = torch.randn(200, 100, generator=g)
            params[0].grad, eager_p[0].grad = grad.clone(), grad.clone()
            compiled_step()
            eager.step()
    assert set(paths) == {"compiled"}
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(params[0], eager_p[0])


def test_a_first_call_under_fullgraph_names_the_reason():
    """``fastoptim.eager`` makes its ``torch.compiler.disable`` at the first call (so importing fastoptim does not
    import Dynamo); a first call that happens inside a fullgraph=True trace still fails with the reason, and a
    plain compile runs it eagerly."""
    from fastoptim.eager import eager

    calls = []

    @eager(reason="the reason users read")
    def not_traceable(x):
        calls.append(torch.compiler.is_compiling())
        return x + 1

    with pytest.raises(Exception, match="the reason users read"):
        torch.compile(lambda x: not_traceable(x) * 2, fullgraph=True)(torch.ones(2))
    assert torch.equal(torch.compile(lambda x: not_traceable(x) * 2)(torch.ones(2)), torch.full((2,), 4.0))
    assert calls == [False]  # run once, eagerly
