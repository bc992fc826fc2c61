"""Muon on params that are not one matrix (``fastoptim.rules.muon``: ``matrices`` and ``split``): a batch of
matrices (MoE experts), a matrix whose rows are blocks (per-head, fused QKV), conv filters (flattened).

Each such param steps as its matrices, or blocks, stepped one by one as separate 2-D params with the same rule,
bit for bit (fp32 Newton-Schulz), at every level, with 8-bit momentum, flat and released too.

Where that needs one thread: the loop level orthogonalises a param's matrices in one call of ``newton_schulz``
(a batch of several) and separate params one call each (a batch of one). torch hands a batch of one to MKL's
``cblas_sgemm`` and a larger one to its batched sgemm. With several threads, on small products (up to about
160 x 160 on this project's 2-core CPU) MKL's sgemm scales B by alpha as it packs it and rounds beta C apart
before adding, where its batched sgemm (and its sgemm on one thread) computes fma(beta, C, round(alpha (A B))).
So ``baddbmm(beta=b, alpha=c)`` rounds the two ways apart by a few ulps (with alpha 1 and beta 0 or 1 they agree),
and the loop level's comparisons run on one thread; with threads they stay within Newton-Schulz's rounding
(``test_loop_level_with_threads_is_within_gemm_rounding``). The batched levels call it alike both ways.
"""

import contextlib
import copy

import pytest
import torch
from torch import nn

import fastoptim
from fastoptim.levels import LEVELS, record_paths
from fastoptim.reference import ReferenceMuon, ReferenceMuonRecipe
from fastoptim.rules import muon as muon_rule

STAGE_PATH = {"loop": "stage_loop", "foreach": "stage_batched", "fused": "stage_batched", "compiled": "stage_compiled"}
FP32 = dict(lr=0.02, ns_dtype="float32")


def _unbind(t):
    return list(t.unbind(0))


def _rows(sizes):
    return lambda t: list(t.split(sizes, 0))


# (shape, options, the param's matrices or blocks as separate params, the block shapes newton_schulz gets)
CASES = {
    "experts": ((8, 256, 512), {}, _unbind, [(8, 256, 512)]),
    "qkv_heads": ((3 * 512, 512), dict(split=3), _rows([512] * 3), [(3, 512, 512)]),
    "gqa_qkv": ((768, 512), dict(split=(512, 128, 128)), _rows([512, 128, 128]), [(1, 512, 512), (2, 128, 512)]),
    # tall blocks: each its own lr ratio (2 and 1; the whole matrix's would be sqrt(6))
    "tall_blocks": ((192, 32), dict(split=(32, 128, 32), adjust_lr_fn="original"), _rows([32, 128, 32]),
                    [(1, 128, 32), (2, 32, 32)]),
    "expert_heads": ((4, 96, 32), dict(matrices="batch", split=3), lambda t: [b for m in t.unbind(0)
                                                                              for b in m.split(32, 0)],
                     [(12, 32, 32)]),
}


@contextlib.contextmanager
def _one_thread_at_loop(level):
    """The loop level on one thread, where MKL's sgemm and batched sgemm round alike (module docstring)."""
    if level != "loop":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _whole_and_parts(shape, parts, seed=0):
    g = torch.Generator().manual_seed(seed)
    whole = nn.Parameter(torch.randn(shape, generator=g))
    return whole, [nn.Parameter(t.detach().clone()) for t in parts(whole.detach())]


def _grads(step, whole, separate, parts):
    whole.grad = torch.randn(whole.shape, generator=torch.Generator().manual_seed(100 + step))
    for p, grad in zip(separate, parts(whole.grad)):
        p.grad = grad.clone()


def _run(whole, separate, parts, a, b, steps=3):
    with record_paths() as paths:
        for step in range(steps):
            _grads(step, whole, separate, parts)
            a.step()
            b.step()
    return paths


def _assert_equal(whole, separate, parts):
    for i, (x, y) in enumerate(zip(parts(whole.detach()), separate, strict=True)):
        assert torch.equal(x, y), f"block {i} differs by {(x - y).abs().max().item()}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("level", LEVELS)
def test_a_param_steps_as_its_blocks_stepped_apart(level, case, monkeypatch):
    """After 3 steps the param equals its matrices (or blocks) stepped as separate params, bit for bit, and so
    does the momentum; ``newton_schulz`` gets 3-D batches only, one call per block shape."""
    shape, options, parts, calls = CASES[case]
    shapes = []
    real = muon_rule.newton_schulz

    def counting(x, *args):
        shapes.append(tuple(x.shape))
        return real(x, *args)

    whole, separate = _whole_and_parts(shape, parts)
    a = fastoptim.Muon([whole], impl=level, **FP32, **options)
    b = fastoptim.Muon(separate, impl=level, **FP32, **{k: v for k, v in options.items() if k == "adjust_lr_fn"})
    with _one_thread_at_loop(level):
        _run(whole, separate, parts, a, b, steps=2)
        monkeypatch.setattr(muon_rule, "newton_schulz", counting)
        with record_paths() as paths:
            _grads(2, whole, separate, parts)
            a.step()
        b.step()
    assert STAGE_PATH[level] in paths
    assert all(len(s) == 3 for s in shapes)
    assert sorted(shapes[:len(calls)]) == sorted(calls)  # (then b's)
    _assert_equal(whole, separate, parts)
    for x, y in zip(parts(a.state[whole]["momentum_buffer"]), separate, strict=True):
        assert torch.equal(x, b.state[y]["momentum_buffer"])


def test_loop_level_with_threads_is_within_gemm_rounding():
    """With torch's threads, the loop level's one batched call and the separate params' calls of one may round
    apart (module docstring): within 2e-6 after 3 steps at lr 0.02 (a last-bit difference that Newton-Schulz
    amplifies, times lr), the momentum (before Newton-Schulz) equal."""
    shape, options, parts, _ = CASES["gqa_qkv"]
    whole, separate = _whole_and_parts(shape, parts)
    a = fastoptim.Muon([whole], impl="loop", **FP32, **options)
    b = fastoptim.Muon(separate, impl="loop", **FP32)
    _run(whole, separate, parts, a, b)
    for x, y in zip(parts(whole.detach()), separate):
        torch.testing.assert_close(x, y.detach(), atol=2e-6, rtol=0)
    for x, y in zip(parts(a.state[whole]["momentum_buffer"]), separate):
        assert torch.equal(x, b.state[y]["momentum_buffer"])


# --- conv filters ---------------------------------------------------------------------------------------------

def _flat_view(t):
    return [t.view(len(t), -1)]


@pytest.mark.parametrize("shape", [(16, 8, 3, 3), (8, 4, 2, 2, 2), (8, 4, 3)])
@pytest.mark.parametrize("level", LEVELS)
def test_conv_filters_flatten_as_the_reference_muon_views_them(level, shape):
    """A 4-D or 5-D param is the matrix ``g.view(len(g), -1)`` (Jordan's Muon's rule for conv filters) under
    ``matrices="auto"``, and a 3-D one (a Conv1d's weight) under ``matrices="flatten"``: bit for bit the 2-D
    param of that shape, and within ReferenceMuon's tolerance (torch's loop on the view; it iterates a tall
    matrix's transpose) of the oracle."""
    whole, (flat,) = _whole_and_parts(shape, _flat_view)
    ref = nn.Parameter(flat.detach().clone())
    a = fastoptim.Muon([whole], impl=level, **FP32, **({"matrices": "flatten"} if len(shape) == 3 else {}))
    b = fastoptim.Muon([flat], impl=level, **FP32)
    oracle = ReferenceMuon([ref], **FP32)
    with _one_thread_at_loop(level):
        for step in range(3):
            _grads(step, whole, [flat], _flat_view)
            ref.grad = flat.grad.clone()
            a.step()
            b.step()
            oracle.step()
    _assert_equal(whole, [flat], _flat_view)
    torch.testing.assert_close(flat.detach(), ref.detach(), atol=1e-6, rtol=1e-5)


def test_matrices_batch_and_flatten_override_auto():
    """``batch`` takes a 4-D param as a batch of matrices, ``flatten`` a 3-D one as one matrix; 2-D params are
    the same in every mode."""
    for shape, matrices, parts in [((2, 3, 8, 5), "batch", lambda t: list(t.reshape(-1, 8, 5).unbind(0))),
                                   ((6, 4, 5), "flatten", _flat_view),
                                   ((6, 5), "batch", lambda t: [t]), ((6, 5), "flatten", lambda t: [t])]:
        whole, separate = _whole_and_parts(shape, parts)
        a = fastoptim.Muon([whole], impl="foreach", matrices=matrices, **FP32)
        b = fastoptim.Muon(separate, impl="foreach", **FP32)
        _run(whole, separate, parts, a, b)
        _assert_equal(whole, separate, parts)


def test_the_recipe_steps_conv_and_expert_params_as_its_oracle():
    """``create(model, "muon")`` on a model with conv filters (2-D and 1-D convs) and MoE experts against
    ReferenceMuonRecipe (ReferenceMuon on each param's matrix views, torch's AdamW for the rest): within 1e-6."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.mix = nn.Conv1d(8, 8, 3, padding=1)
            self.experts = nn.Parameter(torch.randn(4, 8, 8) / 8 ** 0.5)
            self.hidden = nn.Linear(8, 16)
            self.fc = nn.Linear(16, 5)

        def forward(self, x):
            h = self.conv(x).relu().flatten(2)  # (b, 8, hw)
            h = self.mix(h).relu().mean(-1)  # (b, 8)
            h = torch.einsum("bd,edf->bf", h, self.experts)
            return self.fc(self.hidden(h).relu())

    model = Net()
    ref_model = copy.deepcopy(model)
    opt = fastoptim.create(model, "muon", lr=0.02, adamw_lr=1e-2, ns_dtype="float32")
    ref = ReferenceMuonRecipe(ref_model, lr=0.02, adamw_lr=1e-2, ns_dtype="float32")
    muon = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    assert muon == {id(p) for p in (model.conv.weight, model.mix.weight, model.experts, model.hidden.weight)}
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


# --- 8-bit momentum, flat, gradient release -------------------------------------------------------------------

EXPERTS = (4, 64, 256)  # rows of 256: 8-bit blocks (256 values) fall alike on the batch and on its matrices


@pytest.mark.parametrize("level", LEVELS)
def test_an_expert_tensor_with_8_bit_momentum_and_flat_steps_as_its_matrices(level):
    """8-bit momentum (its blocks of 256 along each row: a batch's blocks are its matrices' own), flat and both:
    the expert tensor equals its matrices stepped apart with the same settings, bit for bit, params and
    momentum as stored."""
    for settings in (dict(state_bits=8, min_quant_size=0), dict(flat=True),
                     dict(flat=True, state_bits=8, min_quant_size=0)):
        whole, separate = _whole_and_parts(EXPERTS, _unbind)
        a = fastoptim.Muon([whole], impl=level, **FP32, **settings)
        b = fastoptim.Muon(separate, impl=level, **FP32, **settings)
        with _one_thread_at_loop(level):
            paths = _run(whole, separate, _unbind, a, b)
        assert STAGE_PATH[level] in paths, settings
        _assert_equal(whole, separate, _unbind)
        ours, theirs = a.state_dict()["state"][0], b.state_dict()["state"]
        if "state_bits" in settings:
            assert isinstance(a.state[whole]["momentum_buffer"], fastoptim.storage.QuantizedState)
            for k in ("momentum_buffer.codes", "momentum_buffer.absmax"):  # the batch's in its matrices' order
                assert torch.equal(ours[k].reshape(len(separate), -1),
                                   torch.stack([theirs[i][k].reshape(-1) for i in range(len(separate))])), k
        else:
            assert torch.equal(ours["momentum_buffer"],
                               torch.stack([theirs[i]["momentum_buffer"] for i in range(len(separate))]))


@pytest.mark.parametrize("level", LEVELS)
def test_a_released_expert_tensor_steps_as_its_matrices(level):
    """gradient_release=True steps the expert tensor inside backward (the driver flushed, no grad left) as the
    ordinary loop steps its matrices as separate params: bit for bit (the grads are elementwise functions of
    the params, so the batch's and its matrices' are alike)."""
    whole, separate = _whole_and_parts(EXPERTS, _unbind)
    released = fastoptim.Muon([whole], impl=level, gradient_release=True, release_bucket_mb=1e-6, **FP32)
    ordinary = fastoptim.Muon(separate, impl=level, **FP32)
    with _one_thread_at_loop(level):
        for step in range(3):
            g = torch.Generator().manual_seed(100 + step)
            weights = torch.randn(EXPERTS, generator=g)
            (torch.tanh(whole) * weights).sum().backward()
            assert whole.grad is None
            released.step()  # (steps nothing: backward stepped it)
            sum((torch.tanh(p) * w).sum() for p, w in zip(separate, weights.unbind(0))).backward()
            ordinary.step()
            ordinary.zero_grad()
    assert released._release.flushes >= 3
    _assert_equal(whole, separate, _unbind)


# --- options: refused values, state_dict ----------------------------------------------------------------------

@pytest.mark.parametrize("bad", [dict(matrices="rows"), dict(matrices=None), dict(split=0), dict(split=-2),
                                 dict(split=True), dict(split=1.5), dict(split="3"), dict(split=()),
                                 dict(split=(512, 0)), dict(split=[2.0, 3])])
def test_bad_option_values_are_refused_naming_the_option(bad):
    (name,) = bad
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        fastoptim.Muon([nn.Parameter(torch.zeros(6, 4))], **bad)
    opt = fastoptim.Muon([nn.Parameter(torch.zeros(6, 4))])
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(6, 4))], **bad})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("shape,options,says", [
    ((1000, 512), dict(split=3), "1000 rows, not a multiple of 3"),
    ((800, 512), dict(split=(512, 128, 128)), "800 rows, and the sizes sum to 768"),
    ((4, 10, 8), dict(split=4), "10 rows, not a multiple of 4"),  # (auto: each matrix of the batch is split)
    ((4, 10, 8), dict(split=4, matrices="flatten"), None),  # (flattened: 4 rows, 4 blocks of 1 row)
])
def test_a_split_that_does_not_fit_is_refused_when_the_param_is_added(shape, options, says):
    """Refused by the constructor and by add_param_group, naming the param's shape and the option, and nothing
    changes; a param of fewer than 2 dims stays refused in every mode."""
    p = nn.Parameter(torch.zeros(shape))
    if says is None:
        fastoptim.Muon([p], **options)
        return
    with pytest.raises(ValueError, match="does not fit") as e:
        fastoptim.Muon([p], **options)
    assert f"split={options['split']!r} does not fit a param of shape {shape}" in str(e.value)
    assert says in str(e.value)
    opt = fastoptim.Muon([nn.Parameter(torch.zeros(4, 4))])
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="does not fit"):
        opt.add_param_group({"params": [p], **options})
    assert opt.state_dict() == before and len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="matrices only"):
        fastoptim.Muon([nn.Parameter(torch.zeros(5))], matrices="batch")


def test_state_dict_saves_the_options_and_a_torch_checkpoint_keeps_the_groups_own():
    """The group keys are saved and load back; torch.optim.Muon's checkpoint (without them) keeps this
    optimizer's own; a checkpoint whose split does not fit the params is refused, changing nothing."""
    shape, options, parts, _ = CASES["gqa_qkv"]
    whole, _ = _whole_and_parts(shape, parts)
    ours = fastoptim.Muon([whole], matrices="flatten", **FP32, **options)
    whole.grad = torch.randn(shape)
    ours.step()
    saved = ours.state_dict()
    assert saved["param_groups"][0]["split"] == (512, 128, 128)
    assert saved["param_groups"][0]["matrices"] == "flatten"
    plain = fastoptim.Muon([nn.Parameter(whole.detach().clone())], **FP32)
    plain.load_state_dict(saved)
    assert plain.param_groups[0]["split"] == (512, 128, 128) and plain.param_groups[0]["matrices"] == "flatten"
    theirs = torch.optim.Muon([nn.Parameter(whole.detach().clone())], lr=0.01)
    ours.load_state_dict(theirs.state_dict())
    assert ours.param_groups[0]["lr"] == 0.01
    assert ours.param_groups[0]["split"] == (512, 128, 128) and ours.param_groups[0]["matrices"] == "flatten"
    bad = copy.deepcopy(saved)
    bad["param_groups"][0]["split"] = 5
    buffer = plain.state[plain.param_groups[0]["params"][0]]["momentum_buffer"].clone()
    with pytest.raises(ValueError, match=r"parameter group 0: Muon: split=5 does not fit"):
        plain.load_state_dict(bad)
    assert plain.param_groups[0]["split"] == (512, 128, 128)
    assert torch.equal(plain.state[plain.param_groups[0]["params"][0]]["momentum_buffer"], buffer)


@pytest.mark.parametrize("level", LEVELS)
def test_a_layout_set_by_hand_that_does_not_fit_changes_nothing(level):
    """The step's plan is kept from step to step: a split or matrices set by hand since, or a split list edited
    in place, that no longer fits is refused before anything changes, as when the param was added, not halfway
    through the step with the momentum moved."""
    p = nn.Parameter(torch.randn(2, 6, 4))  # (two 6 x 4 matrices; flattened, one 2 x 24)
    opt = fastoptim.Muon([p], impl=level, split=[3, 3], **FP32)
    p.grad = torch.randn(2, 6, 4)
    opt.step()
    group = opt.param_groups[0]
    for edit in (lambda: group.update(split=4), lambda: group["split"].append(1),
                 lambda: group.update(matrices="flatten")):
        saved = dict(split=list(group["split"]), matrices=group["matrices"])
        edit()
        before = p.detach().clone(), opt.state[p]["momentum_buffer"].clone()
        with pytest.raises(RuntimeError, match="does not fit a param of shape"):
            opt.step()
        assert torch.equal(p, before[0]) and torch.equal(opt.state[p]["momentum_buffer"], before[1])
        group.update(saved)
    opt.step()


def test_an_optimizer_pickled_before_the_options_existed_gets_their_defaults():
    opt = fastoptim.Muon([nn.Parameter(torch.zeros(6, 4))], lr=0.02)
    state = opt.__getstate__()
    state["defaults"] = {k: v for k, v in state["defaults"].items() if k not in ("matrices", "split")}
    state["param_groups"] = [{k: v for k, v in g.items() if k not in ("matrices", "split")}
                             for g in state["param_groups"]]
    old = fastoptim.Muon.__new__(fastoptim.Muon)
    old.__setstate__(state)
    assert old.param_groups[0]["matrices"] == "auto" and old.param_groups[0]["split"] is None
    old.param_groups[0]["params"][0].grad = torch.ones(6, 4)
    old.step()


def test_matrix_blocks_groups_blocks_of_one_height():
    """The shape logic NorMuon may share: views where blocks fill each matrix, offsets per height."""
    blocks = muon_rule.matrix_blocks
    assert blocks((8, 256, 512)) == muon_rule.MatrixBlocks(8, 256, 512, ((256, (0,)),))
    assert blocks((16, 8, 3, 3)) == muon_rule.MatrixBlocks(1, 16, 72, ((16, (0,)),))
    assert blocks((1536, 512), "auto", 3) == muon_rule.MatrixBlocks(1, 1536, 512, ((512, (0, 512, 1024)),))
    assert blocks((768, 512), "auto", (512, 128, 128)) == \
        muon_rule.MatrixBlocks(1, 768, 512, ((512, (0,)), (128, (512, 640))))
    assert blocks((2, 3, 8, 5), "batch") == muon_rule.MatrixBlocks(6, 8, 5, ((8, (0,)),))
    assert blocks((6, 4, 5), "flatten") == muon_rule.MatrixBlocks(1, 6, 20, ((6, (0,)),))
