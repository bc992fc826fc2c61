"""Rules with scratch (Muon, NorMuon, LAMB) step chunk by chunk, with scratch made for each chunk and freed after
it: chunked steps equal one chunk's, nothing of the scratch outlives the step, and Muon's first step peaks no
higher than torch.optim.Muon's where each chunk is one matrix."""

import gc
import weakref

import pytest
import torch

import fastoptim
from fastoptim.bench.memory import PeakMemory
from fastoptim.levels import LEVELS
from fastoptim.paths import stages

# a (4, 8, 6) expert stack, a fused QKV cut into heads, tall and wide matrices, a lone vector for LAMB's sake
SHAPES = [(8, 6), (6, 8), (4, 8, 6), (12, 6), (8, 6), (6, 8), (16, 16), (8, 6)]


def _params(seed, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(step, *param_sets):
    g = torch.Generator().manual_seed(1000 + step)
    for i, ref in enumerate(param_sets[0]):
        grad = torch.randn(ref.shape, generator=g)
        for ps in param_sets:
            ps[i].grad = grad.clone()


def _build(name, params, level, **extra):
    if name.startswith("muon"):  # the QKV (12, 6) in three heads of 4 rows, the rest whole
        groups = [{"params": [p for p in params if p.shape != (12, 6)]},
                  {"params": [p for p in params if p.shape == (12, 6)], "split": 3}]
        # (bf16: a chunk of one matrix multiplies in 2-D, a batch batched; they round alike)
        ns_dtype = "bfloat16" if name == "muon-bf16" else "float32"
        return fastoptim.Muon(groups, lr=0.02, ns_dtype=ns_dtype, impl=level, **extra)
    if name == "normuon":
        return fastoptim.NorMuon([p for p in params if p.dim() == 2], lr=0.02, ns_dtype="float32", impl=level,
                                 **extra)
    return fastoptim.LAMB(params, lr=0.01, impl=level, **extra)


def test_chunks_pack_shape_groups_in_order_and_split_groups_larger_than_the_budget(monkeypatch):
    monkeypatch.setattr(stages, "SCRATCH_CHUNK_BYTES", 1000)
    params = [torch.zeros(s) for s in [(10, 10), (5,), (10, 10), (30, 30), (5,), (30, 30), (10, 10), (10, 10)]]
    # (10, 10): 400 bytes each, two at a time; the (5,) (20 bytes each) fill up the second pair's chunk; (30, 30):
    # 3600 bytes, over the budget, one at a time
    assert stages.chunks(params, 1) == [[0, 2], [1, 4, 6, 7], [3], [5]]
    assert stages.chunks(params, 2) == [[0], [2], [6], [1, 4, 7], [3], [5]]  # (two scratch names: twice the bytes)
    assert stages.chunks(params, 0) == [list(range(8))]  # no scratch: one chunk
    assert stages.chunks(params, 1, whole=True) == [list(range(8))]
    monkeypatch.setattr(stages, "SCRATCH_CHUNK_BYTES", 1 << 20)
    assert stages.chunks(params, 1) == [list(range(8))]
    # off the CPU, the GPU's budget (a meta tensor stands in for a CUDA one)
    monkeypatch.setattr(stages, "SCRATCH_CHUNK_BYTES_GPU", 1000)
    on_device = [p.to("meta") for p in params]
    assert stages.chunks(on_device, 1) == [[0, 2], [1, 4, 6, 7], [3], [5]]


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name,flat", [("muon", False), ("muon", True), ("muon-bf16", False), ("normuon", False),
                                       ("lamb", False), ("lamb", True)])  # (NorMuon refuses flat=True: its moment is per row)
def test_chunked_steps_equal_one_chunk(name, flat, level, bits, monkeypatch):
    runs = []
    real = stages.Stages._run_chunk

    def counting(part, ctx):
        runs.append(len(part.params))
        return real(part, ctx)

    monkeypatch.setattr(stages.Stages, "_run_chunk", staticmethod(counting))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (a batch of one and a batch of several round alike on one thread)
    try:
        whole_p, chunked_p = _params(0), _params(0)
        extra = dict(flat=flat) if flat else {}
        if bits != 32:
            extra["state_bits"] = bits
        whole = _build(name, whole_p, level, **extra)
        chunked = _build(name, chunked_p, level, **extra)
        for step in range(1, 4):
            _grads(step, whole_p, chunked_p)
            runs.clear()
            whole.step()
            assert len(runs) == len(whole.param_groups)  # a chunk per group's bucket
            monkeypatch.setattr(stages, "SCRATCH_CHUNK_BYTES", 200)  # (a (6, 8) fp32 matrix's is 192 bytes)
            runs.clear()
            chunked.step()
            monkeypatch.setattr(stages, "SCRATCH_CHUNK_BYTES", 16 << 20)
            assert len(runs) > len(chunked.param_groups) + 2, runs  # the chunked path ran
        for a, b in zip(whole_p, chunked_p):
            assert torch.equal(a, b), (a - b).abs().max()
        for a, b in zip(whole.state.values(), chunked.state.values()):
            for key, value in a.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, b[key]), key
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("level", ["loop", "fused", "compiled"])
@pytest.mark.parametrize("name", ["muon", "lamb"])
def test_no_scratch_outlives_its_step(name, level, monkeypatch):
    made = []
    real = stages._scratch

    def keeping(params, names):
        views, buffers = real(params, names)
        made.extend(weakref.ref(b) for b in buffers.values())
        return views, buffers

    monkeypatch.setattr(stages, "_scratch", keeping)
    params = _params(0)
    opt = _build(name, params, level)
    for step in range(1, 3):
        _grads(step, params)
        opt.step()
    gc.collect()
    assert made and all(ref() is None for ref in made)


def test_muon_first_step_peaks_no_higher_than_torch_muon(monkeypatch):
    """With each matrix a chunk of its own, scratch is one matrix's (as torch's loop holds one update at a time)
    and Newton-Schulz keeps no copy of its input past the first product: Muon's build and first step peak at
    most as high as torch.optim.Muon's, in tensor bytes above the params and grads."""
    shapes = [(256, 512), (512, 256), (256, 512), (384, 384)]
    monkeypatch.setattr(stages, "SCRATCH_CHUNK_BYTES", 512 * 1024)  # (each matrix's scratch: 512 KiB or 576)

    def peak(build):
        with PeakMemory("cpu") as probe:
            params = _params(0, shapes)
            _grads(1, params)
            with probe.measure("step"):
                build(params).step()
        return probe.peaks["step"]

    ours = peak(lambda ps: fastoptim.Muon(ps, lr=0.02, ns_dtype="bfloat16", impl="fused"))
    theirs = peak(lambda ps: torch.optim.Muon(ps, lr=0.02))
    if ours is None or theirs is None:
        pytest.skip("the profiler records no memory events here")
    state = sum(torch.Size(s).numel() * 4 for s in shapes)
    assert state <= theirs and ours <= theirs, (ours, theirs)
