"""Property-based: any mix of shapes, any option set, any lr and step count; every level agrees with the loop
level, and a state_dict round trip mid-run changes nothing."""

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CASES, assert_params_close, same_random_grads, shapes_for
from fastoptim.registry import OPTIMIZERS

shapes = st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None)
@given(shapes=shapes, case=st.sampled_from(CASES), level=st.sampled_from(["foreach", "fused"]),
       lr_scale=st.floats(0.1, 3.0), steps=st.integers(1, 4), seed=st.integers(0, 2 ** 16))
def test_levels_agree_on_random_params(shapes, case, level, lr_scale, steps, seed):
    name, index = case
    spec = OPTIMIZERS[name]
    opts = dict(spec.option_sets[index])
    opts["lr"] = opts.get("lr", 1e-3) * lr_scale
    g = torch.Generator().manual_seed(seed)
    base_p = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes_for(name, shapes)]
    other_p = [torch.nn.Parameter(p.detach().clone()) for p in base_p]
    base = spec.cls(base_p, impl="loop", **opts)
    other = spec.cls(other_p, impl=level, **opts)
    for _ in range(steps):
        same_random_grads(base_p, other_p, g)
        base.step()
        other.step()
    assert_params_close(base_p, other_p)


@settings(max_examples=15, deadline=None)
@given(shapes=shapes, case=st.sampled_from(CASES), seed=st.integers(0, 2 ** 16))
def test_state_dict_round_trip_is_invisible(shapes, case, seed):
    name, index = case
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes_for(name, shapes)]
    opt = spec.cls(params, **opts)
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(4)]
    for step_grads in grads[:2]:
        for p, gr in zip(params, step_grads):
            p.grad = gr
        opt.step()
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = spec.cls(twin_params, **opts)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for step_grads in grads[2:]:
        for p, q, gr in zip(params, twin_params, step_grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        twin.step()
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)
