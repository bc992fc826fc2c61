"""Gradient release under DDP: each DDP bucket steps once its all-reduce is done, on the reduced grads.

    opt = fastoptim.AdamW(model.parameters(), gradient_release=True)
    ddp_model = DistributedDataParallel(model)
    opt.release_with(ddp_model)

Under DDP a param's post-accumulate-grad hook fires before the reducer takes its grad: it sees the LOCAL grad,
so release's own hooks must not step (``Release._ready`` leaves the tied params alone, and refuses plain params
under world size > 1 without a tie). The tie registers a DDP comm hook instead. It reduces as DDP itself does
without a hook (each grad times 1/world size as it is copied into the bucket, then a summing all-reduce: torch's
``allreduce_hook`` divides instead, which rounds differently where the world size is no power of two), so the
values are plain DDP's bit for bit; a grad that was accumulated into the bucket's own view (a synced backward that
did not step, with ``gradient_as_bucket_view=True``) DDP divides in place instead, and so does the hook: the
release hook of each param notes where its grad lies before the reducer takes it (``saw``).

The hook starts each bucket's all-reduce and steps the bucket before it, whose all-reduce has had that time to run
(``wait`` first); the last one steps at the end of backward. Every step runs on the backward's own thread, in the
order of the buckets: none runs in a communication thread beside another (torch's ``_hook_then_optimizer`` steps
in the all-reduce's callback, on whichever thread completes it).

A bucket steps on its reduced grads, the views of DDP's bucket buffer (``p.grad`` is pointed at them where it was
a grad of its own: ``gradient_as_bucket_view=False``). At the end of backward, after DDP has written its results
back, the stepped params' grads are set to None (DDP would otherwise leave them, and ``opt.step()`` would step
them again). What this saves: with ``gradient_as_bucket_view=False`` each param's own grad is dropped as its bucket
steps (plain DDP keeps it beside the bucket buffer until ``zero_grad``); DDP's bucket buffers, one grad-sized
copy of all grads, stay as DDP keeps them, so the grads' memory is at least that of ``gradient_as_bucket_view=True``.

Accumulation: under ``no_sync()`` DDP runs no comm hook, so nothing steps and the grads add up; the synced backward
steps on their reduced sum. A synced backward under ``opt.accumulating()`` (or accelerate's accumulation) is
reduced, not stepped. ``max_grad_norm`` is refused (its measuring backward would itself run DDP's reduction).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .release_state import accelerate_accumulates, owns

REFUSED_UNTIED = ("gradient_release=True under torch.distributed (world size {world}): a param's release hook sees "
                  "its LOCAL grad, before DDP's all-reduce, so its bucket would step on it. Tie the optimizer to "
                  "the DDP model: `opt.release_with(ddp_model)` (the buckets then step after their all-reduce), or "
                  "choose gradient_release=False. Nothing has stepped")


def refused(world: int, tied: bool) -> str:
    """Why release cannot step a plain param's local grad under torch.distributed."""
    if tied:  # (the tied model's buckets may have stepped in this backward already)
        return (f"gradient_release=True under torch.distributed (world size {world}): this optimizer is tied to a "
                "DDP model, and a param of it outside that model has a grad (local: no all-reduce ties it). Put "
                "every param of a released optimizer into the DDP model, or give the others an optimizer without "
                "gradient_release")
    return REFUSED_UNTIED.format(world=world)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tie(rel, ddp_model, *, name: str, settings) -> "DDPTie":
    """Check, then register the comm hook (before anything of the optimizer's changes)."""
    from torch.nn.parallel import DistributedDataParallel
    if rel is None:
        raise RuntimeError(f"{name}.release_with(ddp_model) ties gradient release to DDP; this optimizer has "
                           "gradient_release=False: make it with gradient_release=True")
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"{name}.release_with() takes the DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}")
    if rel.ddp is not None:
        raise RuntimeError(f"{name} is already tied to a DDP model (one comm hook per model, one model per optimizer)")
    if settings.max_grad_norm is not None:
        raise NotImplementedError(f"{name}: max_grad_norm={settings.max_grad_norm} with gradient_release=True under "
                                  "DDP is not supported: the norm's measuring backward would itself run DDP's "
                                  "all-reduce. Clip in opt.step() (gradient_release=False), or max_grad_norm=None")
    if ddp_model.find_unused_parameters:
        raise NotImplementedError(f"{name}: gradient release under DDP with find_unused_parameters=True is not "
                                  "supported: a bucket steps before DDP knows which params no rank used (plain "
                                  "DDP leaves their grads None, and opt.step() skips them)")
    tied = DDPTie(rel, ddp_model)
    ddp_model.register_comm_hook(ddp_model.process_group, tied.hook)  # (refuses a second hook: nothing changed)
    rel.ddp = tied
    return tied


class DDPTie:
    """The comm hook of one released optimizer on one DDP model, and the buckets of the backward running."""

    def __init__(self, rel, ddp_model):
        self.rel = rel  # (the Release holds its optimizer's stepper weakly; DDP's reducer holds this hook)
        self.params = WeakIdKeyDictionary({p: True for p in ddp_model.parameters() if p.requires_grad})
        self.pending: list[tuple[object, object]] = []  # (bucket, its all-reduce's future), not stepped yet
        self.stepped: list[Tensor] = []  # params stepped in this backward: their grads are set to None at its end
        self.buckets_stepped = 0  # (tests check that the tie stepped)
        self.grad_storage: dict[int, int] = {}  # id(param) -> where its grad lay as the reducer was to take it

    def saw(self, p: Tensor) -> None:
        """``p``'s release hook, which runs just before DDP's reducer takes its grad: where the grad lies."""
        self.grad_storage[id(p)] = p.grad.untyped_storage().data_ptr() if p.grad is not None else 0

    def reduces(self, p: Tensor) -> bool:
        """Whether ``p``'s grad is reduced (and stepped) by this tie: its own release hook then does nothing."""
        return p in self.params

    def hook(self, group, bucket):  # (no annotations: DDP checks them, and this module's are strings)
        """DDP's comm hook for one bucket: its all-reduce started, the bucket before it stepped."""
        buffer = bucket.buffer()
        world = group.size() if group is not None else dist.get_world_size()
        # as DDP's reducer scales each grad without a comm hook: times the reciprocal (a double, as it passes it)
        # where it copies the grad into the bucket, divided where the grad was the bucket's view already
        in_place = [self.grad_storage.pop(id(p), 0) == buffer.untyped_storage().data_ptr()
                    for p in bucket.parameters()]
        if not any(in_place):
            buffer.mul_(1.0 / world)
        else:
            for grad, was_view in zip(bucket.gradients(), in_place):
                grad.div_(world) if was_view else grad.mul_(1.0 / world)
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future().then(_first_value)
        stepper = self.rel.stepper()
        if stepper is None or self.rel.paused or accelerate_accumulates():
            return future  # accumulating: reduced, not stepped
        if bucket.index() == 0:  # a new backward (DDP reduces its buckets in order): one that raised left these
            self.pending, self.stepped = [], []
        if self.pending:  # the bucket before this one: its all-reduce has run beside the backward since
            self._step(stepper, *self.pending.pop())
        self.pending.append((bucket, future))
        if bucket.is_last():  # DDP queues its end-of-backward callback next, in this same graph task: a backward
            # inside the outer one (reentrant checkpointing's recompute) where the last bucket fills there
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        return future

    def _step(self, stepper, bucket, future) -> None:
        future.wait()
        rel, params = self.rel, []
        for p, grad in zip(bucket.parameters(), bucket.gradients()):
            if owns(rel, p):  # (an optimizer made anew over these params steps them)
                if p.grad is None or p.grad.data_ptr() != grad.data_ptr():
                    p.grad = grad  # the reduced grad (its own local one is dropped here)
                params.append(p)
        if params:
            rel.released.update(map(id, params))  # (a second grad for them before the step is refused)
            self.stepped += rel.step(stepper, params)
            rel.flushes += 1
            self.buckets_stepped += 1

    def _end_of_backward(self) -> None:
        # DDP's own end-of-backward callback (which writes the reduced grads back) was queued just after this one:
        # queued again, this runs after it
        torch.autograd.Variable._execution_engine.queue_callback(self._after_ddp)

    def _after_ddp(self) -> None:
        stepper = self.rel.stepper()
        pending, self.pending = self.pending, []
        if stepper is not None:
            for bucket, future in pending:
                self._step(stepper, bucket, future)
        stepped, self.stepped = self.stepped, []
        self.rel.freeing(stepped)


def _first_value(future) -> Tensor:
    return future.value()[0]
