"""Compiled steps never recompile under schedules; GradScaler end to end; flat-buffer mode behaviour."""

import warnings

import pytest
import torch

import fastoptim
from conftest import (NAME_FLAT, assert_params_close, assert_state_close, clone_params, make_params, same_random_grads,
                      set_grads, shape_for, shapes_for)
from fastoptim.levels import LEVELS
from fastoptim.registry import OPTIMIZERS
from fastoptim.rules.base import Elementwise, PerTensor
from fastoptim.reference import reference_class, reference_kwargs
from runs import frames_compiled, run_with_tensor_hyperparameters, scaler_run


@pytest.mark.parametrize("name,sched", [("adamw", "onecycle"), ("sgd", "onecycle"), ("lion", "cosine"),
                                        ("rmsprop", "onecycle")])
def test_compiled_level_never_recompiles_over_1000_scheduled_steps(name, sched):
    spec = OPTIMIZERS[name]
    opts = dict(spec.option_sets[1])
    if name == "sgd":
        opts["momentum"] = 0.9
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(17, 5), (64,), (1,), (300,)]]
    opt = spec.cls(params, impl="compiled", **opts)
    if sched == "onecycle":  # cycles lr and beta1/momentum every step
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=1000)
    else:
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) * 1e-2 for p in params]
    for p, gr in zip(params, grads):
        p.grad = gr
    for _ in range(2):
        opt.step()
        scheduler.step()
    compiled_before = frames_compiled()
    seen = set()
    for _ in range(998):
        opt.step()
        scheduler.step()
        seen.add(opt.param_groups[0]["lr"])
    assert len(seen) > 900  # the lr really changed every step
    assert frames_compiled() == compiled_before, "a scheduled step recompiled"


@pytest.mark.sample(("name", "flat"), ("flat", "level"))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name,flat", NAME_FLAT)
def test_grad_scaler_end_to_end(name, level, flat):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[1]
    ours_p = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(shape_for(name, (3,))))]
    ref_p = clone_params(ours_p)
    ours, ours_rec = scaler_run(lambda ps: spec.cls(ps, impl=level, flat=flat, **opts), ours_p)
    ref, ref_rec = scaler_run(lambda ps: reference_class(spec)(ps, **opts, **reference_kwargs(spec)), ref_p)
    before, after, scale_before, scale_after = ours_rec[1]  # the poisoned step
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "an inf step moved the params"
    assert scale_after < scale_before, "the scale was not lowered"
    if spec.cls.rule.exports_step:
        assert ours.state[ours_p[0]]["step"] == 3  # 4 steps, one skipped
    for (_, a, sa, _), (_, b, sb, _) in zip(ours_rec, ref_rec):
        assert sa == sb
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


# --- flat-buffer mode ---------------------------------------------------------------------------------

def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def test_flat_mode_grads_are_views_and_backward_accumulates_in_place():
    model = _model()
    opt = fastoptim.create(model, "adamw", flat=True, lr=1e-2)
    buckets = [b for bs in opt._stepper.flat_buckets for b in bs]
    assert all(p.grad is None for p in model.parameters())  # (as torch leaves them: no grad yet)
    x = torch.randn(5, 8)
    model(x).sum().backward()  # each grad is its view of the buffer (a hook points it there)
    views = {id(p): p.grad for b in buckets for p in b.params}
    model(x).sum().backward()  # accumulation lands in the same views
    for b in buckets:
        for p in b.params:
            assert p.grad is views[id(p)]
            for t, buffer in ((p.grad, b.grad_buffer), (p, b.param_buffer)):
                base = buffer.data_ptr()
                assert base <= t.data_ptr() < base + buffer.numel() * buffer.element_size()
    assert all(b.grad_buffer.abs().sum() > 0 for b in buckets)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is views[id(p)] and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_flat_mode_trains_like_torch():
    model, ref_model = _model(), _model()
    opt = fastoptim.create(model, "adamw", flat=True, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(fastoptim.param_groups(ref_model, 0.1), lr=1e-2, foreach=False)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for _ in range(20):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_flat_mode_repairs_a_replaced_grad():
    params = make_params()
    opt = OPTIMIZERS["sgd"].cls(params, flat=True, lr=0.1)
    before = params[3].detach().clone()
    params[3].grad = torch.ones_like(params[3])  # the user replaced the view
    opt.step()
    torch.testing.assert_close(params[3].detach(), before - 0.1)
    assert params[3].grad.data_ptr() != 0 and params[3].grad is opt._stepper.flat_buckets[0][0].grad_views[3]


@pytest.mark.parametrize("level", LEVELS)
def test_flat_state_dict_round_trips_with_torch(level):
    params = make_params()
    opt = OPTIMIZERS["adam"].cls(params, flat=True, impl=level, lr=1e-2, amsgrad=True)
    for step in range(1, 4):
        set_grads(step, [params], none_every=10 ** 9)
        opt.step()
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    torch_p = clone_params(params)
    ref = torch.optim.Adam(torch_p, lr=1e-2, amsgrad=True, foreach=False)
    ref.load_state_dict(sd)
    flat_p = clone_params(params)
    again = OPTIMIZERS["adam"].cls(flat_p, flat=True, impl=level, lr=1e-2, amsgrad=True)
    again.load_state_dict(ref.state_dict())
    bucket = again._stepper.flat_buckets[0][0]
    for step in range(4, 7):
        set_grads(step, [torch_p, flat_p], none_every=10 ** 9)
        ref.step()
        again.step()
    assert_params_close(flat_p, torch_p)
    for i, p in enumerate(flat_p):  # loaded state lives in the flat buffers again once the step ran
        assert again.state[p]["exp_avg"].data_ptr() == bucket.views(bucket.state_buffers["exp_avg"])[i].data_ptr()


def test_flat_mode_refuses_complex_params():
    with pytest.raises(ValueError, match="flat=True"):
        fastoptim.Adam([torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))], flat=True)


@pytest.mark.parametrize("saved_steps", [0, 2])
def test_flat_sgd_loads_torch_state_with_first_step_semantics(saved_steps):
    """torch's SGD keeps no step: an empty checkpoint means the next step is a first step (buffer = grad)."""
    params = make_params()
    ref_p = clone_params(params)
    opts = dict(lr=0.1, momentum=0.9, dampening=0.5)
    ref = torch.optim.SGD(ref_p, foreach=False, **opts)
    for step in range(1, saved_steps + 1):
        set_grads(step, [ref_p], none_every=10 ** 9)
        ref.step()
    ours_p = clone_params(ref_p)
    ours = OPTIMIZERS["sgd"].cls(ours_p, flat=True, **opts)
    set_grads(99, [ours_p], none_every=10 ** 9)  # a step before loading: the load must reset it
    ours.step()
    for p, q in zip(ours_p, ref_p):
        p.data.copy_(q.detach())
    ours.load_state_dict(ref.state_dict())
    for step in range(saved_steps + 1, saved_steps + 4):
        set_grads(step, [ours_p, ref_p], none_every=10 ** 9)
        ours.step()
        ref.step()
    assert_params_close(ours_p, ref_p)


@pytest.mark.sample("name", "level")
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_tensor_hyperparameters_match_floats(name, level):
    floats, tensors = run_with_tensor_hyperparameters(name, level)
    assert_params_close(floats, tensors)


def test_tensor_hyperparameter_must_hold_one_float():
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        fastoptim.Adam(make_params(), lr=torch.tensor([1e-3, 1e-3]))


@pytest.mark.parametrize("name,path", [("lion", "foreach"), ("adamw", "torch_fused")])
def test_compiled_level_routes_small_buckets_to_the_fused_path_and_says_so(monkeypatch, name, path):
    from fastoptim.engine import dispatch as levels
    from fastoptim.levels import record_paths
    monkeypatch.setattr(levels, "ROUTING", True)
    monkeypatch.setattr(levels, "_said", set())
    g = torch.Generator().manual_seed(0)
    base_p = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(64, 64), (64,)] * 20]
    ours_p = clone_params(base_p)
    base = OPTIMIZERS[name].cls(base_p, impl="loop", lr=1e-2)
    ours = OPTIMIZERS[name].cls(ours_p, impl="compiled", lr=1e-2)
    for step in range(1, 3):
        same_random_grads(base_p, ours_p, g)
        base.step()
        with warnings.catch_warnings(record=True) as caught, record_paths() as paths:
            warnings.simplefilter("always")
            ours.step()
        routed = [w for w in caught if "impl='compiled' runs the fused level's path" in str(w.message)]
        assert len(routed) == (step == 1)  # said once
        assert all(w.category is RuntimeWarning and w.filename == __file__ for w in routed)  # at the user's step()
        assert paths == [path]
    assert_params_close(ours_p, base_p)
    big = [torch.nn.Parameter(torch.randn(1 << 15, generator=g))]  # large tensors: the compiled path itself
    opt = OPTIMIZERS[name].cls(big, impl="compiled", lr=1e-2)
    big[0].grad = torch.randn(1 << 15, generator=g)
    with record_paths() as paths:
        opt.step()
    assert paths == ["compiled"]


@pytest.mark.parametrize("flat", [False, True])
def test_foreach_level_runs_the_fused_path_on_the_cpu_and_says_so(monkeypatch, flat):
    from fastoptim.engine import dispatch as levels
    from fastoptim.levels import record_paths
    monkeypatch.setattr(levels, "ROUTING", True)
    monkeypatch.setattr(levels, "_said", set())
    base_p = make_params()
    ours_p = clone_params(base_p)
    base = OPTIMIZERS["adamw"].cls(base_p, impl="loop", lr=1e-2)
    ours = OPTIMIZERS["adamw"].cls(ours_p, impl="foreach", flat=flat, lr=1e-2)
    for step in range(1, 4):
        set_grads(step, [base_p, ours_p], none_every=10 ** 9)
        base.step()
        with warnings.catch_warnings(record=True) as caught, record_paths() as paths:
            warnings.simplefilter("always")
            ours.step()
        routed = [w for w in caught if "impl='foreach' runs the fused level's path" in str(w.message)]
        assert len(routed) == (step == 1)
        assert all(w.category is RuntimeWarning and w.filename == __file__ for w in routed)
        assert "torch_fused" in paths
        assert_params_close(ours_p, base_p)


def test_routing_off_runs_each_level_on_its_own_path(monkeypatch):
    from fastoptim.engine import dispatch as levels
    from fastoptim.levels import record_paths
    monkeypatch.setattr(levels, "ROUTING", False)
    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(4)]
    for impl in ("foreach", "compiled"):
        opt = OPTIMIZERS["adamw"].cls(params, impl=impl, lr=1e-2)
        for p in params:
            p.grad = torch.randn_like(p)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with record_paths() as paths:
                opt.step()
        assert paths and set(paths) == {impl}


# (Adafactor's one stage is per-tensor: it has no elementwise math to gather; Muon's elementwise stages gather)
@pytest.mark.parametrize("name", [n for n, spec in OPTIMIZERS.items()
                                  if not spec.cls.rule.stages or any(isinstance(s, Elementwise)
                                                                      for s in spec.cls.rule.stages)])
def test_foreach_gathers_blocks_of_small_tensors_with_the_loop_levels_numbers(name, monkeypatch):
    """Many small CPU tensors run gathered into one tensor per role per cache block: the same elementwise
    math on the same values, so the same bits as the loop level; and the gathered path did run (for Muon,
    matrices of the same sizes)."""
    from fastoptim.paths import foreach
    calls = []
    real = foreach._apply_gathered
    monkeypatch.setattr(foreach, "_apply_gathered", lambda *a: calls.append(len(a[1])) or real(*a))
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[-1]
    g = torch.Generator().manual_seed(1)
    base_p = [torch.nn.Parameter(torch.randn(s, generator=g))
              for s in shapes_for(name, [(64, 64), (64,), (), (0,), (7, 3)] * 30)]
    base_p.append(torch.nn.Parameter(torch.randn(9, 40, generator=g).t()))  # a strided one among them
    ours_p = clone_params(base_p)
    base = spec.cls(base_p, impl="loop", **opts)
    ours = spec.cls(ours_p, impl="foreach", **opts)
    for _ in range(3):
        same_random_grads(base_p, ours_p, g)
        base.step()
        ours.step()
    assert calls and max(calls) >= foreach.GATHER_MIN_TENSORS
    if any(isinstance(s, PerTensor) for s in spec.cls.rule.stages):
        # Muon: the gathered elementwise stages make the momentum bit for bit; Newton-Schulz in between runs
        # batched over each shape group here and one matrix at a time on the loop level, and a batched product
        # may sum in another order: params, and the states a per-tensor stage writes (NorMuon's second moment), to
        # the fp32 tolerance
        per_tensor = {n for s in spec.cls.rule.stages if isinstance(s, PerTensor) for n in s.writes}
        for a, b in zip(ours_p, base_p):
            for k, v in base.state[b].items():
                if k in per_tensor:
                    assert_state_close(ours.state[a][k], v, msg=k)
                    continue
                assert torch.equal(torch.as_tensor(ours.state[a][k]), torch.as_tensor(v)), k  # (a step count too)
        assert_params_close(ours_p, base_p)
        return
    for a, b in zip(ours_p, base_p):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name,flat", [(n, f) for n, f in NAME_FLAT if n in ("adamw", "sgd", "lion", "adafactor", "muon")])
def test_a_step_counts_as_an_in_place_write_to_every_param(name, flat, level, bits):
    """As torch.optim's loop and foreach steps do: a loss whose backward needs a param's values from before the
    step is refused, on every level (torch's own fused CPU kernels count nothing), in flat mode (the buffers are
    written, not the params) and at 8 bits (the kernel writes through addresses)."""
    spec = OPTIMIZERS[name]
    params = [torch.nn.Parameter(torch.randn(shape_for(name, s))) for s in ((64, 64), (64,))]
    if name == "muon":
        params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(32, 64))]
    opt = spec.cls(params, impl=level, flat=flat, state_bits=bits, min_quant_size=0, **dict(spec.option_sets[0]))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # (a first step makes the states)
    loss = sum((p * p).sum() for p in params)  # its backward needs each p as it is now
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p._version for p in params]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (a routed level says so)
        opt.step()
    assert all(p._version > v for p, v in zip(params, before)), [p._version - v for p, v in zip(params, before)]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
