"""Run under torchrun (train_runs.py runs it first, for test_distributed.py): fastoptim under FSDP2 (HSDP's 2-D
meshes too) and ZeRO-1 on CPU (gloo) must train exactly like a single process given the same data on every rank,
and gradient release under FSDP2 exactly like FSDP2 without it (``--hsdp``: the four-rank checks alone). Writes
the max differences as JSON. ``levels`` narrows the levels checked: the default test run leaves the compiled
level, whose cold Inductor builds in both ranks are much of the launch, to the full run."""

import json
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

import fastoptim
from fastoptim import storage


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def wide_model():
    """Weights with rows that split evenly (130) and unevenly (7) over 2 ranks, and rows longer than one
    8-bit block (300): every one quantized at min_quant_size=0."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 130), torch.nn.LayerNorm(130), torch.nn.Linear(130, 7),
                               torch.nn.Linear(7, 300))


def muon_model(biases=False):
    """Matrices tall with rows that split unevenly over 2 ranks (33 x 16: 17 + 16 rows), wide (8 x 33), two of
    one shape (8 x 8: one batch on one process) and one row (1 x 8: rank 1's shard is empty). The biases train
    only with ``biases``: Muon alone steps the rest bit-identically on any ranks, whereas AdamW's elementwise
    kernels round a few elements differently on the shards' shapes (the fsdp2 tests above)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 8),
                              torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    for p in net.parameters():
        p.requires_grad_(biases or p.dim() == 2)
    return net


def muon(net, **kwargs):
    return fastoptim.Muon([p for p in net.parameters() if p.requires_grad], lr=0.02, **kwargs)


class Experts(torch.nn.Module):
    """E matrices in one (E, out, in) param, each applied to the input, their outputs averaged."""

    def __init__(self, experts, out, inputs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, out, inputs) / inputs ** 0.5)

    def forward(self, x):
        return torch.einsum("eoi,bi->bo", self.weight, x) / self.weight.shape[0]


def experts_model(linear=True):
    """Two stacks of experts: 3 (rows 2 + 1 over 2 ranks) and 1 (rank 1's shard empty); with ``linear`` the
    Linear weights train too (matrices gathered whole beside them)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 12), Experts(3, 12, 12), torch.nn.Tanh(), Experts(1, 8, 12),
                              torch.nn.Linear(8, 4))
    for p in net.parameters():
        p.requires_grad_(p.dim() == 3 or (linear and p.dim() == 2))
    return net


class CountingAllToAll:
    """Counts the calls of dist.all_to_all_single while entered (the exchange of ``paths.sharded``; FSDP2 does
    not call it)."""

    def __enter__(self):
        self.real, self.calls = dist.all_to_all_single, 0

        def counting(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)

        dist.all_to_all_single = counting
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.real


def max_diff(params, reference):
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(params, reference))


LEVELS = ("loop", "foreach", "fused", "compiled")


def gathered(value):
    """``value`` from every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def ns_calls(net, opt):
    """Each rank's Newton-Schulz calls over one step, by rank: the shape of every matrix it orthogonalised."""
    from fastoptim.rules import muon as muon_rule
    real, seen = muon_rule.newton_schulz, []

    def counting(x, *args):
        seen.extend([tuple(x.shape[1:])] * x.shape[0])
        return real(x, *args)

    muon_rule.newton_schulz = counting
    try:
        train(net, opt, steps=1)
    finally:
        muon_rule.newton_schulz = real
    return gathered(sorted(seen))


def muon_checks(result, levels=LEVELS):
    """Muon under FSDP2 against one process at every level; which rank ran Newton-Schulz on which matrix;
    Adafactor on sharded vectors against one process, and its factored states refused on sharded matrices."""
    for impl in levels:
        single = muon_model()
        reference = train(single, muon(single, impl=impl))
        net = shard(muon_model())
        result[f"muon fsdp2 {impl}"] = max_diff(train(net, muon(net, impl=impl)), reference)
    low = dict(impl="fused", state_bits=8, min_quant_size=0)
    single = muon_model()
    reference = train(single, muon(single, **low))
    net = shard(muon_model())
    result["muon fsdp2 fused 8-bit"] = max_diff(train(net, muon(net, **low)), reference)
    single = muon_model(biases=True)  # the recipe: AdamW (use_muon=False) for the biases
    reference = train(single, fastoptim.create(single, "muon", lr=0.02, adamw_lr=1e-2))
    net = shard(muon_model(biases=True))
    result["muon recipe fsdp2"] = max_diff(train(net, fastoptim.create(net, "muon", lr=0.02, adamw_lr=1e-2)),
                                           reference)
    for impl in ("loop", "fused"):
        net = shard(muon_model())
        result[f"muon ns calls {impl}"] = ns_calls(net, muon(net, impl=impl))
    def vectors(net):  # Adafactor's per-tensor step on 1-D params: its states are param-shaped, gathered as they are
        for p in net.parameters():
            p.requires_grad_(p.dim() == 1)
        return net

    for impl in [lv for lv in ("loop", "fused", "compiled") if lv in levels]:
        single = vectors(muon_model())
        reference = train(single, fastoptim.Adafactor([p for p in single.parameters() if p.requires_grad], impl=impl))
        net = shard(vectors(muon_model()))
        params = train(net, fastoptim.Adafactor([p for p in net.parameters() if p.requires_grad], impl=impl))
        result[f"adafactor fsdp2 vectors {impl}"] = max_diff(params, reference)
    net = shard(muon_model())
    try:
        fastoptim.Adafactor(net.parameters())
        result["adafactor fsdp2 refused"] = ""
    except NotImplementedError as e:
        result["adafactor fsdp2 refused"] = str(e)
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # a step counts as an in-place write to each sharded param (the kernels write its local shard): a loss whose
    # backward needs the params from before the step is refused, as torch.optim's loop steps make it
    for label, make in [("adamw fused", lambda ps: fastoptim.AdamW(ps, impl="fused")),
                        ("adamw fused 8-bit", lambda ps: fastoptim.AdamW(ps, state_bits=8, min_quant_size=0)),
                        ("muon fused", lambda ps: fastoptim.Muon(ps)),
                        ("adafactor fused", lambda ps: fastoptim.Adafactor(ps)),
                        ("torch AdamW loop", lambda ps: torch.optim.AdamW(ps, foreach=False))]:
        torch.manual_seed(0)
        shape = (8,) if label.startswith("adafactor") else (8, 6)
        p = torch.nn.Parameter(distribute_tensor(torch.randn(shape), mesh, [Shard(0)]))
        opt = make([p])
        p.grad = distribute_tensor(torch.randn(shape), mesh, [Shard(0)])
        loss = (p * p).sum()
        opt.step()
        try:
            loss.backward()
            result[f"sharded write counted: {label}"] = False
        except RuntimeError as e:
            result[f"sharded write counted: {label}"] = "modified by an inplace operation" in str(e)
    by_columns = torch.nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)]))
    try:
        fastoptim.Muon([by_columns])
        result["muon shard(1) refused"] = ""
    except NotImplementedError as e:
        result["muon shard(1) refused"] = str(e)


def local_rows_checks(result, mesh=None, label=""):
    """A per-tensor stage that declares ``local_rows`` for (E, M, N) params (slice_rule.py's, per matrix): under
    FSDP2 each rank steps its own experts, with no all_to_all, against one process; the 2-D weights beside them
    are gathered (two exchanges a step); with the rule's ``whole`` flag the declaration says no and the experts
    are gathered too. ``label`` names the mesh."""
    import slice_rule
    steps = 3
    for linear, whole in [(False, False), (True, False), (False, True)]:
        case = f"slices{label} linear={linear} whole={whole}"
        single = experts_model(linear)
        reference = train(single, slice_rule.SliceNorm([p for p in single.parameters() if p.requires_grad],
                                                       lr=0.02, whole=whole, impl="fused"), steps=steps)
        for impl in ("loop", "fused"):
            net = shard(experts_model(linear), mesh)
            opt = slice_rule.SliceNorm([p for p in net.parameters() if p.requires_grad], lr=0.02, whole=whole,
                                       impl=impl)
            slice_rule.CALLS.clear()
            with CountingAllToAll() as counted:
                params = train(net, opt, steps=steps)
            result[f"{case} {impl}"] = dict(diff=max_diff(params, reference), exchanges=counted.calls / steps,
                                            calls=gathered(sorted(slice_rule.CALLS[:len(slice_rule.CALLS) // steps])))


def muon_expert_checks(result, mesh=None, label=""):
    """fastoptim.Muon (fp32 Newton-Schulz; 32- and 8-bit momentum) on expert stacks (E, M, N) under FSDP2: each
    rank steps its own experts with no all_to_all, and the params equal one process's; with the Linear weights
    training beside them, those are gathered (two exchanges a step)."""
    steps = 3
    for linear in (False, True):
        for bits in (32, 8):
            low = {} if bits == 32 else dict(state_bits=8, min_quant_size=0)
            single = experts_model(linear)
            reference = train(single, muon(single, ns_dtype="float32", impl="fused", **low), steps=steps)
            net = shard(experts_model(linear), mesh)
            with CountingAllToAll() as counted:
                params = train(net, muon(net, ns_dtype="float32", impl="fused", **low), steps=steps)
            result[f"muon experts{label} linear={linear} {bits}-bit"] = dict(
                diff=max_diff(params, reference), exchanges=counted.calls / steps)


def hsdp_checks(result, shapes, slices=True):
    """Muon under HSDP (fully_shard on a 2-D mesh of each shape in ``shapes``, (replicate, shard)) against one
    process, with fp32 Newton-Schulz, 32- and 8-bit momentum; which rank orthogonalised which matrix; the
    local_rows checks on each mesh (with ``slices``); where both mesh dims have several ranks, a param sharded
    over the first, and the layouts that split a param more than by rows over one mesh dim, refused; and a mesh
    whose ranks descend refused."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    fp32 = dict(ns_dtype="float32")
    cases = [("loop", {}), ("fused", {}), ("fused 8-bit", dict(state_bits=8, min_quant_size=0))]
    references = {}
    for name, low in cases:
        single = muon_model()
        references[name] = train(single, muon(single, impl=name.split()[0], **fp32, **low))
    # a mesh whose coordinates run against its group's ranks: the exchange refuses it, on every rank
    from torch.distributed.device_mesh import DeviceMesh
    from fastoptim.paths import sharded
    backwards = DeviceMesh("cpu", list(reversed(range(dist.get_world_size()))))
    try:
        sharded._check_rank(backwards, 0, backwards.get_group(0))
        message = ""
    except NotImplementedError as e:
        message = str(e)
    result["reversed mesh refused"] = gathered(message)
    for shape in shapes:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        label = f" hsdp {shape[0]}x{shape[1]}"
        for name, low in cases:
            net = shard(muon_model(), mesh)
            with CountingAllToAll() as counted:
                params = train(net, muon(net, impl=name.split()[0], **fp32, **low))
            result[f"muon{label} {name}"] = dict(diff=max_diff(params, references[name]), exchanges=counted.calls)
        net = shard(muon_model(), mesh)
        result[f"muon{label} ns calls"] = ns_calls(net, muon(net, impl="fused", **fp32))
        if slices:
            local_rows_checks(result, mesh, label)
        if min(shape) > 1:  # dim 0 split over the mesh's first dim, replicated over its second
            single = torch.nn.Parameter(torch.randn(33, 16, generator=torch.Generator().manual_seed(2)))
            split = torch.nn.Parameter(distribute_tensor(single.detach().clone(), mesh, [Shard(0), Replicate()]))
            for p in (single, split):
                opt = fastoptim.Muon([p], lr=0.02, **fp32)
                for step in range(3):
                    grad = torch.randn(33, 16, generator=torch.Generator().manual_seed(3 + step))
                    p.grad = distribute_tensor(grad, mesh, [Shard(0), Replicate()]) if p is split else grad
                    opt.step()
            result[f"muon{label} (Shard(0), Replicate())"] = max_diff([split.full_tensor()], [single.detach()])
        # (on a mesh dim of one rank, Shard(1) splits nothing: accepted there)
        for placements in [(Replicate(), Shard(1))] + ([(Shard(0), Shard(1)), (Shard(0), Shard(0))]
                                                       if min(shape) > 1 else []):
            p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, list(placements)))
            try:
                fastoptim.Muon([p])
                result[f"muon{label} {placements} refused"] = ""
            except NotImplementedError as e:
                result[f"muon{label} {placements} refused"] = str(e)


def release_checks(result):
    """gradient_release=True under FSDP2, against the same FSDP2 run without it. FSDP2 calls each sharded param's
    post-accumulate-grad hooks after its reduce-scatter, so its bucket steps inside backward on the reduced grad:
    bucket by bucket (tiny buckets: most step while backward still runs), at 32- and 8-bit state, with
    accumulation either way, and Muon, whose gathers are collectives (every rank cuts the same buckets); clipping is
    refused (its measuring backward cannot see FSDP2's sharded grads); a sharded group added later is hooked."""
    from fastoptim.levels import record_paths
    tiny = dict(gradient_release=True, release_bucket_mb=1e-3)  # about 1 KiB: a bucket of one weight or a few
    for impl in ("loop", "fused"):
        for bits in (32, 8):
            low = dict(lr=1e-2, impl=impl, state_bits=bits, min_quant_size=0)
            for micro, accumulate in [(1, None), (2, "no_sync"), (2, "accumulating")][:3 if impl == "fused" else 1]:
                how = dict(steps=3, micro=micro, accumulate=accumulate)
                net = shard(wide_model())
                reference = train(net, fastoptim.AdamW(net.parameters(), **low), **how)
                net, freed = shard(wide_model()), []
                opt = fastoptim.AdamW(net.parameters(), **low, **tiny)
                with record_paths() as paths:
                    params = train(net, opt, freed=freed, **how)
                result[f"release fsdp2 {impl} {bits}-bit {accumulate}"] = dict(
                    diff=max_diff(params, reference), flushes=opt._release.flushes, freed=all(freed),
                    paths=sorted(set(paths)))
    # one FSDP2 group, the root's: its reduce-scatter, and so every hook, runs in FSDP2's end-of-backward callback,
    # from which release queues its own (which steps what is left and must still run in this backward)
    net = fully_shard(wide_model())
    reference = train(net, fastoptim.AdamW(net.parameters(), lr=1e-2), steps=3)
    net, freed = fully_shard(wide_model()), []
    opt = fastoptim.AdamW(net.parameters(), lr=1e-2, gradient_release=True)
    result["release fsdp2 root only"] = dict(diff=max_diff(train(net, opt, steps=3, freed=freed), reference),
                                             flushes=opt._release.flushes, freed=all(freed))
    net = shard(muon_model())
    reference = train(net, muon(net, impl="fused"), steps=3)
    net = shard(muon_model())
    opt = muon(net, impl="fused", **tiny)
    result["release fsdp2 muon"] = dict(diff=max_diff(train(net, opt, steps=3), reference),
                                        flushes=opt._release.flushes)
    try:
        fastoptim.AdamW(shard(model()).parameters(), gradient_release=True, max_grad_norm=1.0)
        result["release fsdp2 clip refused"] = ""
    except ValueError as e:
        result["release fsdp2 clip refused"] = str(e)
    net = shard(model())
    opt = fastoptim.AdamW(list(net.parameters())[:2], gradient_release=True)
    unchanged = len(opt.param_groups), len(opt._release.handles)
    opt.add_param_group({"params": list(net.parameters())[2:]})  # sharded: released too
    result["release groups added"] = [unchanged, [len(opt.param_groups), len(opt._release.handles)]]


def ddp_release_train(net, opt, view, release, steps=3):
    """Under DDP, ranks with different data: each step a no_sync micro-batch, a synced one under opt.accumulating()
    (reduced, not stepped), then the synced one. With ``release`` the optimizer is tied to the DDP model: each
    bucket steps inside the last backward, and opt.step() finds no grad left (checked)."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.01, gradient_as_bucket_view=view)  # several buckets
    if release:
        opt.release_with(ddp)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    grads_left = 0
    for _ in range(steps):
        with ddp.no_sync():
            ddp(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        with opt.accumulating():
            ddp(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        ddp(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        grads_left += sum(p.grad is not None for p in net.parameters())
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()], grads_left


def ddp_release_checks(result):
    """Gradient release tied to DDP (opt.release_with) against plain DDP stepping after backward: at the loop and
    fused levels, 32-bit and 8-bit state, both gradient_as_bucket_view settings, with a no_sync window; and the
    refusal of plain params under world size 2 without the tie."""
    from fastoptim.levels import record_paths
    for impl, bits, view in [("loop", 32, False), ("fused", 32, True), ("loop", 8, True), ("fused", 8, False)]:
        kwargs = dict(lr=1e-2, impl=impl, state_bits=bits, min_quant_size=0)
        plain = wide_model()
        reference, _ = ddp_release_train(plain, fastoptim.AdamW(plain.parameters(), **kwargs), view, False)
        net = wide_model()
        opt = fastoptim.AdamW(net.parameters(), gradient_release=True, **kwargs)
        with record_paths() as paths:
            params, grads_left = ddp_release_train(net, opt, view, True)
        label = f"ddp release {impl} {bits}-bit view={view}"
        result[label] = max_diff(params, reference)
        result[f"{label} grads left"] = grads_left
        result[f"{label} buckets"] = opt._release.ddp.buckets_stepped
        result[f"{label} paths"] = sorted(paths)
    net = wide_model()
    opt = fastoptim.AdamW(net.parameters(), gradient_release=True)
    before = [p.detach().clone() for p in net.parameters()]
    try:
        net(torch.randn(8, 64)).sum().backward()
        result["ddp release untied refused"] = ""
    except NotImplementedError as e:
        result["ddp release untied refused"] = str(e)
    result["ddp release untied unchanged"] = max_diff(net.parameters(), before)
    from torch.nn.parallel import DistributedDataParallel
    net, outside = wide_model(), torch.nn.Parameter(torch.ones(3))
    opt = fastoptim.AdamW([*net.parameters(), outside], gradient_release=True)
    ddp = DistributedDataParallel(net)
    opt.release_with(ddp)
    try:
        (ddp(torch.randn(8, 64)).sum() + outside.sum()).backward()
        result["ddp release param outside the model refused"] = ""
    except NotImplementedError as e:
        result["ddp release param outside the model refused"] = str(e)


def shard(net, mesh=None):
    """fully_shard each layer with params and the root, on ``mesh`` (None: FSDP2's 1-D mesh of every rank; 2-D:
    HSDP, replicated over dim 0 and sharded over dim 1)."""
    for layer in net:
        if isinstance(layer, (torch.nn.Linear, Experts)):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def train(net, opt, steps=4, dtype=torch.float32, micro=1, accumulate=None, freed=None):
    """``micro`` micro-batches per step; the first ones accumulate as ``accumulate`` says: "no_sync" (FSDP2 keeps
    their grads unsharded and reduce-scatters the sum at the last), or "accumulating" (each is reduce-scattered and
    added into the sharded grad; ``opt.accumulating()`` around its backward). ``freed``: a list that gets, after
    each step's backward, whether every grad is None."""
    g = torch.Generator().manual_seed(1)
    inputs = net[0].in_features
    for _ in range(steps):
        for m in range(micro):
            last = m == micro - 1
            x = torch.randn(8, inputs, generator=g).to(dtype)  # the same batch on every rank
            if accumulate == "no_sync":
                net.set_requires_gradient_sync(last)
            with opt.accumulating() if accumulate == "accumulating" and not last else nullcontext():
                net(x).pow(2).mean().backward()
        if freed is not None:
            freed.append(all(p.grad is None for p in net.parameters()))
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in net.parameters()]


def main(out_path, levels=LEVELS):
    dist.init_process_group("gloo")
    single = model()
    reference = train(single, fastoptim.AdamW(single.parameters(), lr=1e-2, impl="loop", max_grad_norm=0.5))
    result = {}
    for impl in levels:
        net = model()
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(net)
        params = train(net, fastoptim.AdamW(net.parameters(), lr=1e-2, impl=impl, max_grad_norm=0.5))
        result[f"fsdp2 {impl}"] = max((a - b).abs().max().item() for a, b in zip(params, reference))
    net = model()
    zero = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=fastoptim.AdamW, lr=1e-2)
    params = train(net, zero)
    plain = model()
    plain_params = train(plain, fastoptim.AdamW(plain.parameters(), lr=1e-2))
    result["zero1"] = max((a - b).abs().max().item() for a, b in zip(params, plain_params))
    # low-bit state: blocks run along rows, so each rank's rows quantize as one process's
    for bits in [key for key in storage.codecs.keys() if key != 32]:
        low = dict(lr=1e-2, state_bits=bits, min_quant_size=0)
        for impl in levels:
            single = wide_model()
            reference = train(single, fastoptim.AdamW(single.parameters(), impl=impl, **low))
            net = shard(wide_model())
            params = train(net, fastoptim.AdamW(net.parameters(), impl=impl, **low))
            result[f"fsdp2 {impl} {bits}-bit"] = max((a - b).abs().max().item() for a, b in zip(params, reference))
        net = wide_model()
        params = train(net, ZeroRedundancyOptimizer(net.parameters(), optimizer_class=fastoptim.AdamW, **low))
        plain = wide_model()
        plain_params = train(plain, fastoptim.AdamW(plain.parameters(), **low))
        result[f"zero1 {bits}-bit"] = max((a - b).abs().max().item() for a, b in zip(params, plain_params))
    for rounding in ("stochastic", "kahan"):  # bf16 params: the same random bits and compensation on any ranks
        low = dict(lr=1e-2, rounding=rounding, state_bits=8, min_quant_size=0)
        for impl in ("loop", "fused"):
            single = wide_model().to(torch.bfloat16)
            reference = train(single, fastoptim.AdamW(single.parameters(), impl=impl, **low), dtype=torch.bfloat16)
            net = shard(wide_model().to(torch.bfloat16))
            params = train(net, fastoptim.AdamW(net.parameters(), impl=impl, **low), dtype=torch.bfloat16)
            result[f"fsdp2 {impl} bf16 {rounding}"] = max((a.float() - b.float()).abs().max().item()
                                                          for a, b in zip(params, reference))
    muon_checks(result, levels)
    local_rows_checks(result)
    muon_expert_checks(result)
    hsdp_checks(result, [(1, 2), (2, 1)], slices=False)  # (the 2-D meshes' local_rows checks: hsdp_main's)
    release_checks(result)
    ddp_release_checks(result)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def hsdp_main(out_path):
    """Four ranks (test_distributed.py's full run): HSDP on a (2, 2) mesh, and the local_rows checks on FSDP2's
    1-D mesh of four and on that 2-D mesh."""
    dist.init_process_group("gloo")
    result = {}
    local_rows_checks(result)
    muon_expert_checks(result)
    hsdp_checks(result, [(2, 2)])
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def ddp_release_main(out_path):
    """ddp_release_checks alone (test_distributed.py runs it on 3 ranks: 1/3 rounds, unlike 1/2)."""
    dist.init_process_group("gloo")
    result = {}
    ddp_release_checks(result)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--ddp-release":
        ddp_release_main(sys.argv[2])
    elif sys.argv[1] == "--hsdp":
        hsdp_main(sys.argv[2])
    else:
        main(sys.argv[1])
