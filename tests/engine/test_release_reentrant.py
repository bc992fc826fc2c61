"""Gradient release under reentrant activation checkpointing (``use_reentrant=True``): each segment's recompute
backpropagates from its Function's backward, a graph task inside the stepping one. The params outside the segments
(a final norm and a head, whose grads come first) wait in a bucket while the segments' backwards run; every param
steps inside backward once, on its whole grad, and the params equal the ordinary loop's bit for bit.
"""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastoptim import AdamW

BUCKET_MB = 1000 / 2**20  # under one segment's grads: buckets mix params of the outer backward and the segments'


class Net(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh()) for _ in range(3))
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) if self.reentrant is None else checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(self.norm(h))


def _run(released, reentrant, max_grad_norm, steps=3, micro=2):
    """``micro`` micro-batches a step, all but the last under ``opt.accumulating()``; with clipping the last is
    measured first. Returns the params, the optimizer, and which params held a grad after each stepping backward."""
    net = Net(reentrant)
    opt = AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=max_grad_norm,
                gradient_release=released, release_bucket_mb=BUCKET_MB if released else None)
    g = torch.Generator().manual_seed(1)
    held = []
    for _ in range(steps):
        for k in range(micro):
            loss = net(torch.randn(4, 8, generator=g)).pow(2).mean() / micro
            if k < micro - 1:
                with opt.accumulating():
                    loss.backward()
                continue
            if released and max_grad_norm is not None:
                with opt.measure_grad_norm():
                    loss.backward(retain_graph=True)
            loss.backward()
        held.append([name for name, p in net.named_parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in net.parameters()], opt, held


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
@pytest.mark.parametrize("reentrant", [True, False, None])
def test_every_param_steps_inside_backward_as_the_ordinary_loop(reentrant, max_grad_norm):
    params, opt, held = _run(True, reentrant, max_grad_norm)
    reference, ordinary, _ = _run(False, reentrant, max_grad_norm)
    assert held == [[]] * 3  # every param stepped inside backward: none left for opt.step()
    assert opt._release.flushes >= 4 * 3  # several buckets a backward
    for i, (a, b) in enumerate(zip(params, reference, strict=True)):
        assert torch.equal(a, b), f"param {i} differs by {(a - b).abs().max().item()}"
    if max_grad_norm is not None:
        assert torch.equal(opt.last_grad_norm, ordinary.last_grad_norm)
        assert ordinary.last_grad_norm > max_grad_norm  # the clipping acts


def test_a_backward_that_raised_inside_a_segment_leaves_the_next_backward_whole():
    # the outer backward has started (the head waits in the bucket) when a segment's backward raises: both graph
    # tasks are gone, their end callbacks never run. The next backward is a new one, not one inside them: it steps
    # every param by its end, as the ordinary loop steps them
    def run(released):
        net = Net(True)
        opt = AdamW(net.parameters(), lr=1e-2, gradient_release=released)  # (one bucket: it steps at the end)
        boom = [True]

        def once(grad):
            if boom[0]:
                boom[0] = False
                raise FloatingPointError("nan")
        net.blocks[2][0].weight.register_hook(once)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        with pytest.raises(FloatingPointError):
            net(x).pow(2).mean().backward()
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        held = [name for name, p in net.named_parameters() if p.grad is not None]
        opt.step()
        return [p.detach() for p in net.parameters()], held
    params, held = run(True)
    reference, _ = run(False)
    assert held == []
    assert all(torch.equal(a, b) for a, b in zip(params, reference, strict=True))


def test_a_param_in_two_reentrant_segments_is_refused():
    # its grad comes in two parts, one in each segment's backward: the second part is refused (the first stepped);
    # the measuring backward refuses it before anything steps
    torch.manual_seed(0)
    embed, shared, head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
    params = [*embed.parameters(), *shared.parameters(), *head.parameters()]

    def loss():
        h = embed(torch.randn(4, 8))
        for _ in range(2):
            h = checkpoint(lambda t: torch.tanh(shared(t)), h, use_reentrant=True)
        return head(h).pow(2).mean()
    opt = AdamW(params, lr=1e-2, gradient_release=True)
    with pytest.raises(RuntimeError, match="second grad to step on.*used in two segments of reentrant checkpointing"):
        loss().backward()
    del opt
    for p in params:
        p.grad = None
    opt = AdamW(params, lr=1e-2, max_grad_norm=1.0, gradient_release=True)
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="measured twice.*two segments of reentrant checkpointing.*Nothing has"):
        with opt.measure_grad_norm():
            loss().backward()
    assert all(torch.equal(a, b) for a, b in zip(params, before)) and not opt.state
