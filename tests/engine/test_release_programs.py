"""Gradient release in user programs that once differed from the ordinary loop: each equal now, or refused.

Each check runs one program twice, with ``gradient_release=True`` and without, from the same params and data, and
compares params (and, with clipping, the norm reported) bit for bit, as ``test_release.py`` does.
"""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastoptim import SGD, AdamW

TINY = 1e-6  # release_bucket_mb: every param is its own bucket


def _make(cls, params, released, **hyper):
    if released:
        hyper.update(gradient_release=True, release_bucket_mb=TINY)
    return cls(params, **hyper)


def _backward(opt, loss, released):
    """The documented loop: with clipping, a measuring backward first."""
    if released and opt.max_grad_norm is not None:
        with opt.measure_grad_norm():
            loss.backward(retain_graph=True)
    loss.backward()


def _assert_same(run, steps=3):
    ours, opt_ours = run(True, steps)
    theirs, opt_theirs = run(False, steps)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), f"param {i} differs by {(a.double() - b.double()).abs().max().item()}"
    if opt_theirs.max_grad_norm is not None:
        assert torch.equal(opt_ours.last_grad_norm, opt_theirs.last_grad_norm), \
            (opt_ours.last_grad_norm, opt_theirs.last_grad_norm)


def test_a_param_unfrozen_after_the_optimizer_was_made_steps_on_its_grad_once():
    """Progressive unfreezing: a param with requires_grad=False when the optimizer is made gets no hooks. The
    measuring backward then leaves its real grad in place, the stepping backward adds the same grad again, and
    step() moves it by twice its grad."""
    def run(released, steps):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        model[0].weight.requires_grad_(False)
        opt = _make(SGD, model.parameters(), released, lr=0.1, max_grad_norm=0.5)
        model[0].weight.requires_grad_(True)
        for step in range(steps):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
            _backward(opt, model(x).pow(2).sum(), released)
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()], opt
    _assert_same(run)


def _shared_across_a_checkpoint(cls, **hyper):
    def run(released, steps):
        torch.manual_seed(0)
        shared, head = nn.Linear(8, 8), nn.Linear(8, 2)
        params = [*shared.parameters(), *head.parameters()]
        opt = _make(cls, params, released, **hyper)
        for step in range(steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            h = torch.tanh(shared(x))
            h = checkpoint(lambda t: torch.tanh(shared(t)), h, use_reentrant=True)  # a backward inside backward
            _backward(opt, head(h).pow(2).sum(), released)
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in params], opt
    return run


def test_a_param_used_inside_and_outside_a_reentrant_checkpoint_is_refused():
    """Reentrant checkpointing runs the block's backward as a graph task of its own: a param used inside the block
    and outside it gets its grad accumulated in both tasks, its hook fires in each, and it would step twice, each
    time on part of its grad. The second is refused by name (use_reentrant=False steps once: equal)."""
    with pytest.raises(RuntimeError, match="second grad to step on.*use_reentrant=False"):
        _shared_across_a_checkpoint(SGD, lr=0.1, momentum=0.9)(True, 1)


def test_the_measured_norm_counts_the_grads_of_a_reentrant_checkpoint():
    """A reentrant checkpoint's inner backward is a graph task of its own: the norms measured before it and after it
    all count (each task's end takes the window's norm so far; the last one counts)."""
    def run(released, steps):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
        opt = _make(SGD, model.parameters(), released, lr=0.1, max_grad_norm=0.5)
        for step in range(steps):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
            h = checkpoint(lambda t: model[2](torch.tanh(t)), model[0](x), use_reentrant=True)
            _backward(opt, model[4](torch.tanh(h)).pow(2).sum(), released)
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()], opt
    _assert_same(run)


def test_the_measured_norm_is_taken_in_the_params_dtype_as_the_step_takes_it():
    """``p.grad_dtype = torch.float32`` on a bf16 param: the ordinary step casts the grad to the param's dtype and
    clips by the bf16 norm; the measuring pass takes the norm of the fp32 grad."""
    def run(released, steps):
        weight = nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).bfloat16())
        weight.grad_dtype = torch.float32
        bias = nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(2)).bfloat16())
        opt = _make(AdamW, [weight, bias], released, lr=1e-2, max_grad_norm=0.1)
        for step in range(steps):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).bfloat16()
            _backward(opt, (x @ weight + bias).float().pow(2).sum(), released)
            opt.step()
            opt.zero_grad()
        return [weight.detach(), bias.detach()], opt
    _assert_same(run)


def test_a_grad_hook_registered_after_the_optimizer_counts_in_the_measured_norm():
    """Per-param grad clamping by ``register_hook`` after the optimizer was made: the measuring hook runs first
    and takes the norm of the unclamped grad; the ordinary step clips by the norm of the clamped one."""
    def run(released, steps):
        params = [nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(i))) for i in range(3)]
        opt = _make(SGD, params, released, lr=0.1, max_grad_norm=1.0)
        for p in params:
            p.register_hook(lambda g: g.clamp(-0.5, 0.5))
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            loss = sum((p * torch.randn(p.shape, generator=g)).sum() * 3 for p in params)
            _backward(opt, loss, released)
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in params], opt
    _assert_same(run)


def test_train_refuses_compile_with_gradient_release_and_clipping():
    """``--compile --gradient-release`` with clipping: the measuring backward keeps the graph (retain_graph=True),
    which a torch.compile'd model's backward refuses (donated buffers); refused before anything is built."""
    from fastoptim.train.loop import TrainConfig, check_config
    with pytest.raises(ValueError, match="--compile and clipping"):
        check_config(TrainConfig(compile=True, gradient_release=True))
    check_config(TrainConfig(compile=True, gradient_release=True, max_grad_norm=None))
