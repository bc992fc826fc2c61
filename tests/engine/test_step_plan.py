"""The step plan (``fastoptim.plan``): reused while nothing changed, rebuilt the moment anything it caches
changes, and never the cause of a number torch.optim would not give."""

from collections import defaultdict

import pytest
import torch

import fastoptim
from conftest import FLAT, assert_params_close, assert_state_close, clone_params, shapes_for
from fastoptim import storage
from fastoptim.engine import buckets
from fastoptim.engine.state_map import StateMap
from fastoptim.levels import LEVELS, record_paths
from fastoptim.registry import OPTIMIZERS
from fastoptim.reference import reference_class, reference_kwargs


def _pair(name, level, flat=False, option=1, shapes=((5, 4), (7,), (3, 2))):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[option]
    g = torch.Generator().manual_seed(0)
    ours_p = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes_for(name, shapes)]
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl=level, flat=flat, **opts)
    ref = reference_class(spec)(ref_p, **opts, **reference_kwargs(spec))
    return spec, ours, ours_p, ref, ref_p, g


def _grads(g, *param_lists):
    for ps in zip(*param_lists):
        grad = torch.randn(ps[0].shape, generator=g, dtype=ps[0].dtype)
        for p in ps:
            p.grad = grad.clone()


def _init_like_torch(spec, ref):
    """torch's Adagrad makes its state only in __init__: after a reset its state is made by hand."""
    if spec.cls.rule.eager_state:
        for group in ref.param_groups:
            for p in group["params"]:
                ref.state[p] = {"step": torch.tensor(0.0), "sum": torch.full_like(p, group["initial_accumulator_value"])}


# (a step count to rewind only where torch keeps one)
ACTIONS = [(name, action) for name, spec in OPTIMIZERS.items()
           for action in ["clear", "replace_mapping", "replace_tensor", "rewind_step"]
           if action != "rewind_step" or spec.cls.rule.exports_step]


@pytest.mark.sample("name", ("action", "level"), ("flat", "level"))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name,action,flat", [(n, a, f) for n, a in ACTIONS for f in (False, True) if not f or n in FLAT])
def test_state_reset_or_replaced_between_steps_is_what_steps(name, action, level, flat):
    """Users reset an optimizer between phases (``state.clear()``, ``state = defaultdict(dict)``) or swap one
    state tensor; the next steps must use what the state now holds, and state_dict() must show it."""
    spec, ours, ours_p, ref, ref_p, g = _pair(name, level, flat)
    for step in range(1, 5):
        _grads(g, ours_p, ref_p)
        ours.step()
        ref.step()
        if step == 2:
            if action == "clear":
                ours.state.clear()
                ref.state.clear()
                _init_like_torch(spec, ref)
            elif action == "replace_mapping":
                ours.state = defaultdict(dict)
                ref.state = defaultdict(dict)
                _init_like_torch(spec, ref)
            elif action == "replace_tensor":
                name0 = spec.cls.rule.state_names[0]  # (Adafactor's row factor: its own shape)
                value = torch.rand(spec.cls.rule.state_shape(name0, ours_p[0]), generator=g)
                ours.state[ours_p[0]][name0] = value.clone()
                ref.state[ref_p[0]][name0] = value.clone()
            else:
                ours.state[ours_p[0]]["step"] = 0
                ref.state[ref_p[0]]["step"] = torch.tensor(0.0)
        assert_params_close(ours_p, ref_p)
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert set(ours_sd["state"]) == set(ref_sd["state"])
    for index, entry in ref_sd["state"].items():
        assert set(ours_sd["state"][index]) == set(entry)
        for k, v in entry.items():
            if k == "step":
                assert float(ours_sd["state"][index][k]) == float(v)
            else:
                assert_state_close(ours_sd["state"][index][k], v, msg=k)


def test_plan_is_reused_while_nothing_changes(monkeypatch):
    """The fast path: an unchanged step builds nothing; any change to the state rebuilds."""
    builds = []
    real_build = buckets.build
    monkeypatch.setattr(buckets, "build", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    spec, ours, ours_p, ref, ref_p, g = _pair("adamw", "foreach")
    for _ in range(4):
        _grads(g, ours_p, ref_p)
        ours.step()
        ref.step()
    assert len(builds) == 1
    first = ours._stepper.plans[0]
    ours.state[ours_p[1]]["exp_avg_sq"] = ours.state[ours_p[1]]["exp_avg_sq"].clone()  # same values, new tensor
    ref.state[ref_p[1]]["exp_avg_sq"] = ref.state[ref_p[1]]["exp_avg_sq"].clone()
    _grads(g, ours_p, ref_p)
    ours.step()
    ref.step()
    assert len(builds) == 2 and ours._stepper.plans[0] is not first
    assert ours._stepper.plans[0].buckets[0].states[1][1] is ours.state[ours_p[1]]["exp_avg_sq"]
    assert_params_close(ours_p, ref_p)


@pytest.mark.parametrize("mutate", ["pop", "setdefault", "update", "del", "ior", "popitem", "map_pop",
                                    "map_setitem", "map_update", "map_del"])
def test_every_way_of_changing_state_is_seen(mutate):
    opt = fastoptim.Adam([torch.nn.Parameter(torch.randn(3))], lr=0.1)
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.ones(3)
    opt.step()
    state_map, version = opt.state, opt.state.version
    s = state_map[p]
    {"pop": lambda: s.pop("exp_avg"), "setdefault": lambda: s.setdefault("extra", 1),
     "update": lambda: s.update(exp_avg=torch.zeros(3)), "del": lambda: s.__delitem__("exp_avg"),
     "ior": lambda: s.__ior__({"exp_avg": torch.zeros(3)}), "popitem": lambda: s.popitem(),
     "map_pop": lambda: state_map.pop(p), "map_setitem": lambda: state_map.__setitem__(p, {}),
     "map_update": lambda: state_map.update({p: {}}), "map_del": lambda: state_map.__delitem__(p)}[mutate]()
    assert state_map.version > version


def test_state_pickles_as_torchs_plain_types():
    opt = fastoptim.AdamW([torch.nn.Parameter(torch.randn(3))])
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.step()
    import io
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # plain dicts and tensors only
    assert type(loaded["state"][0]) is dict
    copied = __import__("copy").deepcopy(opt)
    assert isinstance(copied.state, StateMap) and len(copied.state) == 1


@pytest.mark.parametrize("level", LEVELS)
def test_a_bad_replaced_state_tensor_is_named_and_changes_nothing(level):
    spec, ours, ours_p, _, _, g = _pair("adam", level)
    _grads(g, ours_p)
    ours.step()
    ours.state[ours_p[2]]["exp_avg"] = torch.zeros(4)  # the wrong shape
    before = [p.detach().clone() for p in ours_p]
    steps = [ours.state[p]["step"] for p in ours_p]
    _grads(g, ours_p)
    with pytest.raises(ValueError, match=r"state 'exp_avg' of param 2 has shape \(4,\)"):
        ours.step()
    assert all(torch.equal(a, b) for a, b in zip(ours_p, before))
    assert [ours.state[p]["step"] for p in ours_p] == steps


@pytest.mark.parametrize("level", LEVELS)
def test_a_param_that_misses_a_step_keeps_the_plan_and_its_caches(level):
    """A param without a grad for one step falls a count behind: two buckets from then on. The plan holds
    both, each with its own cache, and is reused step after step."""
    spec, ours, ours_p, ref, ref_p, g = _pair("adamw", level)
    _grads(g, ours_p, ref_p)
    ours.step()
    ref.step()
    _grads(g, ours_p[:2], ref_p[:2])
    ours_p[2].grad = ref_p[2].grad = None
    ours.step()
    ref.step()
    plans = []
    for _ in range(3):
        _grads(g, ours_p, ref_p)
        ours.step()
        ref.step()
        plans.append(ours._stepper.plans[0])
        assert_params_close(ours_p, ref_p)
    assert plans[1] is plans[0] and plans[2] is plans[0]
    assert sorted(b.step for b in plans[0].buckets) == [4, 5]


def test_a_param_that_misses_a_step_keeps_its_kernel_tables(monkeypatch):
    """On the Triton kernel (interpreted): the two buckets' tensor tables are built once, not every step."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from fastoptim.paths.triton import kernels as tk
    spec, ours, ours_p, ref, ref_p, g = _pair("adamw", "fused")
    _grads(g, ours_p, ref_p)
    ours.step()
    ref.step()
    _grads(g, ours_p[:2], ref_p[:2])
    ours_p[2].grad = ref_p[2].grad = None
    ours.step()
    ref.step()
    builds = []
    real_update = tk.TensorTable.update

    def counted(self, columns):
        key = self.key
        real_update(self, columns)
        builds.append(self.key is not key)
    monkeypatch.setattr(tk.TensorTable, "update", counted)
    grads = [torch.randn(p.shape, generator=g) for p in ours_p]
    for _ in range(3):  # the same grad tensors every step: nothing to rebuild
        for p, q, gr in zip(ours_p, ref_p, grads):
            p.grad, q.grad = gr, gr.clone()
        with record_paths() as paths:
            ours.step()
        ref.step()
        assert paths == ["triton", "triton"]
    assert builds == [True, True, False, False, False, False]
    assert_params_close(ours_p, ref_p)


def _scaler_steps(opt, params, g, plan_of_inf, reads=None):
    """GradScaler steps; ``plan_of_inf[i]`` puts an inf into step i's grads. ``reads`` collects
    state[p]["step"] right after each scaler step, before anything else runs."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1000)
    scaler.scale(torch.ones(()))
    for inf in plan_of_inf:
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * scaler.get_scale()
        if inf:
            params[0].grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        if reads is not None:
            reads.append([opt.state[p].get("step") for p in params])


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("kernel", ["triton", "host"])
@pytest.mark.parametrize("name", ["sgd", "adamw", "lion"])
def test_grad_scaler_skipping_the_first_step(monkeypatch, name, kernel, flat):
    """A first step skipped for inf grads leaves no trace: the next step is a first step (SGD's buffer
    becomes the grad, not (1 - dampening) * grad), as in torch. ``triton``: the kernel skips by itself."""
    if kernel == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    opts = {"sgd": dict(lr=0.1, momentum=0.9, dampening=0.3), "adamw": dict(lr=1e-2), "lion": dict(lr=1e-2)}[name]
    spec = OPTIMIZERS[name]
    g0 = torch.Generator().manual_seed(0)
    ours_p = [torch.nn.Parameter(torch.randn(s, generator=g0)) for s in [(5, 4), (7,)]]
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl="fused", flat=flat, **opts)
    ref = reference_class(spec)(ref_p, **opts, **reference_kwargs(spec))
    with record_paths() as paths:
        _scaler_steps(ours, ours_p, torch.Generator().manual_seed(1), [True, False, True, False])
    _scaler_steps(ref, ref_p, torch.Generator().manual_seed(1), [True, False, True, False])
    assert ("triton" in paths) == (kernel == "triton")
    assert_params_close(ours_p, ref_p)
    ours_sd, ref_sd = ours.state_dict()["state"], ref.state_dict()["state"]
    assert set(ours_sd) == set(ref_sd)
    for i in ref_sd:
        for k, v in ref_sd[i].items():
            torch.testing.assert_close(ours_sd[i][k].float(), v.float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("flat", [False, True])
def test_step_count_reads_right_right_after_a_skipped_step(monkeypatch, flat):
    """The kernel skips by itself and the step is counted until its flag is read; reading ``state`` reads
    the flag first, so the count is right whenever a user reads it."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = fastoptim.AdamW(params, impl="fused", flat=flat, lr=1e-2)
    reads = []
    with record_paths() as paths:
        _scaler_steps(opt, params, torch.Generator().manual_seed(0), [False, True, False, True], reads)
    assert "triton" in paths
    assert reads == [[1, 1], [1, 1], [2, 2], [2, 2]]


@pytest.mark.sample("name", "level")
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_float64_params_step_in_float64_at_every_level(name, level):
    """torch.optim steps fp64 params in fp64; so does every level (the compiled level's hyper-parameters
    too: in fp32 they would be 1e-7 off)."""
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[1]
    g = torch.Generator().manual_seed(0)
    ours_p = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64))
              for s in shapes_for(name, [(5, 4), (7,)])]
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl=level, **opts)
    ref = reference_class(spec)(ref_p, **opts, **reference_kwargs(spec))
    for _ in range(5):
        _grads(g, ours_p, ref_p)
        ours.step()
        ref.step()
    if spec.params == "matrices":
        # Muon's Newton-Schulz runs in ns_dtype (fp32 at most, in torch's loop too): a last-bit difference in an
        # fp64 momentum rounds to fp32 one spacing apart, and the update moves by lr * ratio * 2^-23 or so
        # (1.3e-8 measured over 5 steps). The elementwise stages run in fp64: the momentum to 1e-12, and the
        # params hold values no fp32 step would give.
        for a, b in zip(ours_p, ref_p):
            assert a.dtype == torch.float64 and ours.state[a]["momentum_buffer"].dtype == torch.float64
            torch.testing.assert_close(ours.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"],
                                       atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-12)
            assert (a.detach().float().double() != a.detach()).all()
        return
    for a, b in zip(ours_p, ref_p):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad"])
def test_torch_fused_cpu_kernel_never_gets_a_strided_state(name):
    """torch's fused CPU kernels walk p, g and every state in one linear layout. A state in another layout
    (a channels_last checkpoint loaded into a contiguous model, a transposed tensor put in by hand) goes
    the foreach way."""
    spec, ours, ours_p, ref, ref_p, g = _pair(name, "fused", option=1, shapes=((6, 6), (7,)))
    _grads(g, ours_p, ref_p)
    ours.step()
    ref.step()
    state_name = spec.cls.rule.state_names[0]
    buffer = torch.rand(6, 6, generator=g)
    ours.state[ours_p[0]][state_name] = buffer.t()
    ref.state[ref_p[0]][state_name] = buffer.t().clone()
    for _ in range(3):
        _grads(g, ours_p, ref_p)
        with record_paths() as paths:
            ours.step()
        ref.step()
        assert paths == ["torch_fused", "foreach"]
        assert_params_close(ours_p, ref_p)


@pytest.mark.parametrize("level", LEVELS)
def test_param_data_of_another_dtype_is_refused_before_anything_changes(level):
    """``model.half()`` after some steps: the states are still fp32. torch.optim fails on the mix; so does
    fastoptim, with the state named, before any param or count moves (the plan sees p.data replaced)."""
    model = torch.nn.Linear(8, 4)
    opt = fastoptim.AdamW(model.parameters(), lr=1e-2, impl=level)
    x = torch.randn(16, 8)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model.half()
    model(x.half()).square().mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"state 'exp_avg' of param 0 has shape \(4, 8\), dtype torch.float32"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert [opt.state[p]["step"] for p in model.parameters()] == [2, 2]


@pytest.mark.parametrize("level", LEVELS)
def test_flat_mode_takes_param_data_replaced_between_steps(level):
    """``p.data = t`` in flat mode: the new values go into the flat buffer and the param is its view again."""
    spec, ours, ours_p, ref, ref_p, g = _pair("adamw", level, flat=True)
    for _ in range(2):
        _grads(g, ours_p, ref_p)
        ours.step()
        ref.step()
    new = torch.randn(ours_p[0].shape, generator=g)
    ours_p[0].data = new.clone()
    ref_p[0].data = new.clone()
    for _ in range(3):
        _grads(g, ours_p, ref_p)
        ours.step()
        ref.step()
        assert_params_close(ours_p, ref_p)
    bucket = ours._stepper.flat_buckets[0][0]
    assert ours_p[0].data_ptr() == bucket.param_views[0].data_ptr()
    ours_p[1].data = torch.randn(3, generator=g)  # another shape: refused, nothing changed
    before = [p.detach().clone() for p in ours_p]
    with pytest.raises(ValueError, match="param 1 was given data of shape"):
        ours.step()
    assert all(torch.equal(a, b) for a, b in zip(ours_p, before))


def test_a_dict_put_into_state_stays_the_users_and_its_edits_count():
    """As in torch, ``opt.state[p] = d`` makes ``d`` the state: later edits through ``d`` are what steps."""
    spec, ours, ours_p, ref, ref_p, g = _pair("adam", "foreach")
    for _ in range(2):
        _grads(g, ours_p, ref_p)
        ours.step()
        ref.step()
    d, e = dict(ours.state[ours_p[0]]), dict(ref.state[ref_p[0]])
    ours.state[ours_p[0]], ref.state[ref_p[0]] = d, e
    assert ours.state[ours_p[0]] is d
    for step in range(3):
        if step == 1:  # an edit through the user's own dict, between steps
            d["exp_avg"] = torch.zeros_like(ours_p[0])
            e["exp_avg"] = torch.zeros_like(ref_p[0])
            d["step"], e["step"] = 0, torch.tensor(0.0)
        _grads(g, ours_p, ref_p)
        ours.step()
        ref.step()
        assert_params_close(ours_p, ref_p)
    assert isinstance(__import__("copy").copy(ours.state), dict)


def test_flat_add_param_group_that_is_refused_leaves_no_trace():
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    c = torch.nn.Parameter(torch.randn(2, dtype=torch.complex64))
    opt = fastoptim.AdamW([p], flat=True, lr=1e-2)
    q_before = q.detach().clone()
    with pytest.raises(ValueError, match="flat=True"):
        opt.add_param_group({"params": [q, c]})
    assert len(opt.param_groups) == 1 and len(opt._stepper.flat_buckets) == 1
    assert torch.equal(q.detach(), q_before) and q.grad is None
    p.grad = torch.ones(3)
    opt.step()


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("level", LEVELS)
def test_a_one_element_tensor_lr_of_shape_1_steps_as_torch_does(level, flat):
    """torch.optim takes a tensor lr of shape (1,) as well as 0-d; so does every level (it failed mid-step
    after other groups had moved)."""
    g = torch.Generator().manual_seed(0)
    ours_p = [torch.nn.Parameter(torch.randn(5, generator=g)), torch.nn.Parameter(torch.randn((), generator=g))]
    ref_p = clone_params(ours_p)
    ours = fastoptim.Adam([{"params": ours_p[:1]}, {"params": ours_p[1:], "lr": torch.tensor([0.01])}], lr=0.01,
                          impl=level, flat=flat)
    ref = torch.optim.Adam([{"params": ref_p[:1]}, {"params": ref_p[1:], "lr": torch.tensor([0.01])}], lr=0.01,
                           foreach=False)
    for _ in range(3):
        _grads(g, ours_p, ref_p)
        ours.step()
        ref.step()
    assert_params_close(ours_p, ref_p)


def _no_grad_t_(p):
    with torch.no_grad():
        p.t_()


RELAYOUTS = {
    "t_": lambda p: _no_grad_t_(p),                           # in place: same address, other strides
    "data_t": lambda p: setattr(p, "data", p.data.t()),      # a transposed view of the same memory
}


@pytest.mark.parametrize("routing", [False, True])
@pytest.mark.parametrize("relayout", list(RELAYOUTS))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["adamw", "sgd", "rmsprop"])
def test_a_param_re_laid_at_the_same_address_steps_as_torch_does(monkeypatch, name, level, relayout, routing):
    """A square param transposed between steps keeps its address: the plan sees the new strides, so no
    cached layout decision (torch's fused CPU kernels take only contiguous tensors) outlives it."""
    from fastoptim.engine import dispatch as levels
    monkeypatch.setattr(levels, "ROUTING", routing)
    spec, ours, ours_p, ref, ref_p, g = _pair(name, level, option=1, shapes=((6, 6), (4,)))
    for step in range(4):
        _grads(g, ours_p, ref_p)
        ours.step()
        ref.step()
        assert_params_close(ours_p, ref_p)
        if step == 1:
            address = ours_p[0].data_ptr()
            for p in (ours_p[0], ref_p[0]):
                RELAYOUTS[relayout](p)
            assert ours_p[0].data_ptr() == address and not ours_p[0].is_contiguous()


@pytest.mark.parametrize("flat", [False, True])
def test_a_param_re_laid_at_the_same_address_on_the_triton_kernel(monkeypatch, flat):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec, ours, ours_p, ref, ref_p, g = _pair("adamw", "fused", flat=flat, option=1, shapes=((8, 8), (16,)))
    for step in range(4):
        _grads(g, ours_p, ref_p)
        with record_paths() as paths:
            ours.step()
        ref.step()
        assert "triton" in paths
        assert_params_close(ours_p, ref_p)
        if step == 1:
            for p in (ours_p[0], ref_p[0]):
                _no_grad_t_(p)
    if flat:  # the transposed values went into the buffer, and the param is its view again
        bucket = ours._stepper.flat_buckets[0][0]
        assert ours_p[0].data_ptr() == bucket.param_views[0].data_ptr() and ours_p[0].is_contiguous()


@pytest.mark.parametrize("level", LEVELS)
def test_a_param_cut_short_at_the_same_address_is_refused_as_torch_refuses_it(level):
    """``p.data = p.data[:4]``: same address, another shape. torch.optim fails on the size mismatch; here the
    plan is rebuilt, the state is named, and nothing changes."""
    spec, ours, ours_p, ref, ref_p, g = _pair("adamw", level, shapes=((8,), (3,)))
    _grads(g, ours_p)
    ours.step()
    ours_p[0].data = ours_p[0].data[:4]
    ours_p[0].grad = torch.randn(4, generator=g)
    ours_p[1].grad = torch.randn(3, generator=g)
    before = [p.detach().clone() for p in ours_p]
    with pytest.raises(ValueError, match=r"state 'exp_avg' of param 0 has shape \(8,\)"):
        ours.step()
    assert all(torch.equal(a, b) for a, b in zip(ours_p, before))
    assert [ours.state[p]["step"] for p in ours_p] == [1, 1]


def test_flat_groups_edited_by_hand_are_refused_before_anything_changes():
    """Flat buffers belong to their group: popping a group would step the next one on the popped group's
    buffers. The step names the group and changes nothing."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, generator=g)) for _ in range(4)]
    opt = fastoptim.AdamW([{"params": ps[:2]}, {"params": ps[2:]}], flat=True, lr=1e-2)
    for p in ps:
        p.grad = torch.randn(4, generator=g)
    opt.step()
    opt.param_groups.pop(0)
    before = [p.detach().clone() for p in ps]
    with pytest.raises(ValueError, match="param group 0 no longer holds the params"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ps, before))


def _moved_in_place(model, what, flat=False):
    """Moves memory without a new storage object: ``share_memory()`` (a Hogwild setup) moves each storage into
    shared memory; an offloading hook frees a storage and gives it back at a new address. (In flat mode each
    param's storage aliases the buffer's memory, and such a storage cannot be resized: the hook gets torch's
    error and nothing moves.)"""
    if what == "share_memory":
        model.share_memory()
    elif what == "grads_shared":
        for p in model.parameters():
            p.grad.share_memory_()
    else:
        params = list(model.parameters())
        keep = [p.detach().clone() for p in params]
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in params}
        for storage in storages.values():
            size = storage.nbytes()
            if flat:
                with pytest.raises(RuntimeError, match="not resizable"):
                    storage.resize_(0)
                continue
            storage.resize_(0)
            hold = torch.empty(size, dtype=torch.uint8)  # (the old address goes to someone else)
            storage.resize_(size)
            del hold
        for p, k in zip(params, keep):
            p.data.copy_(k)


def _grad_changed_in_place(model, what):
    """A ``.grad`` that stays the same object but is re-laid or re-pointed."""
    for p in model.parameters():
        if p.dim() == 2 and p.shape[0] == p.shape[1]:
            if what == "grad_t_":
                p.grad.t_()
            else:
                p.grad.data = p.grad.data * 1.5


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("action", ["share_memory", "grads_shared", "storage_freed_and_back", "grad_t_", "grad_data"])
def test_flat_mode_follows_memory_moved_and_grads_changed_in_place(action, bits):
    """Flat mode keeps its plan (and the CPU kernel its table of addresses) while every param is its view of the
    buffer and every grad lies as its view does; memory that moves under the same storage object, and a grad
    re-laid or re-pointed in place, must make them anew: the same numbers as without flat mode, and no write to
    memory the buffers no longer own."""
    def run(flat):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64, bias=False))
        opt = fastoptim.AdamW(model.parameters(), lr=0.01, flat=flat, state_bits=bits, min_quant_size=0)
        x = torch.randn(16, 64)
        for step in range(4):
            if not action.startswith("grad_"):
                opt.zero_grad()
                model(x).square().mean().backward()
            elif step == 0 or not flat:  # the flat grads are accumulated into; the plain ones set anew
                opt.zero_grad()
                model(x).square().mean().backward()
            else:
                g = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
                for p, gi in zip(model.parameters(), g):
                    p.grad.copy_(gi)
            if step == 1:
                if action.startswith("grad_"):
                    _grad_changed_in_place(model, action)
                else:
                    _moved_in_place(model, action, flat)
            with record_paths() as paths:
                opt.step()
            if bits == 8 and flat:
                assert "cpu_kernel" in paths
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("bits", [16, 8])
def test_state_moved_in_place_is_followed_by_the_cpu_kernel(bits, flat):
    """``share_memory_()`` on a state (as shared-optimizer setups do) moves its storage in place: the CPU kernel's
    table of addresses must follow it (not write the memory it left), and the step must go on as it would have."""
    def run(move):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 96)), torch.nn.Parameter(torch.randn(32, 64))]
        opt = fastoptim.AdamW(params, lr=0.01, flat=flat, state_bits=bits, min_quant_size=0)
        for step in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            with record_paths() as paths:
                opt.step()
            assert "cpu_kernel" in paths
            if step == 0 and move:
                tensors = [t for state in opt.state.values() for name in ("exp_avg", "exp_avg_sq")
                           for t in ([state[name].codes, state[name].absmax] if bits == 8 else [state[name]])]
                before = [t.data_ptr() for t in tensors]
                for t in tensors:
                    t.share_memory_()  # in flat mode one call moves a whole buffer, views and all
                assert all(a != t.data_ptr() for a, t in zip(before, tensors))  # every state did move
        return [p.detach().clone() for p in params], opt.state_dict()["state"]

    (moved, moved_state), (kept, kept_state) = run(True), run(False)
    for a, b in zip(moved, kept):
        assert torch.equal(a, b)
    for i in kept_state:
        for name, value in kept_state[i].items():
            same = torch.equal(moved_state[i][name], value) if torch.is_tensor(value) else moved_state[i][name] == value
            assert same, name


def test_flat_pooled_states_are_watched_as_one_and_a_replaced_one_is_copied_in():
    """Flat mode keeps the head params' quantized states in one codes and one absmax buffer per state: the step
    plan watches one tensor per buffer (not two per param) for the CPU kernel's table. A state the user replaces is copied into
    its pooled place, a buffer moved through any one view is followed, and the numbers stay those of flat=False."""
    def run(flat):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(32, 64)) for _ in range(6)]
        opt = fastoptim.AdamW(params, lr=0.01, flat=flat, state_bits=8, min_quant_size=0)
        for step in range(4):
            for p in params:
                p.grad = torch.randn_like(p)
            if step == 2:
                opt.state[params[3]]["exp_avg"] = torch.full_like(params[3], 0.5)  # replaced: converted, copied in
                opt.state[params[1]]["exp_avg_sq"].codes.share_memory_()  # moves the storage under this view
            with record_paths() as paths:
                opt.step()
            assert paths == ["cpu_kernel"]
        return opt, params

    (flat_opt, flat_p), (ref_opt, ref_p) = run(True), run(False)
    for a, b in zip(flat_p, ref_p):
        assert torch.equal(a, b)
    (fb,) = flat_opt._stepper.flat_buckets[0]
    for name in ("exp_avg", "exp_avg_sq"):
        codes, absmax = fb.pool(name)
        for p, q in zip(flat_p, ref_p):
            mine, theirs = flat_opt.state[p][name], ref_opt.state[q][name]
            assert mine.codes.untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()
            assert mine.absmax.untyped_storage().data_ptr() == absmax.untyped_storage().data_ptr()
            assert torch.equal(mine.codes, theirs.codes) and torch.equal(mine.absmax, theirs.absmax)
    assert fb.pool("exp_avg_sq")[0].is_shared() and not fb.pool("exp_avg")[0].is_shared()
    ((table, indices),) = flat_opt._stepper.caches()[0, 0]["cpu_kernel"][1]
    assert len(indices) == 6  # one table for the six params
    assert len(flat_opt._stepper.plans[0].watched) == 4  # the plan watches codes and absmax of two states


def _swap(state, params):
    a, b = state[params[0]], state[params[2]]
    a["exp_avg"], b["exp_avg"] = b["exp_avg"], a["exp_avg"]


def _move(state, params):  # param 2 takes param 0's moment, and param 0 starts afresh
    state[params[2]]["exp_avg"] = state[params[0]]["exp_avg"]
    del state[params[0]]["exp_avg"]


def _transpose(state, params):  # a state given its own view re-laid (the params are square)
    state[params[1]]["exp_avg"] = state[params[1]]["exp_avg"].t()


@pytest.mark.parametrize("edit, bits", [(_swap, 32), (_swap, 8), (_move, 32), (_move, 8), (_transpose, 32)])
def test_flat_states_moved_between_params_are_copied_before_anything_overwrites_them(edit, bits):
    """States the user swaps, moves (and deletes at their old param) or re-lays: flat mode copies each into its
    param's place in the buffers, and no copy or fill may first overwrite what another copy reads (they all lie
    on the buffers). Flat mode must step as the same edit does without it."""
    def run(flat):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(3)]
        opt = fastoptim.AdamW(params, lr=0.01, flat=flat, state_bits=bits, min_quant_size=0)
        for step in range(4):
            for p in params:
                p.grad = torch.randn_like(p)
            if step == 2:
                edit(opt.state, params)
            opt.step()
        return params

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b) if bits == 8 else torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_flat_zero_grad_zeroes_a_replaced_grad():
    """``zero_grad(set_to_none=False)`` zeroes a grad the user assigned (as torch's does); the default sets it
    to None, as torch's does."""
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = fastoptim.AdamW([p], flat=True)
    p.grad = torch.ones(4, 4)  # e.g. from torch.autograd.grad, assigned
    opt.zero_grad(set_to_none=False)
    assert torch.count_nonzero(p.grad) == 0
    (p * 0).sum().backward()
    assert torch.count_nonzero(p.grad) == 0  # accumulated into zeros, as torch.optim's zero_grad leaves it
    opt.zero_grad()
    assert p.grad is None


def test_the_cpu_kernel_keeps_no_grad_alive_after_zero_grad():
    """Without flat mode the grads are the user's, new each step: zero_grad() (set_to_none) must free them."""
    import weakref

    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = fastoptim.AdamW([p], state_bits=8, min_quant_size=0)
    p.grad = torch.randn(64, 64)
    with record_paths() as paths:
        opt.step()
    assert "cpu_kernel" in paths
    grad = weakref.ref(p.grad)
    opt.zero_grad()
    assert grad() is None


@pytest.mark.parametrize("moved", [0, 1])
def test_states_a_user_keeps_on_one_storage_are_each_watched(moved):
    """Outside flat mode the states are the user's: two params' codes that the user put on one buffer of their
    own are watched one by one by the kernel's table, so one of them re-pointed in place (``codes.data = x``) is
    followed, and the state the user reads is the one the kernel writes."""
    def run(share):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(32, 64)) for _ in range(2)]
        opt = fastoptim.AdamW(params, lr=0.01, state_bits=8, min_quant_size=0)
        for step in range(4):
            for p in params:
                p.grad = torch.randn_like(p)
            if step == 1 and share:
                buffer = torch.empty(2 * 32 * 64, dtype=torch.uint8)
                for k, p in enumerate(params):
                    old = opt.state[p]["exp_avg"]
                    view = buffer[k * 2048:(k + 1) * 2048].view(32, 64)
                    view.copy_(old.codes)
                    opt.state[p]["exp_avg"] = storage.QuantizedState(view, old.absmax, old.fmt, old.shape)
            with record_paths() as paths:
                opt.step()
            assert paths == ["cpu_kernel"]
            if step == 1:
                codes = opt.state[params[moved]]["exp_avg"].codes
                codes.data = codes.clone()
        return params, [opt.state[p]["exp_avg"].codes.clone() for p in params]

    (shared_p, shared_codes), (own_p, own_codes) = run(True), run(False)
    for a, b in zip(shared_p + shared_codes, own_p + own_codes):
        assert torch.equal(a, b)


@pytest.mark.parametrize("flat, bits", [(False, 16), (False, 8), (True, 32), (True, 8)])
def test_a_state_put_in_is_the_users_again_after_a_step_the_kernel_skipped(monkeypatch, flat, bits):
    """A tensor put in as a state is converted by the next step (to its 16/8/4-bit format, or copied into flat
    mode's buffers); where the kernel skips that step by itself (GradScaler found inf), the step is taken back
    whole: the state is the tensor put in again, unrounded, and the next real step converts it."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 64)), torch.nn.Parameter(torch.randn(5))]
    opt = fastoptim.AdamW(params, impl="fused", flat=flat, lr=1e-2, state_bits=bits, min_quant_size=0)
    g = torch.Generator().manual_seed(1)
    _scaler_steps(opt, params, g, [False])
    put = torch.rand(32, 64) + 0.1234567
    opt.state[params[0]]["exp_avg_sq"] = put
    with record_paths() as paths:
        _scaler_steps(opt, params, g, [True])
    assert any(path.startswith("triton") for path in paths)
    assert opt.state[params[0]]["exp_avg_sq"] is put and opt.state[params[0]]["step"] == 1
    _scaler_steps(opt, params, g, [False])
    kept = opt.state[params[0]]["exp_avg_sq"]
    assert kept is not put and opt.state[params[0]]["step"] == 2


def _state_values(state):
    if isinstance(state, storage.QuantizedState):
        return [state.codes.clone(), state.absmax.clone()]
    return [state.clone()]


@pytest.mark.parametrize("edit, bits", [(_swap, 32), (_swap, 8), (_move, 32), (_move, 8), (_transpose, 32)])
def test_flat_states_moved_then_a_step_the_kernel_skipped_keep_what_was_put(monkeypatch, edit, bits):
    """Flat mode, states the user swapped, moved or re-laid on the buffers' own memory, then a step the kernel
    skips by itself: the tensors put in lie on memory the step wrote (they cannot be given back as they are),
    and the states the step copied them into hold what was put."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(3)]
    opt = fastoptim.AdamW(params, impl="fused", flat=True, lr=1e-2, state_bits=bits, min_quant_size=0)
    g = torch.Generator().manual_seed(1)
    _scaler_steps(opt, params, g, [False])
    edit(opt.state, params)
    put = {i: _state_values(s["exp_avg"]) for i, s in enumerate(opt.state[p] for p in params) if "exp_avg" in s}
    with record_paths() as paths:
        _scaler_steps(opt, params, g, [True])
    assert any(path.startswith("triton") for path in paths)
    for i, values in put.items():
        for mine, theirs in zip(_state_values(opt.state[params[i]]["exp_avg"]), values):
            assert torch.equal(mine, theirs)


def test_a_state_put_through_a_dict_held_across_a_skipped_step_is_kept(monkeypatch):
    """A step the kernel skips is taken back when next read; a state the user put in meanwhile through a dict
    held from before (no read in between) is theirs: the take-back gives back only what the step converted."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    params = [torch.nn.Parameter(torch.randn(16, 16))]
    opt = fastoptim.AdamW(params, impl="fused", lr=1e-2, state_bits=8, min_quant_size=0)
    g = torch.Generator().manual_seed(1)
    _scaler_steps(opt, params, g, [False])
    held = opt.state[params[0]]
    held["exp_avg_sq"] = torch.rand(16, 16)  # converted by the next step, which the kernel skips
    _scaler_steps(opt, params, g, [True])
    mine = torch.full((16, 16), 0.5)
    held["exp_avg_sq"] = mine
    assert opt.state[params[0]]["exp_avg_sq"] is mine
