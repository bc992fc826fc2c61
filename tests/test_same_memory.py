"""The C++ pass of flat mode's per-step layout checks (``same_memory``): the same answers as ``Tensor.is_set_to``,
and flat mode takes it."""

import pytest
import torch

import fastoptim
from fastoptim import same_memory
from fastoptim.levels import cpu_kernels


@pytest.fixture(params=["native", "python"])
def check(request, monkeypatch):
    """Each test once through the C++ pass and once through the Python loop it stands in for."""
    if request.param == "python":
        monkeypatch.setattr(same_memory, "_loaded", lambda: (None, "off in this test"))
    else:
        assert same_memory.unavailable() is None  # a compiler and Python's headers are here: it must build
    return request.param


def _cases():
    base = torch.zeros(64)
    views = [base[:16].view(4, 4), base[16:32].view(4, 4), base[32:48]]
    yield "the same views", views, [v.view(v.shape) for v in views]
    yield "one re-laid in place (t_)", [views[0].view(4, 4).t_(), *views[1:]], views
    yield "one at another offset", [base[1:17].view(4, 4), *views[1:]], views
    yield "one of another shape, same memory", [base[:16], *views[1:]], views
    yield "one on another storage, same values", [views[0].clone(), *views[1:]], views
    yield "a None", [None, *views[1:]], views
    yield "lists of two lengths", views[:2], views
    yield "empty lists", [], []


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_all_set_to_answers_as_is_set_to(check, case):
    _, a, b = case
    expected = len(a) == len(b) and all(x is not None and x.is_set_to(y) for x, y in zip(a, b))  # torch's own
    before = same_memory.native_calls
    assert same_memory.all_set_to(a, b) == expected
    assert same_memory.native_calls == before + (check == "native")


def test_all_set_to_reads_grads_where_asked(check):
    base = torch.zeros(32)
    params = [torch.nn.Parameter(torch.zeros(4, 4)) for _ in range(2)]
    layouts = [base[:16].view(4, 4), base[16:].view(4, 4)]
    assert not same_memory.all_set_to(params, layouts, grads=True)  # no grads yet
    for p, view in zip(params, layouts):
        p.grad = view.view(4, 4)
    assert same_memory.all_set_to(params, layouts, grads=True)
    assert not same_memory.all_set_to(params, layouts)  # the params' own data are not those views
    params[1].grad.t_()
    assert not same_memory.all_set_to(params, layouts, grads=True)
    params[1].grad = None
    assert not same_memory.all_set_to(params, layouts, grads=True)


def test_flat_steps_check_their_views_in_one_cpp_pass_and_see_a_replaced_param(check):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    opt = fastoptim.AdamW(model.parameters(), lr=0.1, flat=True)
    ref_model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    ref_model.load_state_dict(model.state_dict())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for step in range(4):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
        if step == 2:  # between steps: a weight replaced, another re-laid in place, a grad replaced
            new = torch.randn(8, 8)
            model[0].weight.data, ref_model[0].weight.data = new.clone(), new.clone()
            with torch.no_grad():
                model[1].weight.t_(), ref_model[1].weight.t_()
            g = torch.randn(8)
            model[2].bias.grad, ref_model[2].bias.grad = g.clone(), g.clone()
        before = same_memory.native_calls
        opt.step()
        ref.step()
        assert (same_memory.native_calls > before) == (check == "native")
        for a, b in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_without_a_compiler_the_python_loop_answers(monkeypatch):
    same_memory._loaded.cache_clear()
    monkeypatch.setattr(cpu_kernels, "compiler", lambda: None)
    try:
        assert "no C++ compiler" in same_memory.unavailable()
        base = torch.zeros(8)
        before = same_memory.native_calls
        assert same_memory.all_set_to([base[:4]], [base[:4]])
        assert not same_memory.all_set_to([base[:4]], [base[4:]])
        assert same_memory.native_calls == before
    finally:
        same_memory._loaded.cache_clear()  # found out again (built, here) by the next caller


def test_a_tensor_of_another_layout_kind_reads_as_not_set_to(check):
    """A sparse or meta tensor put where a view was: False (the caller then repairs through the slow path)."""
    base = torch.zeros(16)
    view = base.view(4, 4)
    for other in (torch.eye(4).to_sparse(), torch.empty(4, 4, device="meta")):
        assert not same_memory.all_set_to([other], [view])
        assert not same_memory.all_set_to([view], [other])
