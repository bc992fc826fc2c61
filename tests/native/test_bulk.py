"""The C++ pass of flat mode's per-step layout checks (``bulk``): the same answers as ``Tensor.is_set_to``,
and flat mode takes it."""

import os
import sysconfig

import pytest
import torch

import fastoptim
from fastoptim import native
from fastoptim.levels import record_paths
from fastoptim.native import bulk


@pytest.fixture(params=["native", "python"])
def check(request, monkeypatch):
    """Each test once through the C++ pass and once through the Python loop it stands in for."""
    if request.param == "python":
        monkeypatch.setattr(bulk, "_loaded", lambda: (None, "off in this test"))
    elif native.compiler() is None or not os.path.exists(os.path.join(sysconfig.get_paths()["include"],
                                                                            "Python.h")):
        pytest.skip("no C++ compiler or no Python headers: the C++ pass cannot be built on this machine")
    else:
        assert bulk.unavailable() is None  # a compiler and Python's headers are here: it must build
    return request.param


def _views(base):
    return [base[:16].view(4, 4), base[16:32].view(4, 4), base[32:48]]


def _cases():
    """(name, a, b, whether a is set to b): ``is_set_to``'s own answer, except where noted."""
    base = torch.zeros(64)
    views = _views(base)
    yield "the same views", views, [v.view(v.shape) for v in views], True
    yield "tuples", tuple(views), tuple(v.view(v.shape) for v in views), True
    yield "one re-laid in place (t_)", [views[0].view(4, 4).t_(), *views[1:]], views, False
    yield "one at another offset", [base[1:17].view(4, 4), *views[1:]], views, False
    yield "one of another shape, same memory", [base[:16], *views[1:]], views, False
    yield "one of other sizes, same strides", [base[:8].view(2, 4), *views[1:]], views, False
    yield "one with a dim more, same first size", [*views[:2], base[32:48].view(16, 1)], views, False
    yield "one on another storage, same values", [views[0].clone(), *views[1:]], views, False
    yield "a None", [None, *views[1:]], views, False
    yield "lists of two lengths", views[:2], views, False
    yield "empty lists", [], [], True
    many = [base[i:i + 1] for i in range(40)]
    yield "40 views", many, [v.view(1) for v in many], True
    yield "40 views, the 37th at another offset", many[:36] + [base[37:38]] + many[37:], many, False
    # not is_set_to's answers: the same memory read as another dtype (is_set_to: True) is another tensor
    yield "one re-typed (view(int32))", [views[0].view(torch.int32), *views[1:]], views, False
    # is_set_to materializes these (a copy: False); read as they lie they would seem the same
    yield "a lazily negated view", [torch._neg_view(views[0]), *views[1:]], [torch._neg_view(views[0])] + views[1:], \
        False
    c = torch.zeros(8, dtype=torch.complex64)
    yield "a lazily conjugated view", [c.conj()], [c.conj()], False


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_all_set_to_answers_as_is_set_to(check, case):
    _, a, b, expected = case
    if expected or "re-typed" not in case[0]:  # torch's own answer agrees (the dtype check is ours)
        assert expected == (len(a) == len(b) and all(x is not None and x.is_set_to(y) for x, y in zip(a, b)))
    before = bulk.native_calls
    assert bulk.all_set_to(a, b) == expected
    assert bulk.native_calls == before + (check == "native")


def test_all_set_to_reads_grads_where_asked(check):
    base = torch.zeros(32)
    params = [torch.nn.Parameter(torch.zeros(4, 4)) for _ in range(2)]
    layouts = [base[:16].view(4, 4), base[16:].view(4, 4)]
    assert not bulk.all_set_to(params, layouts, grads=True)  # no grads yet
    for p, view in zip(params, layouts):
        p.grad = view.view(4, 4)
    assert bulk.all_set_to(params, layouts, grads=True)
    assert not bulk.all_set_to(params, layouts)  # the params' own data are not those views
    params[1].grad.t_()
    assert not bulk.all_set_to(params, layouts, grads=True)
    params[1].grad = None
    assert not bulk.all_set_to(params, layouts, grads=True)
    assert not bulk.all_set_to([object(), *params[1:]], layouts, grads=True)  # no tensor: no grad


def test_all_set_to_reads_every_grad_of_a_long_list(check):
    base = torch.zeros(40)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(40)]
    layouts = [base[i:i + 1] for i in range(40)]
    for p, view in zip(params, layouts):
        p.grad = view.view(1)
    assert bulk.all_set_to(params, layouts, grads=True)
    params[37].grad = base[38:39]
    assert not bulk.all_set_to(params, layouts, grads=True)


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
        before = bulk.native_calls
        opt.step()
        ref.step()
        assert (bulk.native_calls > before) == (check == "native")
        for a, b in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_without_a_compiler_the_python_loop_answers(monkeypatch):
    bulk._loaded.cache_clear()
    monkeypatch.setattr(native, "compiler", lambda: None)
    try:
        assert "no C++ compiler" in bulk.unavailable()
        base = torch.zeros(8)
        before = bulk.native_calls
        assert bulk.all_set_to([base[:4]], [base[:4]])
        assert not bulk.all_set_to([base[:4]], [base[4:]])
        assert bulk.native_calls == before
    finally:
        bulk._loaded.cache_clear()  # found out again (built, here) by the next caller


def test_a_tensor_of_another_layout_kind_reads_as_not_set_to(check):
    """A sparse or meta tensor put where a view was: False (the caller then repairs through the slow path); one
    whose values are not read from its memory as it lies is not set to itself either (a meta tensor, a zero
    tensor, a fake tensor)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    base = torch.zeros(16)
    view = base.view(4, 4)
    for other in (torch.eye(4).to_sparse(), torch.eye(4).to_sparse_csr(), torch.empty(4, 4, device="meta")):
        assert not bulk.all_set_to([other], [view])
        assert not bulk.all_set_to([view], [other])
    meta = torch.empty(16, device="meta")
    zero = torch._efficientzerotensor(16)
    with FakeTensorMode():
        fake = torch.empty(16)
    mine = torch.Tensor._make_subclass(_Dispatching, base)  # real memory, but its ops are its own
    for t in (meta, zero, fake, mine):
        assert not bulk.all_set_to([t], [t])


class _Dispatching(torch.Tensor):
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
            return func(*args, **(kwargs or {}))


def test_flat_refuses_a_param_re_typed_in_place_on_its_own_memory(check):
    """``p.data = p.data.view(float16)`` on a bf16 buffer lies on the same memory the same way, but is not the
    view the buffer steps: a clear error, and the param as it was (not bf16 math read as fp16)."""
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    opt = fastoptim.AdamW(model.parameters(), lr=0.1, flat=True)
    model(torch.randn(2, 64, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    model.weight.data = model.weight.data.view(torch.float16)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match="dtype torch.float16"):
        opt.step()
    assert torch.equal(model.weight, before)


def test_bump_versions_counts_a_write_to_each_tensor(check):
    base = torch.zeros(40)
    tensors = [base[i:i + 1] for i in range(0, 40, 2)] + [torch.nn.Parameter(torch.zeros(3)) for _ in range(20)]
    versions = [t._version for t in tensors]
    before = bulk.native_calls
    bulk.bump_versions(tensors)
    bulk.bump_versions(t for t in tensors[:3])  # any iterable, as torch's increment_version takes
    # the 20 views of base share one counter (a bump of one is a bump of all): 20 + 3 bumps; each param: one
    assert [t._version for t in tensors] == [v + (23 if i < 20 else 1) for i, v in enumerate(versions)]
    assert bulk.native_calls == before + 2 * (check == "native")
    with torch.inference_mode():
        frozen = torch.zeros(3)
    bulk.bump_versions([frozen])  # an inference tensor has no counter: left alone, as torch does
    with pytest.raises((TypeError, RuntimeError), match="tensor"):
        bulk.bump_versions([torch.zeros(1), "not a tensor"])


def test_a_step_bumped_in_bulk_refuses_a_stale_backward(check):
    """A flat step writes the buffer, not the params the graph saw: autograd must still see each param changed."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)])
    opt = fastoptim.SGD(model.parameters(), lr=0.1, flat=True)
    model(torch.randn(2, 4)).sum().backward()
    loss = model(torch.randn(2, 4)).sum()  # its graph saved the weights as they are now
    before = bulk.native_calls
    opt.step()
    assert bulk.native_calls > before if check == "native" else bulk.native_calls == before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_set_each_sets_a_key_in_every_dict_past_their_own_setitem(check):
    class Watched(dict):
        def __setitem__(self, key, value):
            raise AssertionError("a subclass's own __setitem__ must not be called")

    dicts = [{"a": 1} for _ in range(30)] + [Watched()]
    value = object()
    before = bulk.native_calls
    bulk.set_each(dicts, "step", value)
    assert all(dict.__getitem__(d, "step") is value for d in dicts) and dicts[0]["a"] == 1
    assert bulk.native_calls == before + (check == "native")
    with pytest.raises(TypeError):
        bulk.set_each([{}, {}], ["unhashable"], 1)
    with pytest.raises(TypeError):
        bulk.set_each([{}, "not a dict"], "k", 1)


def test_with_grads_gives_the_params_with_grads_and_their_very_grads(check):
    params = [torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(40)] + [torch.zeros(3, requires_grad=True)]
    for i, p in enumerate(params):
        if i % 3:
            p.grad = torch.ones_like(p)
    before = bulk.native_calls
    having, grads, plain, dense = bulk.with_grads(params)
    assert bulk.native_calls == before + (check == "native")
    assert [id(p) for p in having] == [id(p) for i, p in enumerate(params) if i % 3]
    assert all(g is p.grad for p, g in zip(having, grads)) and plain and dense
    params[2].grad = torch.ones(2, 2).t()  # strided and of the param's dtype, not contiguous: plain, not dense
    assert bulk.with_grads(params)[2:] == (True, False)
    params[2].grad = torch.ones(2, 2)
    assert bulk.with_grads(params)[2:] == (True, True)
    params[1].grad_dtype = None  # torch then takes a grad of another dtype: the caller looks at each
    params[1].grad = torch.ones(2, 2, dtype=torch.float64)
    assert bulk.with_grads(params)[2:] == (False, False)
    params[1].grad = torch.eye(2).to_sparse()
    assert bulk.with_grads(params)[2:] == (False, False)
    assert bulk.with_grads([]) == ([], [], True, True)


def test_with_grads_leaves_a_subclass_param_to_python():
    class Mine(torch.nn.Parameter):
        pass

    p = Mine(torch.zeros(2))
    p.grad = torch.ones(2)
    having, grads, plain, _ = bulk.with_grads([torch.nn.Parameter(torch.zeros(1)), p])
    assert having == [p] and grads[0] is p.grad and plain


def test_layouts_change_with_where_and_how_each_tensor_lies(check):
    params = [torch.nn.Parameter(torch.zeros(4, 6)) for _ in range(40)]
    before = bulk.layouts(params)
    assert bulk.layouts(params) == before
    buffer = torch.zeros(2 * 24)
    changes = {
        "data replaced": lambda p: setattr(p, "data", torch.zeros(4, 6)),
        "another place on the same storage": lambda p: setattr(p, "data", buffer[24:].view(4, 6)),
        "other sizes, the same strides": lambda p: setattr(p, "data", p.data[:3]),
        "other strides, the same sizes": lambda p: setattr(p, "data", p.data.as_strided((4, 6), (1, 4))),
        "re-laid in place": _relay,
        "a view of another shape, same address": lambda p: setattr(p, "data", p.data.view(6, 4)),
        "moved to shared memory": lambda p: p.share_memory_(),
    }
    for name, change in changes.items():
        fresh = [torch.nn.Parameter(torch.zeros(4, 6)) for _ in range(40)]
        fresh[37].data = buffer[:24].view(4, 6)
        seen = bulk.layouts(fresh)
        change(fresh[37])
        assert bulk.layouts(fresh) != seen, name
    addresses = bulk.layouts(params, shapes=False)
    _relay(params[37])  # the same address: the addresses alone do not see it
    assert bulk.layouts(params, shapes=False) == addresses and bulk.layouts(params) != before


def _relay(p):
    with torch.no_grad():
        p.t_()


def test_kinds_change_with_a_tensors_dtype_contiguity_or_shape(check):
    """What the kernels' tables are checked against each step: a grad of another dtype, a non-contiguous one, or
    one of another shape must read as a change (else a kernel would read it as the contiguous fp32 grad of the
    param's shape it was built for)."""
    grads = [torch.zeros(4, 6) for _ in range(40)]
    before = bulk.kinds(grads)
    assert bulk.kinds([g.clone() for g in grads]) == before  # new tensors, the same kinds
    changes = {
        "another dtype": lambda g: g.double(),
        "transposed": lambda g: g.t(),
        "a strided slice": lambda g: g[:, ::2],
        "bf16": lambda g: g.bfloat16(),
        "another shape, the same size": lambda g: g.view(6, 4),
        "a dim more": lambda g: g.view(4, 6, 1),
        "half of it": lambda g: g[:2],
    }
    for name, change in changes.items():
        fresh = list(grads)
        fresh[37] = change(fresh[37])
        assert bulk.kinds(fresh) != before, name
    assert bulk.kinds([grads[0].t().contiguous()]) == bulk.kinds([torch.zeros(6, 4)])  # where it lies: not a kind
    assert bulk.kinds([torch.zeros(3, 6)[:, :3]]) != bulk.kinds([torch.zeros(3, 3)])  # strided: not contiguous
    assert bulk.kinds([torch.zeros(1, 6)[:, :3]]) == bulk.kinds([torch.zeros(1, 3)])  # contiguous as torch says


@pytest.mark.parametrize("state_bits, flat, expected", [
    (8, False, {"with_grads": 1, "layouts": 1, "set_each": 1, "bump_versions": 1}),
    (32, False, {"with_grads": 1, "layouts": 1, "set_each": 1, "bump_versions": 1}),
    (8, True, {"with_grads": 1, "all_set_to": 2, "layouts": 1, "set_each": 1, "bump_versions": 1}),
])
def test_a_steady_step_runs_few_bookkeeping_passes(monkeypatch, state_bits, flat, expected):
    """Each C++ pass walks every tensor; a steady step (its plan reused) runs each at most once: the params with
    grads (``with_grads``, which also says the grads are dense, so the CPU kernel looks at none of them), the
    plan's check that params and stored states lie where they did (``layouts``), the step counts (``set_each``, one
    for the buckets at one count) and the in-place write counted once (``bump_versions``); flat mode checks its
    param and grad views instead of the params' layouts."""
    if native.compiler() is None:
        pytest.skip("no C++ compiler: the C++ passes cannot be built on this machine")
    assert bulk.unavailable() is None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 32), torch.nn.Linear(32, 64), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 32))
    opt = fastoptim.AdamW(model.parameters(), lr=1e-3, state_bits=state_bits, min_quant_size=1024, flat=flat)

    def step():
        model(torch.randint(0, 300, (8,))).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    calls = {}
    real = bulk._native

    def counting(name):
        calls[name] = calls.get(name, 0) + 1
        return real(name)

    monkeypatch.setattr(bulk, "_native", counting)
    with record_paths() as paths:
        step()
    assert calls == expected
    assert ("cpu_kernel" in paths) == (state_bits == 8), paths  # (the stored states stepped in the kernel)
