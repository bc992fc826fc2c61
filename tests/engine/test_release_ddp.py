"""Gradient release tied to DDP (``opt.release_with(ddp_model)``, ``engine.release_ddp``) in one process: a
world of one rank (gloo), where DDP runs its reducer and comm hooks as on many, and three ranks as threads of this
process, where scaling by 1/3 rounds. The checks on ranks of their own processes, bit for bit against plain DDP with
different data on each rank, are dist_worker.py's (test_distributed.py)."""

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from fastoptim import AdamW


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Linear(32, 4))


def _train(release, view, steps=3, group=None, rank=0, net=None, accumulate=True):
    """Each step: a no_sync micro-batch, a synced one under opt.accumulating() (reduced, not stepped; not where
    ``accumulate`` is False), then the synced one that steps. Returns the params and the grads left after each
    stepping backward. ``group``: DDP's process group (None: the default one); each rank draws its own data."""
    net = _model() if net is None else net
    opt = AdamW(net.parameters(), lr=1e-2, gradient_release=release)
    ddp = DistributedDataParallel(net, process_group=group, bucket_cap_mb=0.002, gradient_as_bucket_view=view)
    if release:
        opt.release_with(ddp)
    g = torch.Generator().manual_seed(1 + rank)
    left = []
    for _ in range(steps):
        with ddp.no_sync():
            ddp(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
        if accumulate:
            with opt.accumulating():
                ddp(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
        ddp(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
        left.append([p.grad is not None for p in net.parameters()])
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in net.parameters()], left, opt


@pytest.mark.parametrize("view", [False, True])
def test_ddp_release_matches_plain_ddp_and_leaves_no_grad(one_rank, view):
    reference, _, _ = _train(False, view)
    params, left, opt = _train(True, view)
    assert all(torch.equal(a, b) for a, b in zip(params, reference))
    assert left == [[False] * 6] * 3  # every grad set to None at the end of the stepping backward
    assert opt._release.ddp.buckets_stepped > 3  # the tie stepped (several buckets a backward after the first)
    assert opt._release.flushes == opt._release.ddp.buckets_stepped


class _Checkpointed(torch.nn.Module):
    """Three checkpointed segments between an input layer and a head."""

    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.embed, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
                                          for _ in range(3))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("view", [False, True])
def test_ddp_release_under_activation_checkpointing(one_rank, view, reentrant):
    # reentrant: DDP's buckets fill inside the segments' backwards (graph tasks inside the outer one), and the last
    # one where DDP queues its end-of-backward callback: each bucket steps once, after DDP wrote back, no grad left
    # (three steps: DDP rebuilds its buckets after the first)
    reference, _, _ = _train(False, view, net=_Checkpointed(reentrant), accumulate=False)
    params, left, opt = _train(True, view, net=_Checkpointed(reentrant), accumulate=False)
    assert all(torch.equal(a, b) for a, b in zip(params, reference, strict=True))
    assert left == [[False] * 10] * 3
    assert opt._release.ddp.buckets_stepped > 3


def test_release_with_refuses_what_it_cannot_do(one_rank):
    net = _model()
    ddp = DistributedDataParallel(net)
    with pytest.raises(RuntimeError, match="gradient_release=False"):
        AdamW(net.parameters()).release_with(ddp)
    opt = AdamW(net.parameters(), gradient_release=True)
    with pytest.raises(TypeError, match="DistributedDataParallel model, got Sequential"):
        opt.release_with(net)
    with pytest.raises(NotImplementedError, match="max_grad_norm=1.0 .* measuring backward would itself run DDP"):
        AdamW(net.parameters(), gradient_release=True, max_grad_norm=1.0).release_with(ddp)
    with pytest.raises(NotImplementedError, match="find_unused_parameters=True"):
        opt.release_with(DistributedDataParallel(_model(), find_unused_parameters=True))
    assert opt._release.ddp is None  # nothing changed by the refusals
    opt.release_with(ddp)
    with pytest.raises(RuntimeError, match="already tied"):
        opt.release_with(ddp)


def test_a_bad_group_is_refused_before_any_ddp_bucket_steps(one_rank):
    # the last layer's DDP bucket is reduced and steps first: the first group's bad lr must be refused before it
    net = _model()
    opt = AdamW([{"params": net[0].parameters()}, {"params": [p for m in net[1:] for p in m.parameters()]}],
                lr=1e-2, gradient_release=True)
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.002)
    opt.release_with(ddp)
    ddp(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    before, stepped = [p.detach().clone() for p in net.parameters()], opt._release.ddp.buckets_stepped
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid lr"):
        ddp(torch.randn(4, 16)).pow(2).mean().backward()
    assert opt._release.ddp.buckets_stepped == stepped
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def _on_ranks(run, world):
    """``run(group, rank)`` on ``world`` ranks, each a thread of this process with a gloo process group of its own
    over one in-memory store (no default group is made). Returns the results by rank."""
    store = dist.HashStore()
    results, errors = {}, []

    def rank_main(rank):
        try:
            backend = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
            group = dist.ProcessGroup(store, rank, world)  # (put together as dist.new_group does)
            group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
            group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
            results[rank] = run(group, rank)
        except BaseException as e:  # (the other ranks then wait in a collective until the timeout)
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(world)]
    active = DistributedDataParallel._active_ddp_module
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:  # DDP's forward saves and restores one class-wide "active module": threads interleaving their forwards
        # can leave another rank's set, and torch.compile then compiles every later graph for DDP
        DistributedDataParallel._active_ddp_module = active
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


@pytest.mark.parametrize("view", [False, True])
def test_ddp_release_on_three_ranks_scales_grads_as_plain_ddp_bit_for_bit(view):
    """Three ranks with different data: DDP scales each grad by 1/3, which rounds (x / 3 is not x * (1 / 3) in
    fp32), so the tie must scale as DDP's reducer does: times the reciprocal where a grad is copied into the
    bucket, divided where it was the bucket's view already (``view``: the synced backward under
    opt.accumulating() leaves it so)."""
    nets = [_model() for _ in range(6)]  # (made here: the ranks' threads share torch's global generator)
    reference = _on_ranks(lambda group, rank: _train(False, view, group=group, rank=rank, net=nets[rank])[0], 3)
    released = _on_ranks(lambda group, rank: _train(True, view, group=group, rank=rank, net=nets[3 + rank]), 3)
    for rank in range(3):
        params, left, opt = released[rank]
        off = max((a - b).abs().max().item() for a, b in zip(params, reference[rank]))
        assert off == 0.0, f"rank {rank}: {off} off plain DDP"
        assert left == [[False] * 6] * 3 and opt._release.ddp.buckets_stepped > 3
