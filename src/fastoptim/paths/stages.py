"""Rules beyond elementwise: each level runs a rule's ``stages`` in order over a bucket.

* ``Elementwise`` stages run through the level itself, exactly as an elementwise rule's ``update`` does (the
  fused level's Triton kernel on CUDA, the compiled or blocked foreach path on the CPU), over the states and
  scratch tensors the stage names.
* ``PerTensor`` stages run one tensor at a time on the loop level (a batch of one) and, on the other levels,
  once per shape group: the group's tensors stacked on a leading dim, one batched call for all of them (the
  compiled level compiles it). Stacking costs a copy of what the stage reads and writes back, which pays
  where calls are many and small; a group of large tensors that are not already one buffer (scratch is)
  runs one tensor at a time instead, as views (``STACK_MAX_NUMEL``). The compiled level hands the compiled stage
  contiguous batches, as vectors where the stage is declared ``flat``, and runs tensors of at most one element
  eagerly: layouts, ranks and sizes 0 and 1 would each compile a graph of their own (``_canonical``).

On sharded params (FSDP2, HSDP) a per-tensor stage runs each whole tensor on one rank of its shard group, or
on each rank's own rows where the stage declares whole dim-0 slices enough (``sharded``).

Grads are scaled (GradScaler, clipping) once, into temporaries, by the dispatcher before the first stage.

Scratch tensors live only while their params step. A rule with scratch runs all its stages over one *chunk* of
the bucket after another: shape groups packed up to ``SCRATCH_CHUNK_BYTES`` of scratch (more on a GPU), a larger
group in runs of as many tensors as fit (at least one). Each chunk's scratch is made for it, one buffer per shape
group (a per-tensor stage takes a group's scratch as it is, with no stacking copy), and freed after it. So scratch
adds nothing to the memory held between steps, and at most a chunk's worth to the step's peak, where a scratch as
large as the params would double a Muon's or LAMB's state. On sharded params the bucket is one chunk: every rank
must run the same exchanges in the same order, and their local shapes differ.
"""

from __future__ import annotations

import types
from functools import lru_cache
from typing import Callable

import torch
from torch import Tensor

from . import sharded
from .base import Bucket, Path, StepContext, compiled_scalars, subset
from .record import took


class StageRule:
    """An ``Elementwise`` stage seen by a path as an elementwise rule of its own."""
    torch_fused = None
    stages = ()

    def __init__(self, rule, index: int, stage):
        self.name = f"{rule.name}_stage{index}"
        self.update = stage.update
        self.state_names = stage.tensors


@lru_cache(maxsize=None)
def stage_rule(rule, index: int) -> StageRule:
    return StageRule(rule, index, rule.stages[index])


# a chunk's scratch (all its names together) stays under this many bytes, unless a single tensor's is larger. On
# the CPU: large enough that same-shape matrices still batch (4 x 1024^2 fp32 is 16 MiB), small enough that a
# Muon step peaks no higher than torch.optim.Muon's one matrix at a time. On a GPU, larger: a batched product
# fills the device only with more matrices, and 256 MiB is a small part of its memory.
SCRATCH_CHUNK_BYTES = 16 << 20
SCRATCH_CHUNK_BYTES_GPU = 256 << 20


def chunks(params: list[Tensor], n_scratch: int, whole: bool = False) -> list[list[int]]:
    """The bucket's params in chunks that each step with their own scratch (module docstring): shape groups in
    order of their first param, packed up to ``SCRATCH_CHUNK_BYTES`` (``_GPU`` off the CPU); ``whole``: one
    chunk."""
    if whole or not n_scratch or not params:
        return [list(range(len(params)))]
    budget = SCRATCH_CHUNK_BYTES if params[0].device.type == "cpu" else SCRATCH_CHUNK_BYTES_GPU
    out, current, size = [], [], 0
    for members in shape_groups({"param": params}, ("param",)):
        p = params[members[0]]
        each = p.numel() * p.element_size() * n_scratch
        fit = max(1, budget // each) if each else len(members)
        for start in range(0, len(members), fit):
            run = members[start:start + fit]
            if current and size + each * len(run) > budget:
                out.append(sorted(current))
                current, size = [], 0
            current += run
            size += each * len(run)
    return out + [sorted(current)] if current else out


def _scratch(params: list[Tensor], names: tuple[str, ...]) -> tuple[dict[str, list[Tensor]], dict[tuple, Tensor]]:
    """New scratch for ``params``: per name, one tensor per param (views of one buffer per shape group), and
    those buffers by (name, the group's indices)."""
    views: dict[str, list] = {name: [None] * len(params) for name in names}
    buffers = {}
    for members in shape_groups({"param": params}, ("param",)):
        p = params[members[0]]
        for name in names:
            buffers[name, tuple(members)] = buffer = torch.empty((len(members), *p.shape), dtype=p.dtype,
                                                                 device=p.device)
            for i, view in zip(members, buffer.unbind(0)):
                views[name][i] = view
    return views, buffers


class Stages(Path):
    """One step of a staged rule over a bucket at the level ``ctx.impl``; the dispatcher hands it scaled grads."""
    name = "stages"
    records = False  # each per-tensor stage reports itself, each elementwise stage through its own path

    def run(self, part: Bucket, ctx: StepContext) -> None:
        rule = ctx.rule
        pieces = part.cache.get("stage_chunks")
        if pieces is None or part.transient:  # (fixed while the cache lives: the plan's buckets keep their params)
            pieces = part.cache["stage_chunks"] = chunks(part.params, len(rule.scratch), part.sharded is not None)
        for indices in pieces:
            self._run_chunk(part if len(pieces) == 1 else subset(
                part, indices, part.cache.setdefault(("stage_chunk", tuple(indices)), {})), ctx)

    @staticmethod
    def _run_chunk(part: Bucket, ctx: StepContext) -> None:
        rule, impl, scalars, flags = ctx.rule, ctx.impl, ctx.scalars, ctx.flags
        params = part.params
        tensors: dict[str, list | None] = {"param": params, "grad": part.grads}
        tensors.update(zip(rule.state_names, part.states))
        scratch, stacked = _scratch(params, rule.scratch)
        tensors.update(scratch)
        for index, stage in enumerate(rule.stages):
            if hasattr(stage, "update"):
                lists = [tensors[name] for name in stage.tensors]
                # (scratch is new each chunk and step: a path keeps only what holds for new tensors alike)
                one = Bucket(params, tensors["grad"], lists, part.cache.setdefault(("stage", index), {}),
                             transient=part.transient or bool(rule.scratch))
                ctx.run_plain(one, ctx.but(rule=stage_rule(rule, index), grad_mul=None))
            elif part.sharded is not None:
                sharded.per_tensor(impl, stage, tensors, scalars, flags, part.sharded,
                                   lambda *args: _per_tensor(*args[:3], {}, *args[3:]))  # (gathered: no scratch)
            else:
                _per_tensor(impl, stage, tensors, stacked, scalars, flags)


STAGES = Stages()


def shape_groups(tensors: dict[str, list | None], names: tuple[str, ...]) -> list[list[int]]:
    """Indices of the tensors that stack together: the same shape, dtype and device in every named role."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(tensors["param"]):
        key = tuple((t[i].shape, t[i].dtype, t[i].device) for t in (tensors[n] for n in names) if t is not None)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


# tensors of at most this many elements are stacked for a batched call; larger ones (unless already one buffer)
# step one at a time: a copy of each costs more than the call it saves
STACK_MAX_NUMEL = 1 << 16


# the path (``record_paths``) a per-tensor stage takes at each level
PER_TENSOR_PATHS = {"loop": "stage_loop", "foreach": "stage_batched", "fused": "stage_batched",
                    "auto": "stage_batched", "compiled": "stage_compiled"}


def _per_tensor(impl: str, stage, tensors: dict, stacked: dict, scalars: tuple, flags: tuple) -> None:
    n = len(tensors["param"])
    took(PER_TENSOR_PATHS[impl])
    if impl == "loop":
        groups = [[i] for i in range(n)]
    else:
        groups = []
        for members in shape_groups(tensors, stage.reads + stage.writes):
            ready = all(tensors[name] is None or (name, tuple(members)) in stacked
                        for name in stage.reads + stage.writes)
            small = tensors["param"][members[0]].numel() <= STACK_MAX_NUMEL
            groups += [members] if ready or small or len(members) == 1 else [[i] for i in members]
    fn = stage.fn
    written = tuple(stage.reads.index(name) for name in stage.writes) if stage.in_place else None
    if impl == "compiled":
        fn = _compiled(stage.fn, flags, len(scalars), written)
    for members in groups:
        batch = [None if tensors[name] is None else stacked.get((name, tuple(members)))
                 if (name, tuple(members)) in stacked else _stack([tensors[name][i] for i in members])
                 for name in stage.reads]
        # a tensor of at most one element runs eagerly: Dynamo specialises sizes 0 and 1, so each such shape would
        # compile a graph of its own, to save nothing
        compiled = impl == "compiled" and tensors["param"][members[0]].numel() > 1
        if compiled:
            scalars_t = compiled_scalars(scalars, tensors["param"][members[0]].device, batch[0].dtype)
            out = fn(_canonical(batch, stage.flat), scalars_t)
            out = [None if new is None or tensors[name] is None else new.reshape(
                (len(members), *tensors[name][members[0]].shape)) for name, new in zip(stage.writes, out)]
        else:
            out = stage.fn(*batch, *scalars, *flags)
        if stage.in_place and not compiled:  # written into the batch: a target's own view, the stacked
            out = [batch[k] for k in written]  # scratch, or a stacked copy
        for name, new in zip(stage.writes, out):
            if tensors[name] is None:
                continue
            targets = [tensors[name][i] for i in members]
            if (name, tuple(members)) in stacked:
                if new is not stacked[name, tuple(members)]:
                    stacked[name, tuple(members)].copy_(new)
            elif len(targets) == 1:
                if not new[0].is_set_to(targets[0]):
                    targets[0].copy_(new[0])
            else:
                torch._foreach_copy_(targets, list(new.unbind(0)))


def _canonical(batch: list, flat: bool) -> list:
    """The batch as the compiled stage sees it, so that fewer layouts make graphs of their own: contiguous (a
    strided layout would be a graph of its own), and for a ``flat`` stage each tensor as a vector, (n, numel) (so
    every rank shares one graph); not views (``detach``: Dynamo guards on a view's base too)."""
    return [None if t is None else (t.reshape(t.shape[0], -1) if flat else t).contiguous().detach() for t in batch]


def _stack(ts: list[Tensor]) -> Tensor:
    # (detached: a param's view would carry requires_grad, and the compiled stage recompile for it)
    return ts[0].detach().unsqueeze(0) if len(ts) == 1 else torch.stack(ts)


def _stage_body(batch: list, scalars: Tensor):
    """The compiled stage: ``FN``, ``FLAGS`` and ``WRITTEN`` are globals of each compiled copy (``_compiled``)."""
    if WRITTEN is None:  # noqa: F821
        return FN(*batch, *scalars.unbind(0), *FLAGS)  # noqa: F821
    batch = [t.clone() if k in WRITTEN and t is not None else t for k, t in enumerate(batch)]  # noqa: F821
    FN(*batch, *scalars.unbind(0), *FLAGS)  # noqa: F821
    return [batch[k] for k in WRITTEN]  # noqa: F821


@lru_cache(maxsize=None)
def _compiled(fn: Callable, flags: tuple, n_scalars: int, written: tuple | None = None) -> Callable:
    """``fn`` compiled, with the step's scalars as one tensor (lr or beta changes never recompile) and FLAGS
    baked in. An in-place stage (``written``: the positions of what it writes) is compiled as a function of its
    arguments that returns the written values, which the caller copies back. Each compiled copy is
    ``_stage_body`` with ``fn``, ``flags`` and ``written`` as its globals, not a closure: Inductor (torch 2.13) failed
    to build Adafactor's in-place stage on batches of vectors when they came from a closure's cells."""
    names = dict(_stage_body.__globals__, FN=fn, FLAGS=flags, WRITTEN=written)
    code = _stage_body.__code__.replace(co_name=f"{fn.__name__}_stage")  # its own code object: its own cache
    stage = types.FunctionType(code, names, code.co_name)
    return torch.compile(stage, dynamic=True)  # (a stage may keep a part eager: ``torch.compiler.disable``)
