"""Per-tensor stages on sharded params: FSDP2's DTensors, Shard(0) over one mesh dim (a 1-D mesh, or HSDP's
2-D mesh, ``(Replicate(), Shard(0))``).

A per-tensor stage (Muon's Newton-Schulz, Adafactor's row and column means) needs each whole tensor, and a
rank holds only its shard of rows. The ranks that split a tensor are those of the shard mesh dim's process group
(``mesh.get_group(dim)``); under HSDP each replicate group holds the same grads (FSDP2 reduces them across
replicas), so each works out the same whole tensors on its own, with no traffic between replicas. Within that
group each tensor gets one owner rank (``assign``: largest first to the least loaded rank, by an estimate of the
stage's cost; the same answer on every rank, since every rank sees the same global shapes in the same order).
One step of a stage over a bucket is then:

  1. one ``all_to_all_single``: every rank sends its shard of each tensor the stage ``reads`` to that tensor's
     owner, which stitches the shards into whole tensors (uneven shards, and empty ones, as DTensor splits them);
  2. each owner runs the stage on the tensors it owns, batched by shape as on one process;
  3. one ``all_to_all_single`` back: the owner sends each rank its rows of every tensor the stage ``writes``.

No rank repeats another's work within its group, and an element crosses the network at most once each way: per
step, the elements of the ``reads`` of every sharded tensor, then of its ``writes``, each times (W - 1) / W for
a group of W ranks, summed over all ranks (the owner's own rows stay put).

Not gathered at all: a tensor whole on every rank (Replicate(), or Shard(0) over a mesh dim of one rank), and one
whose stage declares its dim-0 slices independent (``PerTensor.local_rows``: an (E, M, N) stack of matrices, each
stepped on its own), which each rank steps on its own rows; a rank with none of its rows skips it. Any other
layout (Shard on another dim, Shard on two mesh dims) is refused.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from ..storage.state import is_dtensor


def shard_mesh_dim(owner) -> int | None:
    """The mesh dim over which ``owner``'s dim 0 is split: Shard(0) on one mesh dim, Replicate() on the others
    (FSDP2's ``(Shard(0),)``, HSDP's ``(Replicate(), Shard(0))``). None where the tensor is whole on every rank.
    Raises for any other layout, rather than run a per-tensor stage on part of a tensor."""
    placements, mesh = owner.placements, owner.device_mesh
    # a mesh dim of one rank splits nothing, whatever its placement
    split = [d for d, pl in enumerate(placements) if type(pl).__name__ != "Replicate" and mesh.size(d) > 1]
    if not split:
        return None
    if len(split) == 1 and type(placements[split[0]]).__name__ == "Shard" and placements[split[0]].dim == 0:
        return split[0]
    raise NotImplementedError(f"per-tensor stages (Muon, Adafactor) need whole tensors; params laid out as "
                              f"{tuple(placements)} on a mesh of shape {tuple(mesh.shape)} are not gathered: only "
                              f"Shard(0) on one mesh dim and Replicate() on the others is (FSDP2's (Shard(0),), "
                              f"HSDP's (Replicate(), Shard(0)))")


def shard_dim0(owner) -> bool:
    """True: split on dim 0 over some ranks (``shard_mesh_dim``); False: whole on every rank; raises for any
    other layout."""
    return shard_mesh_dim(owner) is not None


def row_split(rows: int, world: int) -> list[int]:
    """Rows on each rank under Shard(0): DTensor's split (``torch.chunk``'s), trailing ranks short or empty."""
    chunk = -(-rows // world)
    return [max(0, min(chunk, rows - chunk * r)) for r in range(world)]


def cost(shape: tuple) -> int:
    """What a per-tensor stage costs on a tensor, roughly: Newton-Schulz on a matrix is rows * cols * min(rows,
    cols) multiply-adds a round; anything else, its size."""
    size = math.prod(shape)
    return size * min(shape[-2:]) if len(shape) >= 2 else size


def assign(shapes: list[tuple], world: int) -> list[int]:
    """Each tensor's owner rank: the costliest first, each to the rank with the least work so far (ties to the
    lower rank, then the earlier tensor), so every rank works out the same owners."""
    load = [0] * world
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-cost(shapes[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += cost(shapes[i])
    return owner


def _subset(tensors: dict, members: list[int]) -> dict:
    return {name: None if ts is None else [ts[i] for i in members] for name, ts in tensors.items()}


def per_tensor(impl: str, stage, tensors: dict, scalars: tuple, flags: tuple, owners: list,
               run_local: Callable) -> None:
    """``stage`` over a bucket whose ``tensors`` are the local shards of ``owners`` (DTensors, or plain tensors
    for params that are whole here); ``run_local(impl, stage, tensors, scalars, flags)`` runs it on whole
    tensors, or on whole dim-0 slices where the stage declares them enough (``PerTensor.local_rows``)."""
    groups: dict = {}
    here = []
    for i, owner in enumerate(owners):
        dim = shard_mesh_dim(owner) if is_dtensor(owner) else None
        if dim is None:
            here.append(i)
        elif stage.local_rows is not None and stage.local_rows(tuple(owner.shape), flags):
            if tensors["param"][i].shape[0]:  # (a rank with none of its rows has nothing to do)
                here.append(i)
        else:
            groups.setdefault((owner.device_mesh, dim), []).append(i)
    if here:
        run_local(impl, stage, _subset(tensors, here), scalars, flags)
    for (mesh, dim), members in groups.items():
        group = mesh.get_group(dim)
        _check_rank(mesh, dim, group)
        _spread(impl, stage, _subset(tensors, members), scalars, flags, [tuple(owners[i].shape) for i in members],
                group, run_local)


def _check_rank(mesh, dim: int, group) -> None:
    """DTensor gives a rank the rows of its mesh coordinate, all_to_all addresses it by its rank in the group:
    the exchange needs the two orders to agree (as on meshes that init_device_mesh makes). Every rank of the
    group sees the same ranks, so all of them raise or none (none is left waiting in the exchange)."""
    import torch.distributed as dist

    at = tuple(slice(None) if d == dim else c for d, c in enumerate(mesh.get_coordinate()))
    by_coordinate = mesh.mesh[at].tolist()
    if dist.get_process_group_ranks(group) != by_coordinate:
        raise NotImplementedError(f"per-tensor stages on sharded params: mesh dim {dim} of {mesh} orders its ranks "
                                  f"{by_coordinate}, its process group {dist.get_process_group_ranks(group)}; use a "
                                  f"mesh whose ranks ascend along each dim (init_device_mesh's)")


def _spread(impl: str, stage, tensors: dict, scalars: tuple, flags: tuple, shapes: list[tuple], group,
            run_local: Callable) -> None:
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    splits = [row_split(shape[0], world) for shape in shapes]
    owner = assign(shapes, world)
    mine = [i for i in range(len(shapes)) if owner[i] == rank]
    reads = [n for n in stage.reads if tensors[n] is not None]
    writes = [n for n in stage.writes if tensors[n] is not None]
    for name in dict.fromkeys(reads + writes):
        for i, t in enumerate(tensors[name]):
            local = (splits[i][rank],) + shapes[i][1:]
            if tuple(t.shape) != local:
                raise NotImplementedError(
                    f"{name!r} of a sharded param of shape {shapes[i]} has local shape {tuple(t.shape)}, not its "
                    f"param's shard {local}: per-tensor stages gather only tensors sharded like their param")
    dtypes = {tensors[n][0].dtype for n in reads + writes if tensors[n]}
    if len(dtypes) > 1:
        raise NotImplementedError(f"per-tensor stages on sharded params need one dtype per bucket, got {dtypes}")
    some = next(t for n in reads + writes for t in tensors[n])
    dtype, device = some.dtype, some.device
    row = [math.prod(shape[1:]) for shape in shapes]

    # 1. each rank's shards of the reads go to their tensor's owner
    send = [tensors[n][i].reshape(-1) for r in range(world) for i in range(len(shapes)) if owner[i] == r
            for n in reads]
    send_sizes = [sum(splits[i][rank] * row[i] for i in range(len(shapes)) if owner[i] == r) * len(reads)
                  for r in range(world)]
    recv_sizes = [sum(splits[i][r] * row[i] for i in mine) * len(reads) for r in range(world)]
    received = _exchange(send, send_sizes, recv_sizes, dtype, device, group)
    full = {n: [torch.empty(shapes[i], dtype=dtype, device=device) for i in mine] for n in reads}
    at = 0
    for r in range(world):  # from rank r: its rows of each of my tensors, name by name
        for k, i in enumerate(mine):
            start, size = sum(splits[i][:r]), splits[i][r] * row[i]
            for n in reads:
                full[n][k][start:start + splits[i][r]].view(-1).copy_(received[at:at + size])
                at += size

    # 2. the stage on the whole tensors this rank owns
    for n in writes:
        if n not in full:
            full[n] = [torch.empty(shapes[i], dtype=dtype, device=device) for i in mine]
    for n, ts in tensors.items():
        if ts is None:
            full[n] = None
    if mine:
        if "param" not in full:  # the local path counts tensors by "param"
            full["param"] = full[(reads + writes)[0]]
        run_local(impl, stage, full, scalars, flags)

    # 3. each rank's rows of the writes come back from the owner
    send = [full[n][k][sum(splits[i][:r]):sum(splits[i][:r + 1])].reshape(-1)
            for r in range(world) for k, i in enumerate(mine) for n in writes]
    send_sizes = [sum(splits[i][r] * row[i] for i in mine) * len(writes) for r in range(world)]
    recv_sizes = [sum(splits[i][rank] * row[i] for i in range(len(shapes)) if owner[i] == r) * len(writes)
                  for r in range(world)]
    received = _exchange(send, send_sizes, recv_sizes, dtype, device, group)
    at = 0
    for r in range(world):
        for i in range(len(shapes)):
            if owner[i] != r:
                continue
            size = splits[i][rank] * row[i]
            for n in writes:
                tensors[n][i].copy_(received[at:at + size].view(tensors[n][i].shape))
                at += size


def _exchange(pieces: list[Tensor], send_sizes: list[int], recv_sizes: list[int], dtype, device, group) -> Tensor:
    import torch.distributed as dist

    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(out, send, recv_sizes, send_sizes, group=group)
    return out
