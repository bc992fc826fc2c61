"""Bad input: a clear error naming the problem, and the optimizer and the tensors exactly as they were."""

import copy

import pytest
import torch

import fastoptim
from conftest import make_params, set_grads
from fastoptim.levels import LEVELS
from fastoptim.registry import OPTIMIZERS


def snapshot(opt):
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    state = {id(p): copy.deepcopy(s) for p, s in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return params, state, groups


def assert_unchanged(opt, snap):
    params, state, groups = snap
    now = [p for g in opt.param_groups for p in g["params"]]
    assert len(now) == len(params)
    for a, b in zip(now, params):
        assert torch.equal(a.detach(), b)
    assert set(state) == {id(p) for p in opt.state}
    for p, s in opt.state.items():
        assert s.keys() == state[id(p)].keys()
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state[id(p)][k])), k
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


BAD_ARGS = [
    ("sgd", dict(lr=-0.1), "lr"),
    ("sgd", dict(momentum=-0.5), "momentum"),
    ("sgd", dict(weight_decay=-1e-2), "weight_decay"),
    ("sgd", dict(nesterov=True), "nesterov"),
    ("sgd", dict(nesterov=True, momentum=0.9, dampening=0.1), "nesterov"),
    ("adam", dict(lr=-1e-3), "lr"),
    ("adam", dict(eps=-1e-8), "eps"),
    ("adam", dict(weight_decay=-0.1), "weight_decay"),
    ("adam", dict(betas=(1.0, 0.999)), "beta1"),
    ("adam", dict(betas=(0.9, -0.1)), "beta2"),
    ("adam", dict(betas=(0.9,)), "betas"),
    ("adamw", dict(betas=(0.9, 1.5)), "beta2"),
    ("adamw", dict(lr=float("nan")), "lr"),
    ("rmsprop", dict(alpha=1.0), "alpha"),
    ("rmsprop", dict(alpha=-0.01), "alpha"),
    ("rmsprop", dict(eps=-1.0), "eps"),
    ("adagrad", dict(lr_decay=-0.1), "lr_decay"),
    ("adagrad", dict(initial_accumulator_value=-1.0), "initial_accumulator_value"),
    ("lion", dict(betas=(0.9, 1.0)), "beta2"),
    ("adamax", dict(betas=(0.9, 1.0)), "beta2"),
    ("adamax", dict(eps=-1.0), "eps"),
    ("adadelta", dict(rho=1.5), "rho"),
    ("adadelta", dict(weight_decay=-0.1), "weight_decay"),
    ("radam", dict(betas=(-0.1, 0.999)), "beta1"),
    ("radam", dict(decoupled_weight_decay=1), "decoupled_weight_decay"),
    ("nadam", dict(momentum_decay=-0.1), "momentum_decay"),
    ("nadam", dict(betas=(0.9, 1.0)), "beta2"),
    ("asgd", dict(weight_decay=-0.1), "weight_decay"),
    ("asgd", dict(t0="later"), "t0"),
    ("rprop", dict(etas=(1.0, 0.5)), "etas"),
    ("rprop", dict(etas=(0.5, 1.2, 2.0)), "etas"),
    ("rprop", dict(step_sizes="small"), "step_sizes"),
    ("lion", dict(lr="fast"), "lr"),
]


@pytest.mark.parametrize("name,kwargs,word", BAD_ARGS)
def test_bad_hyperparameter_is_named(name, kwargs, word):
    with pytest.raises((ValueError, TypeError), match=word):
        OPTIMIZERS[name].cls(make_params(name=name), **kwargs)


@pytest.mark.parametrize("name,kwargs,word", BAD_ARGS)
def test_bad_group_added_or_edited_leaves_everything_as_it_was(name, kwargs, word):
    spec = OPTIMIZERS[name]
    params = make_params(name=name)
    opt = spec.cls(params[:4], **spec.option_sets[0])
    set_grads(1, [params])
    opt.step()
    snap = snapshot(opt)
    with pytest.raises((ValueError, TypeError), match=word):
        opt.add_param_group({"params": params[4:], **kwargs})
    assert_unchanged(opt, snap)
    # the same bad value set on a live group (as a careless scheduler might): step refuses, touches nothing
    opt.param_groups[0].update(kwargs)
    snap = snapshot(opt)
    with pytest.raises((ValueError, TypeError), match=word):
        opt.step()
    assert_unchanged(opt, snap)


def test_unknown_argument_is_named():
    with pytest.raises(TypeError, match="'beta'"):
        fastoptim.AdamW(make_params(), beta=(0.9, 0.9))


@pytest.mark.sample("name", "level")
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sparse_grad_refused_before_anything_changes(name, level):
    spec = OPTIMIZERS[name]
    params = make_params(name=name)
    opt = spec.cls(params, impl=level, **spec.option_sets[1])
    set_grads(1, [params])
    opt.step()
    set_grads(2, [params], none_every=100)
    params[4].grad = params[4].grad.to_sparse()  # a later param: the earlier ones must not have moved
    snap = snapshot(opt)
    with pytest.raises(RuntimeError, match=r"sparse gradients \(param 4"):
        opt.step()
    assert_unchanged(opt, snap)


def test_unknown_impl_lists_valid_values():
    with pytest.raises(ValueError) as err:
        fastoptim.Adam(make_params(), impl="cuda-graph")
    for valid in fastoptim.IMPLS:
        assert repr(valid) in str(err.value)


def test_unknown_optimizer_name_lists_valid_names():
    with pytest.raises(ValueError) as err:
        fastoptim.create(make_params(), "adamq")
    for valid in OPTIMIZERS:
        assert valid in str(err.value)


def _trained(name="adam"):
    spec = OPTIMIZERS[name]
    params = make_params(name=name)
    opt = spec.cls([{"params": params[:3]}, {"params": params[3:]}], **spec.option_sets[1])
    set_grads(1, [params])
    opt.step()
    return opt, params


@pytest.mark.parametrize("mutate,word", [
    (lambda sd: sd["param_groups"].pop(), "parameter groups"),
    (lambda sd: sd["param_groups"][1]["params"].pop(), "group 1 has"),
    (lambda sd: sd["state"][4].__setitem__("exp_avg", torch.zeros(5, 5)), "param 4 has shape"),
    (lambda sd: sd["state"].__setitem__(99, {"exp_avg": torch.zeros(1)}), "param 99"),
    (lambda sd: sd["param_groups"][0].__setitem__("lr", -1.0), "Invalid lr"),
    (lambda sd: sd.pop("state"), "'state'"),
])
def test_mismatched_state_dict_is_refused_untouched(mutate, word):
    opt, _ = _trained()
    sd = copy.deepcopy(opt.state_dict())
    mutate(sd)
    snap = snapshot(opt)
    with pytest.raises(ValueError, match=word):
        opt.load_state_dict(sd)
    assert_unchanged(opt, snap)
