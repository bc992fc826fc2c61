"""Schedules against torch's schedulers (or plain reference formulas) at every step of a few thousand."""

import math

import pytest
import torch
from torch.optim import lr_scheduler as S

import fastoptim
from fastoptim import schedules as fs
from conftest import make_params, set_grads
from runs import frames_compiled

STEPS = 3000
LR = 0.1


def _torch_lrs(make, steps=STEPS, momentum=False):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR, momentum=0.9)
    sched = make(opt)
    lrs, moms = [], []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["momentum"])
        opt.step()
        sched.step()
    return (lrs, moms) if momentum else lrs


def _our_lrs(schedule, steps=STEPS, momentum=False, **kw):
    opt = fastoptim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR, momentum=0.9)
    sched = fs.Scheduler(opt, schedule, **kw)
    lrs, moms = [], []
    for _ in range(steps):
        lr = opt.param_groups[0]["lr"]
        lrs.append(float(lr))
        moms.append(float(opt.param_groups[0]["momentum"]))
        sched.step()
    return (lrs, moms) if momentum else lrs


def _close(ours, ref, rel=1e-9):
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-15), (i, a, b)


CASES = {
    "constant": (fs.constant(), lambda o: S.LambdaLR(o, lambda e: 1.0)),
    "linear_warmup": (fs.linear_warmup(500, start_factor=0.1),
                      lambda o: S.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=500)),
    "linear_decay": (fs.linear_decay(2500, end_factor=0.05),
                     lambda o: S.LinearLR(o, start_factor=1.0, end_factor=0.05, total_iters=2500)),
    "join": (fs.join([(300, fs.linear_warmup(300, 0.2)), (2700, fs.linear_decay(2700, 0.1))]),
             lambda o: S.SequentialLR(o, [S.LinearLR(o, 0.2, 1.0, total_iters=300),
                                         S.LinearLR(o, 1.0, 0.1, total_iters=2700)], milestones=[300])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_matches_torch_scheduler(name):
    ours, make = CASES[name]
    _close(_our_lrs(ours), _torch_lrs(make))


def test_cosine_matches_cosine_annealing():
    _close(_our_lrs(fs.cosine(STEPS, min_factor=0.01)), _torch_lrs(lambda o: S.CosineAnnealingLR(o, STEPS, LR * 0.01)),
           rel=1e-7)  # torch's form is recursive: it drifts by rounding


@pytest.mark.parametrize("anneal", ["cos", "linear"])
@pytest.mark.parametrize("three_phase", [False, True])
def test_one_cycle_matches_torch_lr_and_momentum(anneal, three_phase):
    ours = _our_lrs(fs.OneCycle(STEPS, anneal=anneal, three_phase=three_phase), momentum=True)
    ref = _torch_lrs(lambda o: S.OneCycleLR(o, max_lr=LR, total_steps=STEPS, anneal_strategy=anneal,
                                            three_phase=three_phase), momentum=True)
    # ours scales the group's lr (LR) by the factor; torch's OneCycleLR sets max_lr = LR: the same numbers
    _close(ours[0], ref[0])
    _close(ours[1], ref[1])


def test_warmup_cosine_is_nanogpts_get_lr():
    warmup, decay, min_lr = 200, 2500, LR / 10

    def get_lr(it):  # nanoGPT's
        if it < warmup:
            return LR * (it + 1) / (warmup + 1)
        if it > decay:
            return min_lr
        ratio = (it - warmup) / (decay - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - min_lr)

    _close(_our_lrs(fs.warmup_cosine(warmup, decay, min_factor=0.1)), [get_lr(i) for i in range(STEPS)])


def test_inverse_sqrt_is_the_transformer_schedule():
    """Vaswani et al. 2017, "Attention Is All You Need", section 5.3:
        lrate = d_model^-0.5 * min(step_num^-0.5, step_num * warmup_steps^-1.5),
    with step_num counted from 1 (the first training step). Its peak is at step_num = warmup_steps, where both
    terms equal warmup_steps^-0.5. ``inverse_sqrt`` is that curve divided by its peak (so it multiplies the
    group's lr), and a scheduler's epoch e is the step the optimizer takes next, step_num = e + 1. The oracle
    is the paper's formula under torch's LambdaLR, and values worked out by hand."""
    warmup, d_model = 400, 512

    def lrate(step_num):
        return d_model ** -0.5 * min(step_num ** -0.5, step_num * warmup ** -1.5)
    peak = lrate(warmup)
    ours = _our_lrs(fs.inverse_sqrt(warmup))
    _close(ours, _torch_lrs(lambda o: S.LambdaLR(o, lambda epoch: lrate(epoch + 1) / peak)))
    by_hand = {   # epoch: lr, with LR = 0.1 and warmup = 400
        0: 0.1 * 1 / 400,            # step_num 1, warming up: 1 * 400^-1.5 / 400^-0.5 = 1/400
        199: 0.1 * 200 / 400,        # step_num 200: halfway up, 0.05
        399: 0.1,                    # step_num 400 = warmup: the peak, the group's lr itself
        899: 0.1 * (2 / 3),          # step_num 900: (400 / 900)^0.5 = 20/30
        1599: 0.1 * 0.5,             # step_num 1600 = 4 * warmup: 4^-0.5 = 1/2
        2499: 0.1 * 0.4,             # step_num 2500: (400 / 2500)^0.5 = 20/50
    }
    for epoch, lr in by_hand.items():
        assert math.isclose(ours[epoch], lr, rel_tol=1e-12), (epoch, ours[epoch], lr)
    assert max(ours) == ours[399]  # one peak, at the end of the warmup


def test_wsd_matches_its_formula():
    warm, stable, decay = 200, 1800, 1000

    def wsd(i):
        if i < warm:
            return LR * i / warm
        if i < warm + stable:
            return LR
        t = min(i - warm - stable, decay) / decay
        return LR * (0.05 + 0.95 * (1 - math.sqrt(t)))
    _close(_our_lrs(fs.wsd(warm, stable, decay, min_factor=0.05, decay="sqrt")), [wsd(i) for i in range(STEPS)])


def test_scheduler_state_dict_round_trip_mid_run():
    schedule = fs.OneCycle(1000)
    straight = _our_lrs(schedule, steps=1000, momentum=True)
    opt = fastoptim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR, momentum=0.9)
    sched = fs.Scheduler(opt, schedule)
    for _ in range(400):
        sched.step()
    saved = sched.state_dict()
    opt2 = fastoptim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0, momentum=0.5)
    sched2 = fs.Scheduler(opt2, schedule)
    sched2.load_state_dict(saved)
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(straight[0][401], rel=1e-12)
    assert opt2.param_groups[0]["momentum"] == pytest.approx(straight[1][401], rel=1e-12)
    with pytest.raises(ValueError, match="base lrs"):
        sched2.load_state_dict({"last_epoch": 3, "base_lrs": [1.0, 2.0]})


def test_tensor_lr_is_written_in_place_and_compiled_steps_never_recompile():
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(17, 5), (64,), (300,)]]
    for p in params:
        p.grad = torch.randn(p.shape) * 1e-2
    opt = fastoptim.AdamW(params, impl="compiled", lr=1e-2)
    sched = fs.Scheduler(opt, fs.OneCycle(1000), tensor_lr=True)
    lr_tensor = opt.param_groups[0]["lr"]
    assert isinstance(lr_tensor, torch.Tensor)
    for _ in range(2):
        opt.step()
        sched.step()
    before = frames_compiled()
    seen = set()
    for _ in range(997):
        opt.step()
        sched.step()
        seen.add(float(lr_tensor))
        assert opt.param_groups[0]["lr"] is lr_tensor
    assert len(seen) > 900
    assert frames_compiled() == before


@pytest.mark.parametrize("level", ["loop", "foreach", "fused", "compiled"])
def test_tensor_lr_training_matches_float_lr(level):
    runs = []
    for tensor_lr in (False, True):
        params = make_params()
        opt = fastoptim.AdamW(params, impl=level, lr=1e-2)
        sched = fs.Scheduler(opt, fs.OneCycle(20), tensor_lr=tensor_lr)
        for step in range(1, 20):
            set_grads(step, [params], none_every=10 ** 9)
            opt.step()
            sched.step()
        runs.append(params)
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_drives_torch_optimizers_like_torch_schedulers():
    ref_p, our_p = make_params(), make_params()
    ref = torch.optim.AdamW(ref_p, lr=1e-2, foreach=False)
    ref_sched = S.OneCycleLR(ref, max_lr=1e-2, total_steps=30)
    ours = torch.optim.AdamW(our_p, lr=1e-2, foreach=False)
    our_sched = fs.Scheduler(ours, fs.OneCycle(30))
    for step in range(1, 30):
        set_grads(step, [ref_p, our_p], none_every=10 ** 9)
        ref.step()
        ours.step()
        ref_sched.step()
        our_sched.step()
        assert ours.param_groups[0]["lr"] == pytest.approx(ref.param_groups[0]["lr"], rel=1e-12)
        assert ours.param_groups[0]["betas"][0] == pytest.approx(ref.param_groups[0]["betas"][0], rel=1e-12)
    for a, b in zip(our_p, ref_p):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


def test_bad_schedule_arguments_are_named():
    with pytest.raises(ValueError, match="warmup_steps"):
        fs.linear_warmup(-1)
    with pytest.raises(ValueError, match="decay"):
        fs.wsd(1, 1, 1, decay="exp")
    with pytest.raises(ValueError, match="pct_start"):
        fs.OneCycle(100, pct_start=1.5)
    with pytest.raises(ValueError, match="momentum_schedule"):
        fs.Scheduler(fastoptim.Adagrad(make_params()), fs.constant(), momentum_schedule=fs.constant())


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_wsd_linear_and_cosine_decays_match_their_formulas(decay):
    """The two decays ``train --schedule wsd`` can run (linear is its default), against the shapes written
    out here, at every step and at the phase boundaries: warmup i/W, then 1, then, with t the share of
    the decay done, min + (1 - min) * (1 - t) or min + (1 - min) * (1 + cos(pi t)) / 2, then min."""
    warm, stable, decay_steps, floor = 100, 300, 400, 0.05

    def expected(i):
        if i < warm:
            return i / warm
        if i < warm + stable:
            return 1.0
        t = min(i - warm - stable, decay_steps) / decay_steps
        shape = 1 - t if decay == "linear" else 0.5 * (1 + math.cos(math.pi * t))
        return floor + (1 - floor) * shape

    schedule = fs.wsd(warm, stable, decay_steps, min_factor=floor, decay=decay)
    steps = warm + stable + decay_steps + 50
    _close([schedule(i) for i in range(steps)], [expected(i) for i in range(steps)], rel=1e-12)
    _close(_our_lrs(schedule, steps=steps), [LR * expected(i) for i in range(steps)])
    mid = warm + stable + decay_steps // 2   # halfway down both shapes are at (1 + min) / 2
    by_hand = {0: 0.0, warm - 1: 0.99, warm: 1.0, warm + stable - 1: 1.0, warm + stable: 1.0,
               mid: 0.525, warm + stable + decay_steps: floor, steps - 1: floor}
    if decay == "cosine":   # a quarter of the way down: (1 + cos(pi/4)) / 2 = 0.853553...
        by_hand[warm + stable + decay_steps // 4] = floor + (1 - floor) * (2 + math.sqrt(2)) / 4
    else:
        by_hand[warm + stable + decay_steps // 4] = floor + (1 - floor) * 0.75
    for i, value in by_hand.items():
        assert math.isclose(schedule(i), value, rel_tol=1e-12, abs_tol=1e-15), (i, schedule(i), value)
