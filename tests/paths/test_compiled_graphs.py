"""How many graphs the compiled level compiles (each costs seconds of Inductor, cold): pinned per rule for the test
params; 1-element tensors share the graph of larger ones; a stage declared ``flat`` gives what it gives shaped."""

import pytest
import torch

import fastoptim
from conftest import make_params, same_random_grads, set_grads, two_groups
from fastoptim.engine import dispatch
from fastoptim.levels import record_paths
from fastoptim.registry import OPTIMIZERS
from fastoptim.rules.base import RULES, PerTensor

# unique graphs of three steps over ``make_params`` (option set 0), from a cold start. Elementwise rules: one for
# every size (1-element tensors step packed); LAMB: its two elementwise stages and one trust ratio for every rank;
# Adafactor: one stage per rank class of its batch (vectors; matrices; 3-D); Muon: its two elementwise stages, and
# the stage's scalars unbound before its orthogonalisation (eager: Newton-Schulz and the blocks' shapes), per
# batch of one or more.
GRAPHS = {name: 1 for name in OPTIMIZERS}
GRAPHS.update(lamb=3, adafactor=3, muon=4, normuon=8)


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_graphs_compiled_per_rule_over_the_test_params(name, monkeypatch):
    monkeypatch.setattr(dispatch, "ROUTING", False)  # every bucket compiled, small ones too
    torch._dynamo.reset()
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[0]
    params = make_params(name=name)
    opt = spec.cls(two_groups(params, opts), impl="compiled", **opts)
    before = _unique_graphs()
    with record_paths() as paths:
        for step in range(1, 4):
            set_grads(step, [params])
            opt.step()
    stages = spec.cls.rule.stages
    if not stages or any(not isinstance(stage, PerTensor) for stage in stages):  # (elementwise stages too)
        assert "compiled" in paths
    if stages:
        assert "stage_compiled" in paths
    assert _unique_graphs() - before == GRAPHS[name]


def _compiled_adam_matches_torch(shapes, seed, steps, **opts):
    """Adam at the compiled level beside torch.optim.Adam on params of these shapes: the compiled path ran every
    step, and params and second moments are torch's."""
    g = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = fastoptim.Adam(ours, lr=0.1, impl="compiled", **opts)
    ref = torch.optim.Adam(theirs, lr=0.1, foreach=False, **opts)
    with record_paths() as paths:
        for _ in range(steps):
            same_random_grads(ours, theirs, g)
            opt.step()
            ref.step()
    assert paths == ["compiled"] * steps
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"])


def test_one_element_params_step_packed_in_the_graph_of_larger_ones(monkeypatch):
    """A 0-d param alone in its bucket (packed with a copy of itself), then params of 1 and more elements: one graph,
    and torch.optim.Adam's results."""
    monkeypatch.setattr(dispatch, "ROUTING", False)
    torch._dynamo.reset()
    shapes = [[()], [(1,), (), (6,), (1,), (1, 1)]]
    before = _unique_graphs()
    for run in shapes:
        _compiled_adam_matches_torch(run, seed=len(run), steps=3, weight_decay=0.1)
    assert _unique_graphs() - before == 1


FLAT_STAGES = [(name, i) for name, rule in sorted(RULES.items()) for i, stage in enumerate(rule.stages)
               if isinstance(stage, PerTensor) and getattr(stage, "flat", False)]


def test_some_stage_is_declared_flat():
    assert ("lamb", 1) in FLAT_STAGES


def _written(stage, args, scalars, flags):
    out = stage.fn(*args, *scalars, *flags)
    return [args[stage.reads.index(name)] for name in stage.writes] if stage.in_place else out


@pytest.mark.parametrize("name,index", FLAT_STAGES)
def test_a_stage_declared_flat_gives_on_vectors_what_it_gives_on_shaped_tensors(name, index):
    """The compiled level hands a ``flat`` stage its batch as (n, numel): the declaration must hold."""
    rule = RULES[name]
    stage = rule.stages[index]
    group = {**rule.defaults, **rule.option_sets[0]}
    scalars, flags = rule.scalars(group, 3), rule.flags(group)
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 4, 2), (5, 7), (6,)]:
        batch = [torch.randn((2, *shape), generator=g) for _ in stage.reads]
        shaped = _written(stage, [t.clone() for t in batch], scalars, flags)
        flat = _written(stage, [t.reshape(2, -1).clone() for t in batch], scalars, flags)
        for a, b in zip(shaped, flat):
            torch.testing.assert_close(a.reshape(2, -1), b, rtol=1e-6, atol=1e-7)


def test_a_param_as_long_as_the_scalars_shares_the_graph_of_others(monkeypatch):
    """The scalars tensor's length is static: were it dynamic, Dynamo would tie a param size of the same value to
    it, and unbinding the scalars would make that size static (a graph of its own for every other size)."""
    monkeypatch.setattr(dispatch, "ROUTING", False)
    torch._dynamo.reset()
    rule = OPTIMIZERS["adam"].cls.rule
    k = len(rule.scalars({**rule.defaults, "lr": 0.1}, 1))
    before = _unique_graphs()
    _compiled_adam_matches_torch([(k,), (k + 5,)], seed=0, steps=2)
    assert _unique_graphs() - before == 1
