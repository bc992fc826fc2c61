"""Gradient release: the step runs inside backward, bucket by bucket, as grads become ready.

A hook on each param (``register_post_accumulate_grad_hook``: it fires once a backward has written the param's
whole grad) puts the param in the *ready* bucket. When the bucket's grads reach ``bucket_bytes``, and at the end
of backward (an autograd engine callback), the driver calls down into the optimizer's stepper
(``Stepper.step_params``: the same plan, dispatcher and paths as ``opt.step()``, on those params alone) and the
bucket's grads are freed together.
So a model's grads never all live at once, and the step's math is the ordinary step's: each param steps once
on its whole grad, with the hyper-parameters its group holds when its bucket steps.

A backward under ``accumulating()`` (or while accelerate says the gradients do not sync) steps nothing: its
grads add up as usual, and the next backward steps on their sum. ``opt.step()`` steps whatever has a grad left
(a backward that accumulated, grads set by hand); ``zero_grad()`` stays valid.

A second stepping backward before ``opt.step()`` or ``zero_grad()`` is refused (``RELEASED_TWICE``): torch.optim
would step once on the sum of both grads. That also catches Lightning's accumulating micro-batches, whose backward
runs outside ``optimizer.step`` with nothing global to say so (``integrations.lightning.GradientRelease`` says it).

A backward run inside the stepping one (reentrant checkpointing: each segment's recompute backpropagates from its
Function's backward, as a graph task of its own) is part of it (``release_state.Backward``): its params join the
same bucket, and the outer backward's end steps what is left. A param used in two such segments, or in one and
outside it, gets its grad in two parts, and the second is refused as above.

Under torch.distributed with world size > 1 a param's hook sees its local grad: it is refused at its first
backward, unless the optimizer is tied to the DDP model (``opt.release_with(ddp_model)``, ``release_ddp``), whose
comm hook then steps each DDP bucket after its all-reduce while these hooks step nothing.

The hooks hold the optimizer's stepper weakly: an optimizer that is gone steps nothing, and its hooks are removed.
A param is released by the newest optimizer that hooked it (``OWNERS``): an optimizer made anew over the same params
(a reload, a trainer's setup run twice) takes over, and one not yet collected never steps them a second time.
"""

from __future__ import annotations

import weakref

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ..storage.state import is_dtensor
from . import release_ddp
from .release_norm import NormPass, counting
from .release_state import FREED, OWNERS, Backward, accelerate_accumulates, accelerate_scales, forget, owns

MAX_BUCKET_BYTES = 32 << 20   # the default bucket: 1/32 of the params' bytes, at most this
MIN_BUCKET_BYTES = 1 << 20    # ... and at least this: each bucket's step has a fixed Python cost (measured in
                              # docs/performance.md) that a smaller model's few saved bytes do not pay for
BUCKETS_PER_MODEL = 32


def default_bucket_bytes(params: list[Tensor]) -> int:
    """How many grad bytes a bucket collects before it steps: about 1/32 of the params' bytes (so about 97 % of
    the grads are freed before the next ones are made), between 1 MiB and 32 MiB."""
    total = sum(p.numel() * p.element_size() for p in params)
    return int(min(MAX_BUCKET_BYTES, max(MIN_BUCKET_BYTES, total // BUCKETS_PER_MODEL)))


class Release:
    """One optimizer's hooks and its ready bucket."""

    def __init__(self, stepper, bucket_bytes: int | None):
        self.stepper = weakref.ref(stepper, lambda _: self.remove())  # (what it calls down into)
        stepper.overlapping = True  # (its buckets' plans and the step's may hold the same params)
        self.ref = weakref.ref(self)
        self.hooked: set[int] = set()  # id(param) of the params hooked (an entry goes with its param)
        self.bucket_bytes = bucket_bytes
        self.handles = WeakIdKeyDictionary()  # param -> its hook's handle
        self.released: set[int] = set()  # params given to a bucket since the last step() (a second grad is refused)
        self.stepped: set[int] = set()  # params stepped in backward, their grads freed, since the last step()
        self.ready: list[Tensor] = []
        self.ready_bytes = 0
        self.backward = Backward(self._end_of_backward)  # the stepping backward running, whose end steps what is left
        self.world = 1  # torch.distributed's world size, read at the start of each backward
        self.accumulates = False  # whether accelerate says this backward accumulates, read at its start
        self.paused = 0  # ``accumulating()`` depth
        self.flushes = 0  # buckets stepped (tests check that release ran)
        self.norm: NormPass | None = None  # max_grad_norm's measuring backward (``release_norm``)
        self.ddp: release_ddp.DDPTie | None = None  # ``opt.release_with(ddp_model)``: DDP's comm hook steps
        if stepper.settings.max_grad_norm is not None:
            self.measuring()

    def measuring(self) -> NormPass:
        """The norm pass's hooks (made at first use: ``max_grad_norm`` may be set after construction)."""
        if self.norm is None:
            self.norm = NormPass(self.stepper())
            self.norm.hook(self._params())
        return self.norm

    def hook(self, params) -> None:
        """Hook each param not hooked yet (a param in two groups is refused by torch before it gets here)."""
        for p in params:
            if p.requires_grad and p not in self.handles:  # (a frozen param is hooked once it requires grad)
                self.handles[p] = p.register_post_accumulate_grad_hook(self._ready)
                if id(p) not in OWNERS:
                    weakref.finalize(p, forget, id(p))  # (runs as p goes, before its id can be reused)
                weakref.finalize(p, self.hooked.discard, id(p))
                self.hooked.add(id(p))
                OWNERS[id(p)] = self.ref
        if self.norm is not None:
            self.norm.hook(params)
        if self.bucket_bytes is None:
            self.bucket_bytes = default_bucket_bytes(self._params())

    def alive(self) -> bool:
        """Whether its optimizer is still there (``release_state.owns``)."""
        return self.stepper() is not None

    def window_factor(self):
        """The clip factor ``opt.step()`` steps what backward left by: the measured norm's, where one was."""
        return None if self.norm is None else self.norm.factor

    def step(self, stepper, params: list[Tensor]) -> list[Tensor]:
        """A released bucket's step, clipped by the measured norm with ``max_grad_norm`` (refused where none was
        measured); returns the params stepped."""
        factor = None if stepper.settings.max_grad_norm is None else self.measuring().take_factor()
        return stepper.step_params(params, grad_mul=factor)

    def new_window(self) -> None:
        """``step()``: the params may step in backward again."""
        self.stepped.clear()
        self.released.clear()
        self.rehook()

    def rehook(self) -> None:
        """``step()``, ``zero_grad()`` or a new measuring backward: params that started to require grad (unfrozen)
        get their hooks, and a measured norm has served its window."""
        params, hooked = self._params(), self.hooked
        if any(p.requires_grad and id(p) not in hooked for p in params):
            self.hook(params)
        if self.norm is not None:
            self.norm.end_window()

    def zeroing(self, name: str) -> None:
        """Before ``zero_grad()`` changes anything: refused after a backward that stepped params with no step()
        since, as torch.optim steps nothing on grads that zero_grad() discards."""
        if self.stepped:
            raise RuntimeError(f"{name}.zero_grad() after a backward that stepped {len(self.stepped)} params inside "
                               f"it (gradient_release=True), with no opt.step() since: {STEPPED_UNASKED}")

    def zeroed(self) -> None:
        """After ``zero_grad()``: a new window."""
        self.released.clear()  # (given to a bucket whose step was refused: their grads were just zeroed)
        self.rehook()

    def _params(self) -> list[Tensor]:
        stepper = self.stepper()
        return [] if stepper is None else [p for g in stepper.groups for p in g["params"]]

    def remove(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()
        if self.norm is not None:
            self.norm.remove()

    def accumulating(self):
        return counting(self, "paused")

    def _ready(self, p: Tensor) -> None:
        if self.ddp is not None and self.ddp.reduces(p):
            stepper = self.stepper()
            if not self.paused and stepper is not None:
                if id(p) in self.released:  # (as below: a second grad before the step)
                    raise RuntimeError(f"{stepper.name}: {RELEASED_TWICE}")
                self._starting(stepper)  # (this hook runs before DDP's reducer sees the grad: nothing has stepped)
            self.ddp.saw(p)  # this grad is local: DDP's comm hook steps the param after its all-reduce
            return
        if not owns(self, p):
            return
        stepper = self.stepper()
        if stepper is None or self.norm is not None and self.norm.accumulated(p) or self.paused or p.grad is None:
            return
        self._starting(stepper)
        if self.accumulates:
            return
        if self.world > 1 and not is_dtensor(p):  # a local grad (one tied to DDP returned above; FSDP2's are reduced)
            raise NotImplementedError(f"{stepper.name}: {release_ddp.refused(self.world, self.ddp is not None)}")
        if id(p) in self.released:
            raise RuntimeError(f"{stepper.name}: {RELEASED_TWICE}")
        if p.grad.is_sparse:  # (known only as it comes: buckets before it in this backward have stepped)
            raise RuntimeError(f"{stepper.name} does not support sparse gradients (param "
                               f"{stepper.param_index(p)}, shape {tuple(p.shape)}); with gradient_release=True "
                               f"{len(self.stepped)} params stepped in this backward before it")
        self.released.add(id(p))
        self.ready.append(p)
        self.ready_bytes += p.grad.numel() * p.grad.element_size()
        if self.ready_bytes >= self.bucket_bytes:
            self.flush(stepper)

    def _starting(self, stepper) -> None:
        """Once per stepping backward, at its first param: what the backward is, and what a step would refuse,
        refused before its first bucket steps; its end steps what is left. A backward inside it (reentrant
        checkpointing) adds to its bucket."""
        if not self.backward.starts():
            return
        self.world = release_ddp.world_size()
        self.accumulates = accelerate_accumulates()  # (set before a backward, read once per backward)
        self.ready, self.ready_bytes = [], 0  # (left by a backward that raised: their grads stay for step())
        if accelerate_scales():  # refused before anything steps (plain GradScaler: at its step, after)
            raise RuntimeError(f"{stepper.name}: accelerate's fp16 mixed precision: "
                               + GRADSCALER_WHY.format(moved="Nothing has stepped. "))
        if not self.accumulates:  # (an accumulating backward refuses nothing: the step will)
            stepper.check_groups()

    def _end_of_backward(self) -> None:
        stepper = self.stepper()
        if stepper is not None and self.ready:
            self.flush(stepper)

    def flush(self, stepper) -> None:
        """Step the ready bucket, then free its grads."""
        params, self.ready, self.ready_bytes = self.ready, [], 0
        stepped = self.step(stepper, params)  # (a step that raises leaves the grads for ``opt.step()``)
        self.flushes += 1
        self.freeing(stepped)

    def freeing(self, stepped: list[Tensor]) -> None:
        """The grads of params stepped in backward are freed (a param no group holds any more kept its grad, as
        torch.optim's step keeps it)."""
        for p in stepped:
            p.grad = None
        self.stepped.update(map(id, stepped))
        FREED.update(map(id, stepped))


RELEASED_TWICE = ("gradient_release=True: a param got a second grad to step on since the last opt.step() or "
                  "zero_grad(): a second backward before the step (two losses backpropagated apart), or a param "
                  "used in two segments of reentrant checkpointing, or in one and outside it (each segment's "
                  "recompute backpropagates apart), would step it again on part of its grad, where torch.optim "
                  "steps once on their sum. It stepped on the first; this one is refused. Backpropagate the "
                  "earlier ones under `with opt.accumulating():` (Lightning's accumulate_grad_batches: "
                  "callbacks=[fastoptim.integrations.lightning.GradientRelease()]), call opt.step() after each "
                  "backward, or use torch.utils.checkpoint with use_reentrant=False. (Or this optimizer is kept "
                  "alive beside a newer torch.optim optimizer over the same params: delete it)")
STEPPED_UNASKED = ("torch.optim would step nothing on that backward's grads and zero_grad() would discard them, but "
                   "release has stepped on them. A backward that is not meant to step this optimizer (a GAN's "
                   "generator backward through the discriminator, a backward for analysis) goes under `with "
                   "opt.accumulating():` (its grads stay for zero_grad() to discard), or with the params' "
                   "requires_grad off. The grads are left as they are")
KEPT_ZEROS = ("zero_grad(set_to_none=False) after an optimizer with gradient_release=True freed the grads of {n} "
              "of these params once they stepped, with no zero_grad() of fastoptim's since: torch.optim would keep "
              "them, zeroed, and step a param that the next backward does not reach on its zero grad. Use "
              "zero_grad() (set_to_none=True; once is enough where those grads were dropped meanwhile, as "
              "model.zero_grad() drops them), or gradient_release=False. Nothing was zeroed")
GRADSCALER_WHY = ("torch.amp.GradScaler cannot drive an optimizer with gradient_release=True: its buckets step inside "
                  "backward, before GradScaler has unscaled the grads or checked all of them for inf/NaN, and a step "
                  "it would skip cannot be taken back without keeping every grad. {moved}Use bf16 autocast (no "
                  "GradScaler), or gradient_release=False")
GRADSCALER_REFUSED = GRADSCALER_WHY.format(moved="The backward just run has stepped the params on scaled grads: "
                                           "reload them from a checkpoint. ")

def check(*, name: str, settings, gradient_release, release_bucket_mb, params=None) -> int | None:
    """The bucket size in bytes (None: the default), after refusing what release cannot do exactly. ``params``: the
    params to release, once they are known (the constructor's groups, a group added later). Under torch.distributed
    FSDP2 calls a sharded param's post-accumulate-grad hooks itself, after its reduce-scatter has written the reduced
    grad (none while ``set_requires_gradient_sync(False)`` accumulates), and a DTensor's grad counts its global
    size, so every rank cuts the same buckets (Muon's gathers are collectives); a plain param's hook fires as soon as
    autograd writes this rank's own grad, before DDP's all-reduce (``release_ddp``)."""
    if not isinstance(gradient_release, bool):
        raise TypeError(f"{name}: gradient_release must be True or False, got {gradient_release!r}")
    if release_bucket_mb is not None:
        if not gradient_release:
            raise ValueError(f"{name}: release_bucket_mb={release_bucket_mb!r} needs gradient_release=True")
        if isinstance(release_bucket_mb, bool) or not isinstance(release_bucket_mb, (int, float)) \
                or not release_bucket_mb > 0:
            raise ValueError(f"{name}: Invalid release_bucket_mb: {release_bucket_mb!r} (must be a number > 0)")
    if not gradient_release:
        return None
    if settings.flat:
        raise ValueError(f"{name}: flat=True with gradient_release=True: flat mode keeps every grad as a view of one "
                         "buffer per group, so freeing a bucket's grads frees no memory. Use one of them")
    if params is not None and settings.max_grad_norm is not None and release_ddp.world_size() > 1 \
            and any(is_dtensor(p) for p in params if isinstance(p, Tensor)):
        raise ValueError(f"{name}: max_grad_norm with gradient_release=True under FSDP2: the measuring backward "
                         "(measure_grad_norm) sees grads before autograd accumulates them, and FSDP2 writes the "
                         "sharded grads itself. Use max_grad_norm=None with release, or gradient_release=False")
    # (a plain param under torch.distributed with world size > 1 is refused at its first backward, unless tied to
    # DDP: ``Release._ready``; the tie comes after construction)
    return None if release_bucket_mb is None else max(1, int(release_bucket_mb * (1 << 20)))


def before_zero_grad(rel: Release | None, *, name: str, groups: list[dict], set_to_none: bool) -> None:
    """What release refuses of ``zero_grad()``, before anything changes; the freed grads it then forgets (those of
    these params, released by this optimizer or an older one over them)."""
    if rel is not None:
        rel.zeroing(name)
    if FREED:
        ids = {id(p) for group in groups for p in group["params"]} & FREED
        if ids and not set_to_none:
            raise RuntimeError(f"{name}.{KEPT_ZEROS.format(n=len(ids))}")
        FREED.difference_update(ids)
