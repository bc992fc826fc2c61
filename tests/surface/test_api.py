"""The torch.optim surface users rely on: groups, zero_grad, closure, hooks, create(), torch's flags."""

import pytest
import torch

import fastoptim
from conftest import assert_params_close, make_params, set_grads
from fastoptim.registry import OPTIMIZERS


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_is_a_torch_optimizer_with_torch_defaults(name):
    spec = OPTIMIZERS[name]
    opt = spec.cls(make_params(name=name))
    assert isinstance(opt, torch.optim.Optimizer)
    if spec.reference is not None:
        ref = getattr(torch.optim, spec.reference)(make_params(name=name))
        for k, v in opt.defaults.items():
            assert ref.defaults[k] == v, k


def test_closure_is_called_with_grad_enabled_and_loss_returned():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = fastoptim.SGD([w], lr=0.1)

    def closure():
        opt.zero_grad()
        assert torch.is_grad_enabled()
        loss = (w ** 2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == 5.0
    torch.testing.assert_close(w.detach(), torch.tensor([0.8, 1.6]))


def test_step_hooks_run_in_order():
    params = make_params()
    opt = fastoptim.Adam(params)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o.state[params[0]].get("step", 0))))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o.state[params[0]]["step"])))
    set_grads(1, [params])
    opt.step()
    assert calls == [("pre", 0), ("post", 1)]


def test_zero_grad():
    params = make_params()
    opt = fastoptim.AdamW(params)
    set_grads(1, [params], none_every=100)
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_params_without_grad_are_skipped_and_keep_no_state():
    params = make_params()
    opt = fastoptim.Adam(params, lr=0.1)
    before = params[2].detach().clone()
    set_grads(1, [params], none_every=100)
    params[2].grad = None
    opt.step()
    assert torch.equal(params[2].detach(), before)
    assert params[2] not in opt.state


def test_add_param_group_fills_defaults_and_steps_it():
    params = make_params()
    opt = fastoptim.RMSprop(params[:3], lr=0.01, momentum=0.9)
    opt.add_param_group({"params": params[3:], "lr": 0.5})
    assert opt.param_groups[1]["momentum"] == 0.9 and opt.param_groups[1]["lr"] == 0.5
    set_grads(1, [params])
    opt.step()
    assert all(p in opt.state for p in params[3:] if p.grad is not None)


def test_create_splits_no_decay_params():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = fastoptim.create(model, "AdamW", lr=3e-4, weight_decay=0.1, impl="loop")
    assert isinstance(opt, fastoptim.AdamW) and opt.impl == "loop"
    decay, no_decay = opt.param_groups
    assert {p.dim() for p in decay["params"]} == {2} and decay["weight_decay"] == 0.1
    assert {p.dim() for p in no_decay["params"]} == {1} and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    # the decayed group keeps the optimizer's own default when none is given
    assert fastoptim.create(model, "adamw").param_groups[0]["weight_decay"] == 1e-2
    # a plain iterable passes through as torch would take it
    assert len(fastoptim.create(model.parameters(), "sgd", lr=0.1).param_groups) == 1


def test_torch_spellings_foreach_and_fused():
    assert fastoptim.Adam(make_params(), foreach=True).impl == "foreach"
    with pytest.raises(ValueError, match="cannot both"):
        fastoptim.Adam(make_params(), foreach=True, fused=True)


@pytest.mark.parametrize("impl", fastoptim.IMPLS)
def test_every_impl_value_runs(impl):
    params = make_params()
    opt = fastoptim.Adam(params, impl=impl)
    set_grads(1, [params])
    opt.step()
    assert params[0] in opt.state


def test_trains_a_real_model():
    """A small regression task: every optimizer brings the loss down (catches sign and scale errors)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(256, 1, generator=g)
    for name, lr in [("sgd", 0.05), ("adam", 0.01), ("adamw", 0.01), ("rmsprop", 0.003), ("adagrad", 0.1),
                     ("lion", 0.01), ("adamax", 0.01), ("adadelta", 1.0), ("radam", 0.01), ("nadam", 0.01), ("asgd", 0.05),
                     ("rprop", 0.001)]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = fastoptim.create(model, name, lr=lr)
        first = None
        for _ in range(150):
            loss = torch.nn.functional.mse_loss(model(x), y)
            first = loss.item() if first is None else first
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert loss.item() < 0.5 * first, name


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_optimizer_copies_and_pickles_with_its_settings(how, flat):
    import copy
    import io
    params = make_params()
    opt = fastoptim.AdamW(params, impl="foreach", flat=flat, max_grad_norm=0.5, lr=1e-2)
    set_grads(1, [params], none_every=10 ** 9)
    opt.step()
    if how == "deepcopy":
        twin = copy.deepcopy(opt)
    else:
        buf = io.BytesIO()
        torch.save(opt, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert (twin.impl, twin.flat, twin.max_grad_norm) == ("foreach", flat, 0.5)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    for step in range(2, 4):
        set_grads(step, [params, twin_params], none_every=10 ** 9)
        opt.step()
        twin.step()
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)


def test_a_changed_param_list_is_noticed_between_steps():
    """The step reuses last step's bucket only while the params with grads are the same ones."""
    params = make_params()
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = fastoptim.Adam(params, lr=1e-2, impl="fused")
    ref = torch.optim.Adam(ref_p, lr=1e-2, foreach=False)
    for step in range(1, 9):
        set_grads(step, [params, ref_p], none_every=3)  # param 1 drops out every third step
        ours.step()
        ref.step()
    ours.param_groups[0]["params"][3] = params[3] = torch.nn.Parameter(params[3].detach().clone())
    ref.param_groups[0]["params"][3] = ref_p[3] = torch.nn.Parameter(ref_p[3].detach().clone())
    for step in range(9, 12):
        set_grads(step, [params, ref_p], none_every=10 ** 9)
        ours.step()
        ref.step()
    assert_params_close(params, ref_p)
