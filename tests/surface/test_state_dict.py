"""state_dict interchange with torch.optim, and bit-identical save -> load -> continue within fastoptim."""

import io

import pytest
import torch

from conftest import CASES, assert_params_close, clone_params, make_params, set_grads, two_groups
from fastoptim.levels import LEVELS
from fastoptim.registry import OPTIMIZERS
from fastoptim.reference import reference_class, reference_kwargs


def _roundtrip(sd):
    """Through bytes, as a checkpoint on disk would go (weights_only, torch's default loader)."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _run(opt, params, steps, start=1, others=()):
    for step in range(start, start + steps):
        set_grads(step, [params, *others])
        opt.step()


TORCH_CASES = [(n, i) for n, i in CASES if OPTIMIZERS[n].reference is not None]


@pytest.mark.parametrize("name,index", TORCH_CASES)
def test_torch_checkpoint_loads_and_continues_as_torch(name, index):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    torch_p = make_params(name=name)
    torch_opt = reference_class(spec)(two_groups(torch_p, opts), **opts, **reference_kwargs(spec))
    _run(torch_opt, torch_p, 5)
    sd = _roundtrip(torch_opt.state_dict())
    ours_p = clone_params(torch_p)
    ours = spec.cls(two_groups(ours_p, opts), **opts)
    ours.load_state_dict(sd)
    _run(ours, ours_p, 6, start=6)
    _run(torch_opt, torch_p, 6, start=6)
    assert_params_close(ours_p, torch_p)


@pytest.mark.parametrize("name,index", TORCH_CASES)
def test_fastoptim_checkpoint_loads_into_torch(name, index):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    ours_p = make_params(name=name)
    ours = spec.cls(two_groups(ours_p, opts), **opts)
    _run(ours, ours_p, 5)
    sd = _roundtrip(ours.state_dict())
    for entry in sd["state"].values():  # torch's format: tensor steps, torch's names only
        assert set(entry) <= {"step", *spec.cls.rule.state_names, *spec.cls.rule.host_states}
        if spec.cls.rule.exports_step:
            assert isinstance(entry["step"], torch.Tensor) and entry["step"].dtype == torch.float32
    torch_p = clone_params(ours_p)
    torch_opt = reference_class(spec)(two_groups(torch_p, opts), **opts, **reference_kwargs(spec))
    torch_opt.load_state_dict(sd)
    _run(torch_opt, torch_p, 6, start=6)
    _run(ours, ours_p, 6, start=6)
    assert_params_close(ours_p, torch_p)


@pytest.mark.sample(("name", "index"), ("name", "load_level"), ("save_level", "load_level"))
@pytest.mark.parametrize("save_level", ["loop", "fused"])
@pytest.mark.parametrize("load_level", LEVELS)
@pytest.mark.parametrize("name,index", CASES)
def test_save_load_continue_is_bit_identical(name, index, save_level, load_level):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    straight_p = make_params(name=name)
    straight = spec.cls(two_groups(straight_p, opts), impl=save_level, **opts)
    _run(straight, straight_p, 4)
    sd = _roundtrip(straight.state_dict())
    saved_params = [p.detach().clone() for p in straight_p]
    straight.impl = load_level
    _run(straight, straight_p, 4, start=5)

    resumed_p = [torch.nn.Parameter(p) for p in saved_params]
    resumed = spec.cls(two_groups(resumed_p, opts), impl=load_level, **opts)
    resumed.load_state_dict(sd)
    _run(resumed, resumed_p, 4, start=5)
    for a, b in zip(straight_p, resumed_p):
        assert torch.equal(a, b)
    for a, b in zip(straight_p, resumed_p):
        for k, v in straight.state[a].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(resumed.state[b][k])), k


def test_loading_does_not_alias_the_callers_checkpoint():
    p = make_params()
    opt = OPTIMIZERS["adam"].cls(p, lr=1e-2)
    _run(opt, p, 2)
    sd = opt.state_dict()
    snapshot = {k: {n: v.clone() for n, v in s.items()} for k, s in sd["state"].items()}
    opt2 = OPTIMIZERS["adam"].cls(p, lr=1e-2)
    opt2.load_state_dict(sd)
    opt.load_state_dict(_roundtrip(sd))  # the first optimizer must stop writing into sd too
    _run(opt2, p, 2, start=3)
    _run(opt, p, 2, start=3)
    for k, s in snapshot.items():
        for n, v in s.items():
            assert torch.equal(sd["state"][k][n], v)


def test_sgd_state_has_no_step_and_first_step_semantics_survive_reload():
    """torch's SGD keeps only momentum_buffer; a reloaded buffer must not be re-initialised from the grad."""
    p = make_params()
    opt = OPTIMIZERS["sgd"].cls(p, lr=0.1, momentum=0.9, dampening=0.5)
    _run(opt, p, 3)
    sd = opt.state_dict()
    assert all(set(s) == {"momentum_buffer"} for s in sd["state"].values())
    q = clone_params(p)
    ref = torch.optim.SGD(q, lr=0.1, momentum=0.9, dampening=0.5, foreach=False)
    ref.load_state_dict(sd)
    opt2 = OPTIMIZERS["sgd"].cls(clone_params(p), lr=0.1, momentum=0.9, dampening=0.5)
    opt2.load_state_dict(sd)
    r = opt2.param_groups[0]["params"]
    for step in range(4, 7):
        set_grads(step, [r, q])
        opt2.step()
        ref.step()
    assert_params_close(r, q)
