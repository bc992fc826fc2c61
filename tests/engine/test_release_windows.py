"""Gradient release across the window between two steps: zero_grad()'s two forms, a measuring backward, refusals
that come before anything steps, and which optimizer steps a param when several were made over it.

Each program runs with and without ``gradient_release`` and must give the same params and state bit for bit, or be
refused with nothing changed where the docs say so.
"""

import gc

import pytest
import torch

import fastoptim
from fastoptim import AdamW


def test_zero_grad_keeping_zeros_is_refused_once_grads_were_freed():
    # torch.optim keeps a stepped grad until zero_grad, and set_to_none=False zeroes it: a param the next backward
    # does not reach then steps on its zero grad (Adam's moments move). Release freed it: refused, nothing zeroed
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    opt = AdamW([a, b], lr=0.1, gradient_release=True)
    a.grad = torch.ones(3)
    opt.zero_grad(set_to_none=False)  # nothing freed yet: as torch.optim
    assert torch.equal(a.grad, torch.zeros(3)) and b.grad is None
    ((a * a).sum() + (b * b).sum()).backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"set_to_none=False.*freed the grads of 2 of these params"):
        opt.zero_grad(set_to_none=False)
    assert a.grad is None and b.grad is None
    # an optimizer made anew over the params (a reload) sees what the old one freed
    new = AdamW([a, b], lr=0.1)
    with pytest.raises(RuntimeError, match="set_to_none=False"):
        new.zero_grad(set_to_none=False)
    new.zero_grad()
    opt.zero_grad(set_to_none=False)  # nothing freed since the last zero_grad()
    assert a.grad is None and b.grad is None


def test_measuring_backward_keeps_the_second_backward_refusal():
    # two micro-batches, each measured, and one step: without accumulating() the second stepping backward is
    # refused, as it is without clipping (the measuring pass once started a new window and let it step twice)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    opt = AdamW([w], lr=0.1, max_grad_norm=1.0, gradient_release=True)
    for k in range(2):
        loss = (w * (k + 1)).pow(2).sum() / 2
        with opt.measure_grad_norm():
            loss.backward(retain_graph=True)
        if k == 0:
            loss.backward()
            stepped = w.detach().clone()
        else:
            with pytest.raises(RuntimeError, match="second grad"):
                loss.backward()
    assert opt.state[w]["step"] == 1 and torch.equal(w.detach(), stepped)


def test_measuring_backward_that_raised_leaves_no_copy_behind():
    # a grad hook raises in a measuring backward while the param holds an accumulated grad; the user drops the
    # window: the next window's measuring pass must not put that old grad back
    def run(gradient_release):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4))
        opt = AdamW([w], lr=0.1, max_grad_norm=10.0, gradient_release=gradient_release)
        boom = [False]

        def nan_guard(grad):
            if boom[0]:
                boom[0] = False
                raise FloatingPointError("nan")
        w.register_hook(nan_guard)
        with opt.accumulating():
            (w * 3).sum().backward()
        boom[0] = True
        loss = (w * 5).sum()
        with pytest.raises(FloatingPointError):
            with opt.measure_grad_norm() if gradient_release else torch.enable_grad():
                loss.backward(retain_graph=True)
        opt.zero_grad()
        loss = (w * 7).sum()
        if gradient_release:
            with opt.measure_grad_norm():
                loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
        return w.detach().clone(), opt.state[w]["exp_avg"].clone()

    w0, m0 = run(False)
    w1, m1 = run(True)
    assert torch.equal(w0, w1) and torch.equal(m0, m1)


def _two_groups(gradient_release):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    opt = AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1,
                gradient_release=gradient_release, release_bucket_mb=1e-6 if gradient_release else None)
    return model, opt


@pytest.mark.parametrize("gradient_release", [False, True])
def test_a_bad_group_is_refused_before_any_bucket_steps(gradient_release):
    # the last group's bucket steps first in backward: the first group's bad lr must be refused before it does
    model, opt = _two_groups(gradient_release)
    opt.param_groups[0]["lr"] = -1.0
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="Invalid lr"):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert len(opt.state) == 0


@pytest.mark.parametrize("gradient_release", [False, True])
@pytest.mark.parametrize("bits", [32, 8])
def test_a_bad_state_is_refused_before_any_bucket_steps(gradient_release, bits):
    # a state put in by hand with the wrong shape, for the first layer (its bucket steps last in backward)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = AdamW(model.parameters(), lr=1e-2, state_bits=bits, gradient_release=gradient_release,
                release_bucket_mb=0.01 if gradient_release else None)
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.state[model[0].weight]["exp_avg"] = torch.zeros(3, 3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="state 'exp_avg' of param 0"):
        model(torch.randn(3, 64)).sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad()  # (nothing stepped: the window may be dropped)


def test_a_sparse_grad_is_refused_by_name():
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = AdamW(emb.parameters(), lr=0.1, gradient_release=True)
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        emb(torch.tensor([1, 2])).sum().backward()
    assert torch.equal(emb.weight, before) and len(opt.state) == 0


def test_zero_grad_after_a_stepping_backward_without_step_is_refused():
    # a GAN's generator backward reaches the discriminator's params: torch.optim steps nothing on those grads (the
    # next zero_grad discards them); release has stepped on them, and the zero_grad says so
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)
    opt_g = fastoptim.Adam(gen.parameters(), lr=1e-2)
    opt_d = fastoptim.Adam(disc.parameters(), lr=1e-2, gradient_release=True)
    z, real = torch.randn(6, 3), torch.randn(6, 4)
    opt_d.zero_grad()
    (disc(real).mean() - disc(gen(z).detach()).mean()).backward()
    opt_d.step()
    opt_g.zero_grad()
    disc(gen(z)).mean().backward()
    opt_g.step()
    with pytest.raises(RuntimeError, match="GAN"):
        opt_d.zero_grad()
    # the documented way: the generator's backward accumulates on the discriminator's side, zero_grad discards it
    stepped = {name: p.detach().clone() for name, p in disc.named_parameters()}
    opt_d.step()  # (what the refused zero_grad left: the window ends)
    opt_g.zero_grad()
    with opt_d.accumulating():
        disc(gen(z)).mean().backward()
    opt_g.step()
    opt_d.zero_grad()
    assert all(torch.equal(p, stepped[name]) for name, p in disc.named_parameters())
    assert disc.weight.grad is None


@pytest.mark.parametrize("newer", ["fastoptim", "fastoptim, dropped"])
def test_a_newer_optimizer_without_release_steps_the_params(newer):
    # an older released optimizer still referenced (by its scheduler) leaves the params to a newer one, and takes
    # them back when the newer one is gone
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    old = AdamW([w], lr=0.1, gradient_release=True)
    scheduler = torch.optim.lr_scheduler.StepLR(old, 10)
    new = fastoptim.SGD([w], lr=0.01)
    if newer == "fastoptim, dropped":
        del new
        gc.collect()
        (w * w).sum().backward()
        assert w.grad is None and old.state[w]["step"] == 1  # the older one released it
        return
    start = w.detach().clone()
    (w * w).sum().backward()
    assert w.grad is not None and len(old.state) == 0
    new.step()
    assert torch.equal(w.detach(), start - 0.01 * 2 * start)
    assert scheduler.last_epoch == 0
