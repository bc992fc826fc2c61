"""Gradient release (``gradient_release=True``): the step inside backward, bucket by bucket.

Every check compares a released run with the ordinary loop (backward, ``opt.step()``, ``zero_grad()``) on the
same params, grads and level, bit for bit: params and the whole ``state_dict()`` after every step. The program
is a real backward through a small nonlinear loss, so the hooks fire as they do in a model; one param gets a
grad only every other step and one never does (neither may move, as in torch.optim).
"""

import copy
import io
import weakref

import pytest
import torch

from conftest import STORED, make_params
from fastoptim import AdamW, SGD
from fastoptim.engine import release
from fastoptim.levels import LEVELS, record_paths
from fastoptim.registry import OPTIMIZERS

CASES = [(name, i, level) for name, spec in OPTIMIZERS.items() for i in range(len(spec.option_sets))
         for level in LEVELS]
TINY = 1e-6  # release_bucket_mb: every param is its own bucket
STEPS = 4


def _params(name, dtype=torch.float32):
    params = make_params(seed=3, dtype=dtype, name=name)
    params.append(torch.nn.Parameter(torch.randn(4, 3, dtype=dtype)))  # reached every other step
    params.append(torch.nn.Parameter(torch.randn(5, 2, dtype=dtype)))  # never reached: its grad stays None
    return params


def _weights(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def _backward(params, step, scale=1.0):
    """A nonlinear loss over the params (grads depend on the params), reaching the last-but-one param every
    other step and never the last."""
    weights = _weights(params, step)
    reached = params[:-2] + ([params[-2]] if step % 2 == 0 else [])
    loss = sum((torch.tanh(p.float()) * w.float()).sum() * scale for p, w in zip(reached, weights))
    loss.backward()


def _assert_same(ours, theirs, opt_ours, opt_theirs, msg=""):
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), f"{msg}: param {i} differs by {(a.float() - b.float()).abs().max().item()}"
    _assert_same_state(opt_ours.state_dict(), opt_theirs.state_dict(), msg)


def _assert_same_state(a, b, msg=""):
    assert a["state"].keys() == b["state"].keys(), f"{msg}: {sorted(a['state'])} != {sorted(b['state'])}"
    for index in a["state"]:
        sa, sb = a["state"][index], b["state"][index]
        assert sa.keys() == sb.keys(), (msg, index, sorted(sa), sorted(sb))
        for k in sa:
            va, vb = sa[k], sb[k]
            if isinstance(va, torch.Tensor):
                assert torch.equal(va, vb), f"{msg}: state {k!r} of param {index} differs"
            else:
                assert va == vb, (msg, index, k, va, vb)
    assert [{k: v for k, v in g.items() if k != "params"} for g in a["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in b["param_groups"]]


def _pair(name, opts, level, groups=None, dtype=torch.float32, **own):
    """Released and ordinary optimizers of ``name`` over two copies of the same params."""
    cls = OPTIMIZERS[name].cls
    ours = _params(name, dtype)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    split = groups or (lambda ps: ps)
    released = cls(split(ours), impl=level, gradient_release=True, release_bucket_mb=own.pop("bucket_mb", TINY),
                   **own, **opts)
    ordinary = cls(split(theirs), impl=level, **own, **opts)
    return ours, theirs, released, ordinary


def _run(ours, theirs, released, ordinary, steps=STEPS, between=None, msg=""):
    for step in range(steps):
        _backward(ours, step)
        assert all(p.grad is None for p in ours), "a released backward left grads behind"
        released.step()  # (steps nothing: backward stepped every param with a grad)
        released.zero_grad()
        _backward(theirs, step)
        ordinary.step()
        ordinary.zero_grad()
        _assert_same(ours, theirs, released, ordinary, f"{msg} step {step}")
        if between is not None:
            between(step)


@pytest.mark.sample(("name", "index"), ("name", "level"))
@pytest.mark.parametrize("name,index,level", CASES)
def test_released_steps_match_the_ordinary_loop_bit_for_bit(name, index, level):
    opts = OPTIMIZERS[name].option_sets[index]
    # a bucket per param; compiled: one bucket at the end of backward, whose graph is the ordinary step's (a graph
    # per param shape would be a cold build each; test_bucket_sizes_give_the_same_numbers runs one such case)
    per_param = level != "compiled"
    ours, theirs, released, ordinary = _pair(name, opts, level, bucket_mb=TINY if per_param else None)
    _run(ours, theirs, released, ordinary, msg=f"{name}[{index}] {level}")
    # (an empty param's 0 bytes join the next bucket)
    assert released._release.flushes >= (STEPS * (len(ours) - 3) if per_param else STEPS), "nothing stepped in backward"
    assert released.state.get(ours[-1], {}).get("step", 0) == 0, "a param that never had a grad stepped"


@pytest.mark.parametrize("bucket_mb", [TINY, 2e-4, None])
@pytest.mark.parametrize("level", LEVELS)
def test_bucket_sizes_give_the_same_numbers(level, bucket_mb):
    """Per-param buckets, buckets of a few params, and the default (the whole small model in one bucket at the
    end of backward): the same numbers, with a bucket's params stepped by one dispatcher call."""
    ours, theirs, released, ordinary = _pair("adamw", dict(lr=1e-2, weight_decay=0.1), level,
                                            bucket_mb=bucket_mb)
    _run(ours, theirs, released, ordinary)
    flushes = released._release.flushes
    reached = len(ours) - 2  # (on odd steps one fewer)
    if bucket_mb == TINY:
        assert flushes >= STEPS * (reached - 1)  # (an empty param's 0 bytes join the next bucket)
    elif bucket_mb is None:
        assert flushes == STEPS  # one bucket, at the end of each backward
    else:
        assert STEPS < flushes < STEPS * reached


def test_a_bucket_frees_its_grads_before_the_next_grads_are_made():
    """Grads never all live at once: at each bucket's step only that bucket's grads (and none of the stepped
    ones) are alive."""
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    opt = AdamW(model.parameters(), lr=1e-3, gradient_release=True, release_bucket_mb=32 * 33 * 4 / 2 ** 20)
    alive = []
    real = opt._stepper.step_params

    def watched(params, **kwargs):
        alive.append(sum(p.grad is not None for p in model.parameters()))
        return real(params, **kwargs)

    opt._stepper.step_params = watched
    model(torch.randn(4, 32)).square().mean().backward()
    assert len(alive) == 6, alive  # a bucket per layer (its weight and bias)
    assert max(alive) == 2, alive
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("level", ["loop", "fused"])
def test_schedulers_and_per_group_hyper_parameters(level):
    """Two groups of different lr and weight decay under a scheduler that moves lr every step: a bucket reads its
    group's lr when it steps, as ``opt.step()`` does."""
    def groups(ps):
        return [{"params": ps[:4], "lr": 1e-2}, {"params": ps[4:], "lr": 3e-3, "weight_decay": 0.0}]

    ours, theirs, released, ordinary = _pair("adamw", dict(weight_decay=0.1), level, groups=groups)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[2e-2, 5e-3], total_steps=STEPS + 1)
              for o in (released, ordinary)]

    def advance(step):
        for s in scheds:
            s.step()
        assert [g["lr"] for g in released.param_groups] == [g["lr"] for g in ordinary.param_groups]

    _run(ours, theirs, released, ordinary, between=advance)


@pytest.mark.sample()
@pytest.mark.parametrize("bits", STORED)
@pytest.mark.parametrize("level", LEVELS)
def test_low_bit_state(level, bits):
    ours, theirs, released, ordinary = _pair("adamw", dict(lr=1e-2), level, state_bits=bits, min_quant_size=0)
    _run(ours, theirs, released, ordinary, msg=f"{bits}-bit")


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
@pytest.mark.parametrize("level", ["loop", "fused"])
def test_rounded_bf16_params(level, rounding):
    ours, theirs, released, ordinary = _pair("adamw", dict(lr=1e-2), level, dtype=torch.bfloat16,
                                            rounding=rounding)
    _run(ours, theirs, released, ordinary, msg=rounding)


@pytest.mark.parametrize("level", ["loop", "fused"])
def test_a_checkpoint_between_steps_resumes_as_a_straight_run(level):
    """A released run saved after two steps and loaded into a new released optimizer (the old one gone) goes on
    exactly as the ordinary run does."""
    ours, theirs, released, ordinary = _pair("adamw", dict(lr=1e-2, weight_decay=0.1), level, state_bits=8,
                                            min_quant_size=0)
    _run(ours, theirs, released, ordinary, steps=2)
    buffer = io.BytesIO()
    torch.save(released.state_dict(), buffer)
    buffer.seek(0)
    resumed = AdamW(ours, impl=level, lr=1e-2, weight_decay=0.1, state_bits=8, min_quant_size=0,
                    gradient_release=True, release_bucket_mb=TINY)
    resumed.load_state_dict(torch.load(buffer))
    flushed = released._release.flushes
    assert resumed._release is not None and released._release.handles  # (both hooked; the newest steps)
    for step in range(2, 5):
        _backward(ours, step)
        resumed.step()
        resumed.zero_grad()
        _backward(theirs, step)
        ordinary.step()
        ordinary.zero_grad()
        _assert_same(ours, theirs, resumed, ordinary, f"resumed step {step}")
    assert resumed._release.flushes and released._release.flushes == flushed  # the old one stepped nothing since


@pytest.mark.parametrize("level", ["loop", "fused"])
def test_gradient_accumulation_steps_on_the_sum(level):
    """Three micro-batches: the first two accumulate (``accumulating()``), the last backward steps on the sum,
    exactly as the ordinary loop steps after its three backwards."""
    ours, theirs, released, ordinary = _pair("adamw", dict(lr=1e-2), level, state_bits=8, min_quant_size=0)
    for step in range(3):
        for micro in range(3):
            if micro < 2:
                with released.accumulating():
                    _backward(ours, 10 * step + micro)
                assert ours[0].grad is not None  # kept for the sum
            else:
                _backward(ours, 10 * step + micro)
            _backward(theirs, 10 * step + micro)
        assert all(p.grad is None for p in ours[:-3])
        released.step()  # the param reached only in earlier micro-batches steps here, on its grad's sum
        released.zero_grad()
        ordinary.step()
        ordinary.zero_grad()
        _assert_same(ours, theirs, released, ordinary, f"step {step}")



@pytest.mark.parametrize("level", ["loop", "fused"])
def test_a_closure_backward_is_the_steps_own(level):
    """``step(closure)`` (Lightning steps so): the closure's backward steps the buckets, and a backward held in
    ``accumulating()`` before it adds up into that step, as in the ordinary closure loop."""
    ours, theirs, released, ordinary = _pair("adamw", dict(lr=1e-2), level)
    for step in range(3):
        with released.accumulating():
            _backward(ours, 10 * step)
        _backward(theirs, 10 * step)
        assert released.step(lambda: _backward(ours, 10 * step + 1) or 1.5) == 1.5
        assert all(p.grad is None for p in ours[:-2])  # (the closure does not reach ours[-2]: step() stepped it)
        ordinary.step(lambda: _backward(theirs, 10 * step + 1))
        released.zero_grad()
        ordinary.zero_grad()
        _assert_same(ours, theirs, released, ordinary, f"step {step}")
    assert released._release.flushes > 0


def test_lightning_s_manual_optimization_flow_and_closures_step_as_without_release():
    """A closure's backward steps as the step's own; a backward, then ``step(closure)`` with a closure that runs no
    backward (Lightning's manual optimization wraps every step so), then the next batch: no refusal, and the
    numbers of the same program without release."""
    def run(released):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = SGD(model.parameters(), lr=0.1, momentum=0.9, gradient_release=released)
        for step in range(3):
            model(torch.full((4,), float(step + 1))).sum().backward()
            opt.step(lambda: None)
            opt.zero_grad()
            opt.step(lambda: model(torch.ones(4)).square().sum().backward())
            opt.zero_grad()
        return [p.detach() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def test_accelerate_says_when_a_backward_accumulates(monkeypatch):
    """HF Trainer and accelerate mark the micro-batches before an optimizer step with GradientState's
    sync_gradients False: those backwards step nothing."""
    accelerate_state = pytest.importorskip("accelerate.state")
    state = accelerate_state.GradientState()
    model = torch.nn.Linear(4, 2)
    opt = SGD(model.parameters(), lr=0.1, gradient_release=True)
    before = [p.detach().clone() for p in model.parameters()]
    monkeypatch.setitem(state._shared_state, "sync_gradients", False)
    model(torch.ones(4)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert all(p.grad is not None for p in model.parameters())
    monkeypatch.setitem(state._shared_state, "sync_gradients", True)
    grads = [2 * p.grad for p in model.parameters()]
    model(torch.ones(4)).sum().backward()
    assert all(torch.equal(p, b - 0.1 * g) for p, b, g in zip(model.parameters(), before, grads))


def test_step_finishes_what_backward_did_not_step():
    """Grads set by hand (no backward) step in ``opt.step()``, as with torch.optim."""
    ours, theirs, released, ordinary = _pair("adamw", dict(lr=1e-2), "fused")
    for p, q in zip(ours, theirs):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    released.step()
    ordinary.step()
    _assert_same(ours, theirs, released, ordinary)


def test_a_step_refused_in_backward_changes_nothing():
    model = torch.nn.Linear(4, 2)
    opt = AdamW(model.parameters(), lr=1e-2, gradient_release=True)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        model(torch.ones(4)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert not opt.state
    opt.param_groups[0]["lr"] = 1e-2
    opt.zero_grad()
    model(torch.ones(4)).sum().backward()  # the next backward steps (the failed one left no bucket behind)
    assert all(not torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_refused_combinations_name_the_choices():
    params = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match="flat=True"):
        AdamW(params, gradient_release=True, flat=True)
    with pytest.raises(ValueError, match="needs gradient_release=True"):
        AdamW(params, release_bucket_mb=4)
    for bad in (0, -1, True, "4"):
        with pytest.raises(ValueError, match="release_bucket_mb"):
            AdamW(params, gradient_release=True, release_bucket_mb=bad)
    with pytest.raises(TypeError, match="gradient_release"):
        AdamW(params, gradient_release="yes")


def test_grad_scaler_is_refused_by_name():
    """GradScaler's step asks the optimizer first whether it scales in its kernels: there it is told why not
    (torch's own message would be "No inf checks were recorded")."""
    model = torch.nn.Linear(4, 2)
    opt = AdamW(model.parameters(), gradient_release=True)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(4)).sum()).backward()
    with pytest.raises(RuntimeError, match="GradScaler cannot drive an optimizer with gradient_release=True"):
        scaler.step(opt)


def test_refused_under_torch_distributed_without_a_ddp_tie(monkeypatch):
    """World size 2: the release hooks would see local grads. Made (the tie to DDP comes after), but its first
    backward is refused before anything steps, naming the tie (tests/engine/test_release_ddp.py: with it)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    p = torch.nn.Parameter(torch.randn(3))
    opt = AdamW([p], gradient_release=True)
    before = p.detach().clone()
    with pytest.raises(NotImplementedError, match=r"before DDP's all-reduce.*opt\.release_with\(ddp_model\)"):
        (p * p).sum().backward()
    assert torch.equal(p, before) and opt._release.flushes == 0 and not opt.state


def test_frozen_params_and_groups_added_under_torch_distributed(monkeypatch):
    """Frozen params are never hooked (no reason to refuse); a plain group added later is hooked, and refused at
    its first backward like the rest (the tie to DDP may come after it)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    model = torch.nn.Linear(4, 2)
    opt = AdamW(model.parameters(), gradient_release=True)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3), requires_grad=False)]})
    assert len(opt.param_groups) == 2 and len(opt._release.handles) == 2
    q = torch.nn.Parameter(torch.randn(3))
    opt.add_param_group({"params": [q]})
    assert len(opt._release.handles) == 3
    with pytest.raises(NotImplementedError, match=r"opt\.release_with\(ddp_model\)"):
        (q * q).sum().backward()


def test_the_newest_optimizer_releases_and_when_it_is_gone_the_one_before_takes_over():
    model = torch.nn.Linear(4, 2)
    old = SGD(model.parameters(), lr=0.1, gradient_release=True)
    new = SGD(model.parameters(), lr=0.1, gradient_release=True)  # the old one still alive: it must not step
    before = [p.detach().clone() for p in model.parameters()]
    grads = [torch.ones(2, 4), torch.ones(2)]
    model(torch.ones(4)).sum().backward()
    assert old._release.flushes == 0 and new._release.flushes == 1
    assert all(torch.equal(p, b - 0.1 * g) for p, b, g in zip(model.parameters(), before, grads))
    gone = weakref.ref(new)
    del new
    assert gone() is None
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(4)).sum().backward()  # (a throwaway optimizer collected: the one in use releases again)
    assert old._release.flushes == 1 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b - 0.1 * g) for p, b, g in zip(model.parameters(), before, grads))
    del old
    model(torch.ones(4)).sum().backward()  # none left: grads stay, as without release
    assert all(p.grad is not None for p in model.parameters())


def test_added_groups_and_copies_are_released_too():
    model = torch.nn.Linear(4, 2)
    opt = SGD([model.weight], lr=0.1, gradient_release=True)
    opt.add_param_group({"params": [model.bias], "lr": 0.5})
    model(torch.ones(4)).sum().backward()
    assert model.weight.grad is None and model.bias.grad is None
    copied = copy.deepcopy(opt)
    assert copied.gradient_release and copied._release.handles
    p = copied.param_groups[0]["params"][0]
    before = p.detach().clone()
    (p * 2).sum().backward()
    assert p.grad is None and torch.equal(p, before - 0.1 * 2)
    loaded = pickle_round_trip(opt)
    assert loaded.gradient_release and loaded._release.bucket_bytes == opt._release.bucket_bytes


def pickle_round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_released_step_runs_the_paths_of_the_level():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    opt = AdamW(model.parameters(), lr=1e-3, impl="fused", state_bits=8, gradient_release=True)
    with record_paths() as paths:
        model(torch.randn(2, 64)).sum().backward()
    assert "cpu_kernel" in paths, paths  # the 8-bit state's own kernel, as opt.step() runs it


def test_default_bucket_is_a_thirty_second_of_the_params():
    assert release.default_bucket_bytes([torch.empty(1 << 24)]) == (1 << 26) // 32
    assert release.default_bucket_bytes([torch.empty(10)]) == release.MIN_BUCKET_BYTES
    assert release.default_bucket_bytes([torch.empty(1 << 30, device="meta")]) == release.MAX_BUCKET_BYTES


def test_groups_edited_by_hand_are_followed():
    """A param moved to another group by hand steps with that group's hyper-parameters: a bucket's params are
    found in the groups as they are when it steps."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = SGD([{"params": [a, b], "lr": 0.1}, {"params": [], "lr": 0.5}], gradient_release=True)
    one = torch.ones(3)
    (a.sum() + b.sum()).backward()
    opt.step()
    a1 = one.add(one, alpha=-0.1)
    assert torch.equal(a, a1) and torch.equal(b, a1)
    opt.param_groups[0]["params"] = [a]
    opt.param_groups[1]["params"] = [b]
    (a.sum() + b.sum()).backward()
    opt.step()
    assert torch.equal(a, a1.add(one, alpha=-0.1)) and torch.equal(b, a1.add(one, alpha=-0.5))
    opt.param_groups[1]["params"] = []  # b in no group now: not stepped, its grad left as torch.optim leaves it
    (a.sum() + b.sum()).backward()
    assert torch.equal(b, a1.add(one, alpha=-0.5)) and torch.equal(b.grad, one)


def _measured_backward(opt, params, step):
    with opt.measure_grad_norm():
        _backward(params, step)  # (a fresh graph each time here: the same one as retain_graph would keep)
    _backward(params, step)


@pytest.mark.parametrize("max_norm", [0.5, 1e3])  # clipped, and not
@pytest.mark.parametrize("level", LEVELS)
def test_global_norm_clipping_measured_in_a_first_backward_is_exact(level, max_norm):
    """max_grad_norm with release: a measuring backward, then the stepping one, bit for bit the ordinary loop's
    clipped step (params, state, the norm reported); with accumulation and a param reached only by an earlier
    micro-batch, whose grad counts in the norm and steps in ``opt.step()`` by the same factor."""
    ours, theirs, released, ordinary = _pair("adamw", dict(lr=1e-2, weight_decay=0.1), level, max_grad_norm=max_norm)
    for step in range(3):
        with released.accumulating():
            _backward(ours, 10 * step + 1)  # reaches ours[-2] on odd... (10 * step + 1 is odd: not reached)
            _backward([*ours[:-3], ours[-2], ours[-1]], 10 * step + 2)  # reaches ours[-2] here only
        _measured_backward(released, ours, 10 * step + 3)
        released.step()
        released.zero_grad()
        _backward(theirs, 10 * step + 1)
        _backward([*theirs[:-3], theirs[-2], theirs[-1]], 10 * step + 2)
        _backward(theirs, 10 * step + 3)
        ordinary.step()
        ordinary.zero_grad()
        _assert_same(ours, theirs, released, ordinary, f"step {step}")
        assert torch.equal(released.last_grad_norm, ordinary.last_grad_norm)
    assert (ordinary.last_grad_norm > max_norm) == (max_norm < 1)  # (the clipped case clips)


def test_clipping_without_a_measured_norm_is_refused_before_anything_steps():
    model = torch.nn.Linear(4, 2)
    opt = AdamW(model.parameters(), lr=1e-2, gradient_release=True, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="(?s)not measured.*measure_grad_norm"):
        model(torch.ones(4)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)) and not opt.state
    opt.zero_grad()
    loss = model(torch.ones(4)).sum()
    with opt.measure_grad_norm():
        loss.backward(retain_graph=True)
    assert all(p.grad is None for p in model.parameters())  # the measuring pass keeps no grad
    loss.backward()
    opt.step()
    with pytest.raises(RuntimeError, match="not measured"):  # a window's norm serves that window only
        model(torch.ones(4)).sum().backward()
    with pytest.raises(RuntimeError, match="measures the norm"):
        AdamW(model.parameters(), max_grad_norm=1.0).measure_grad_norm()


@pytest.mark.parametrize("bits", [32, 8])
def test_buckets_step_on_the_triton_kernels_under_the_interpreter(monkeypatch, bits):
    """The GPU path: with ``TRITON_INTERPRET=1`` the fused level runs its Triton kernels (plain, or loading and
    storing 8-bit state) on CPU tensors; the released buckets take them, inside backward (each bucket's step runs
    while autograd's graph task is live, the last one from its end-of-backward callback), bit for bit as the
    ordinary loop."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ours, theirs, released, ordinary = _pair("adamw", dict(lr=1e-2, weight_decay=0.1), "fused", state_bits=bits,
                                            min_quant_size=0, bucket_mb=2e-4)
    tasks = []
    real = released._stepper.step_params

    def watched(params, **kwargs):
        tasks.append(torch._C._current_graph_task_id())
        return real(params, **kwargs)

    released._stepper.step_params = watched
    with record_paths() as paths:
        _run(ours, theirs, released, ordinary, steps=2)
    assert ("triton" if bits == 32 else "triton_stored") in paths, paths
    assert len(tasks) > 2 and all(t != -1 for t in tasks), tasks


def test_a_second_backward_before_the_step_is_refused():
    """Two losses backpropagated apart before one step: torch.optim steps once on the sum of their grads; release
    would step twice, each time on part of it. The second backward is refused (the first stepped, as it would
    in a loop that steps after each backward)."""
    model = torch.nn.Linear(4, 2)
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9, gradient_release=True)
    model(torch.ones(4)).sum().backward()
    after_first = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="second grad to step on.*opt.accumulating"):
        model(torch.ones(4)).square().sum().backward()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after_first))
    opt.step()
    opt.zero_grad()
    with opt.accumulating():  # the way to say it
        model(torch.ones(4)).sum().backward()
    model(torch.ones(4)).square().sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_accelerate_fp16_is_refused_before_anything_steps(monkeypatch):
    """accelerate's fp16 mixed precision runs a GradScaler: its state says so before backward, so release refuses
    at the first hook, with the params as they were."""
    accelerate_state = pytest.importorskip("accelerate.state")
    monkeypatch.setitem(accelerate_state.AcceleratorState._shared_state, "_mixed_precision", "fp16")
    model = torch.nn.Linear(4, 2)
    opt = AdamW(model.parameters(), gradient_release=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="fp16 mixed precision.*Nothing has stepped"):
        model(torch.ones(4)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)) and not opt.state
