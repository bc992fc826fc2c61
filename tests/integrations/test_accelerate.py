"""accelerate with fastoptim: save_state/load_state resume equals a straight run; a step GradScaler skips is reported
as skipped and holds the LR, as with torch.optim; gradient release under accumulate() equals the loop without it."""

from __future__ import annotations

import pytest
import torch

import fastoptim

from .kinds import KIND_NAMES, KINDS, TinyLM, tokens

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState, PartialState  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Accelerator keeps process-wide state: each test starts from none."""
    for reset in (AcceleratorState._reset_state, PartialState._reset_state, GradientState._reset_state):
        reset()
    yield
    for reset in (AcceleratorState._reset_state, PartialState._reset_state, GradientState._reset_state):
        reset()


BATCHES = tokens(24).split(4)


def run(make_optimizer, steps=range(6), mixed_precision="no", save=None, load=None, scaler=None, inf_at=(),
        device="cpu"):
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(cpu=device == "cpu", mixed_precision=mixed_precision)
    if scaler is not None:  # accelerate makes one only for fp16 on an accelerator: given here, as it would be there
        acc.scaler = scaler
    torch.manual_seed(0)
    model = TinyLM()
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8 ** s)
    model, opt, sched = acc.prepare(model, opt, sched)
    if load:
        acc.load_state(load)
    skipped, lrs = [], []
    for i in steps:
        ids = BATCHES[i].to(acc.device)
        with acc.autocast():
            loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
        acc.backward(loss)
        if i in inf_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        opt.step()
        sched.step()
        opt.zero_grad()
        skipped.append(opt.step_was_skipped)
        lrs.append(sched.get_last_lr()[0])
        if save and i == 2:
            acc.save_state(save)
    return acc.unwrap_model(model), skipped, lrs


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
@pytest.mark.parametrize("kind", KIND_NAMES)
def test_save_state_resume(kind, mixed_precision, tmp_path, device):
    """save_state writes the model with safetensors (the default): every tensor must come back."""
    make = KINDS[kind].make
    straight, _, _ = run(make, mixed_precision=mixed_precision, save=tmp_path, device=device)
    resumed, _, _ = run(make, steps=range(3, 6), mixed_precision=mixed_precision, load=tmp_path, device=device)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    if KINDS[kind].torch_twin is not None and mixed_precision == "no":
        twin, _, _ = run(KINDS[kind].torch_twin, device=device)
        for a, b in zip(straight.state_dict().values(), twin.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_grad_scaler_skip_is_reported(kind, device):
    """An inf grad at step 2: GradScaler skips that step, accelerate says so, and the LR schedule holds."""
    scaler = lambda: torch.amp.GradScaler(device, init_scale=2.0 ** 10)  # noqa: E731
    model, skipped, lrs = run(KINDS[kind].make, mixed_precision="bf16", scaler=scaler(), inf_at=(2,), device=device)
    assert skipped == [False, False, True, False, False, False]
    assert lrs[2] == lrs[1] and lrs[3] < lrs[2]
    if KINDS[kind].torch_twin is not None:
        twin, twin_skipped, twin_lrs = run(KINDS[kind].torch_twin, mixed_precision="bf16", scaler=scaler(),
                                           inf_at=(2,), device=device)
        assert (skipped, lrs) == (twin_skipped, twin_lrs)
        for a, b in zip(model.state_dict().values(), twin.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def accumulate_run(release: bool, device="cpu", steps=8):
    """accelerate's own accumulation loop, two micro-batches per step (accumulate() sets sync_gradients before
    each backward): with release the first backward of a window steps nothing, the second steps on the sum."""
    acc = accelerate.Accelerator(cpu=device == "cpu", gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = TinyLM()
    opt = fastoptim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, gradient_release=release)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8 ** s)
    model, opt, sched = acc.prepare(model, opt, sched)
    lrs = []
    for i in range(steps):
        ids = tokens(24, seed=i % 3)[:4].to(acc.device)
        with acc.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    return acc.unwrap_model(model), opt.optimizer, lrs


def test_gradient_release_with_accumulate(device):
    released, opt, lrs = accumulate_run(True, device)
    GradientState._reset_state()
    ordinary, _, ordinary_lrs = accumulate_run(False, device)
    for (name, a), b in zip(released.state_dict().items(), ordinary.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert lrs == ordinary_lrs and len(set(lrs)) == 5  # (the LR moves once per window)
    assert opt._release.flushes > 0 and all(p.grad is None for p in released.parameters())
    assert opt.state_dict()["state"][0]["step"].item() == 4  # a step per window of two micro-batches
