"""NorMuon (``fastoptim.rules.normuon``) against the paper's algorithm as read here, written out below apart from the
rule and from its oracle, and the part of its surface that is its own: the per-row second moment (its shape,
what it holds, what it does to each row of a step, how it is stored at 8/4 bits), state_dicts, the AdamW groups.

``paper_step`` is Algorithm 1 of Li et al. 2025 (arXiv 2510.05491) with the scalings of the authors' ``normuon.py``:
momentum (nesterov as theirs), their quintic Newton-Schulz (a tall matrix iterated as its transpose, in fp32),
v = b2 v + (1 - b2) mean_cols(O^2), N = O / (sqrt(v) + eps), then either O's Frobenius norm kept and Muon's
sqrt(max(1, rows/cols)) (their code) or 0.2 sqrt(rows cols) / ||N||_F (the paper), and decoupled decay.
"""

import io
import math

import pytest
import torch

import fastoptim
from conftest import assert_state_close
from fastoptim import storage
from fastoptim.levels import record_paths
from fastoptim.reference import ReferenceMuonRecipe
from fastoptim.rules.normuon import ReferenceNorMuon

SHAPES = [(16, 24), (24, 16), (8, 8), (1, 5)]
STEPS = 5
OPTIONS = [
    dict(lr=0.02),  # the authors' defaults: nesterov, Frobenius norm kept
    dict(lr=0.02, nesterov=False, momentum=0.9, beta2=0.8, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
    dict(lr=0.02, beta2=0.0, norm_eps=1e-3, maximize=True),
]


def _newton_schulz(u, steps=5, a=3.4445, b=-4.7750, c=2.0315):
    """The authors' quintic iteration, in fp32."""
    x = u.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def paper_step(p, grad, m, v, lr=0.02, weight_decay=0.0, momentum=0.95, beta2=0.95, nesterov=True, norm_eps=1e-10,
               adjust_lr_fn=None, maximize=False):
    """One step of one matrix in float64 (but Newton-Schulz): the new (p, m, v)."""
    g = -grad.double() if maximize else grad.double()
    m = momentum * m.double() + (1 - momentum) * g
    u = (1 - momentum) * g + momentum * m if nesterov else m
    o = _newton_schulz(u).double()
    rows, cols = o.shape
    v = beta2 * v.double() + (1 - beta2) * (o * o).mean(dim=1, keepdim=True)
    n = o / (v.sqrt() + norm_eps)
    if adjust_lr_fn == "match_rms_adamw":
        s = 0.2 * math.sqrt(rows * cols) * n / n.norm()
    else:
        s = n * o.norm() / (n.norm() + norm_eps) * math.sqrt(max(1, rows / cols))
    return p.double() * (1 - lr * weight_decay) - lr * s, m, v


def _params(seed, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes], g


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _grads(g, *param_lists):
    for ps in zip(*param_lists):
        grad = torch.randn(ps[0].shape, generator=g)
        for p in ps:
            p.grad = grad.clone()


@pytest.mark.parametrize("level", ["loop", "foreach", "fused"])
@pytest.mark.parametrize("index", range(len(OPTIONS)))
def test_matches_the_papers_algorithm_every_step(index, level):
    opts = OPTIONS[index]
    params, g = _params(index)
    opt = fastoptim.NorMuon(params, impl=level, ns_dtype="float32", **opts)
    expected = [(p.detach().double(), torch.zeros(p.shape, dtype=torch.float64),
                 torch.zeros(p.shape[0], 1, dtype=torch.float64)) for p in params]
    for step in range(1, STEPS + 1):
        _grads(g, params)
        with record_paths() as paths:
            opt.step()
        assert "stage_loop" in paths if level == "loop" else "stage_batched" in paths
        expected = [paper_step(x, p.grad, m, v, **opts) for p, (x, m, v) in zip(params, expected)]
        for i, (p, (x, m, v)) in enumerate(zip(params, expected)):
            torch.testing.assert_close(p.detach(), x.float(), atol=1e-6, rtol=1e-5,
                                       msg=lambda e: f"step {step}, param {i}: {e}")
            assert_state_close(opt.state[p]["momentum_buffer"], m.float(), msg="momentum_buffer")
            assert_state_close(opt.state[p]["second_momentum_buffer"], v.float(), msg="second_momentum_buffer")


def test_the_second_moment_is_one_number_per_row_and_evens_out_the_rows():
    """v has shape (rows, 1) and dtype of its param; after a first step it is (1 - b2) times each row's mean square
    of the orthogonalised update, so each row of that step has the same RMS (decay off). With the paper's scaling
    the whole step has RMS 0.2 lr; with the authors', the Frobenius norm of the orthogonalised update."""
    for adjust in ("match_rms_adamw", None):
        params, g = _params(3, [(12, 20), (20, 12)])
        before = [p.detach().clone() for p in params]
        opt = fastoptim.NorMuon(params, lr=0.01, beta2=0.9, adjust_lr_fn=adjust, ns_dtype="float32")
        _grads(g, params)
        opt.step()
        for p, was in zip(params, before):
            v = opt.state[p]["second_momentum_buffer"]
            assert v.shape == (p.shape[0], 1) and v.dtype == p.dtype
            u = 0.05 * p.grad + 0.95 * (0.05 * p.grad)  # the nesterov update after one step from zero
            o = _newton_schulz(u)
            torch.testing.assert_close(v, 0.1 * (o * o).mean(dim=1, keepdim=True), atol=1e-7, rtol=1e-5)
            step = (was - p.detach()) / 0.01
            row_rms = step.square().mean(dim=1).sqrt()
            torch.testing.assert_close(row_rms, row_rms.mean().expand_as(row_rms), atol=0, rtol=1e-5)
            if adjust == "match_rms_adamw":
                assert step.square().mean().sqrt().item() == pytest.approx(0.2, rel=1e-5)
            else:
                shape_ratio = math.sqrt(max(1, p.shape[0] / p.shape[1]))
                assert step.norm().item() == pytest.approx(o.norm().item() * shape_ratio, rel=1e-5)


def test_a_row_without_a_gradient_stays_put_and_a_zero_grad_moves_nothing():
    """A row whose grad is always 0 has second moment 0: O / (0 + eps) is 0 there, not NaN (in bf16 params too,
    whose 16-bit v would round eps to 0: the normalisation runs in fp32)."""
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(torch.randn(6, 10).to(dtype))
        zero = torch.nn.Parameter(torch.randn(4, 4).to(dtype))
        was, zero_was = p.detach().clone(), zero.detach().clone()
        opt = fastoptim.NorMuon([p, zero], lr=0.02, impl="loop")
        for _ in range(3):
            p.grad = torch.randn(6, 10).to(dtype)
            p.grad[2] = 0
            zero.grad = torch.zeros(4, 4, dtype=dtype)
            opt.step()
        assert torch.isfinite(p).all() and torch.equal(p[2], was[2]) and not torch.equal(p, was)
        assert torch.equal(zero.detach(), zero_was)
        assert opt.state[p]["second_momentum_buffer"][2].item() == 0


def _saved(opt):
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("bits", [32, 8])
def test_state_dict_round_trip_and_the_authors_state_names(bits):
    """The state_dict holds the authors' names and shapes (no step count); loaded into a new optimizer it steps on
    bit for bit, and loaded into the oracle it steps on as the oracle does."""
    params, g = _params(4, [(64, 64), (8, 24)])
    opt = fastoptim.NorMuon(params, lr=0.02, weight_decay=0.1, state_bits=bits, min_quant_size=0)
    for _ in range(3):
        _grads(g, params)
        opt.step()
    saved = _saved(opt)
    for index, p in enumerate(params):
        entry = saved["state"][index]
        assert {k.split(".")[0] for k in entry} == {"momentum_buffer", "second_momentum_buffer"}  # (8-bit: .codes, ...)
        assert "step" not in entry and entry["second_momentum_buffer"].shape == (p.shape[0], 1)
    twin_p = _clone(params)
    twin = fastoptim.NorMuon(twin_p, lr=0.02, weight_decay=0.1, state_bits=bits, min_quant_size=0)
    twin.load_state_dict(saved)
    if bits == 32:
        oracle_p = _clone(params)
        oracle = ReferenceNorMuon(oracle_p, lr=0.02, weight_decay=0.1, compute_dtype=None)
        oracle.load_state_dict(saved)
    for _ in range(3):
        _grads(g, params, twin_p, *([oracle_p] if bits == 32 else []))
        opt.step()
        twin.step()
        assert all(torch.equal(a, b) for a, b in zip(params, twin_p))
        if bits == 32:
            oracle.step()
            for a, b in zip(params, oracle_p):
                torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-3)  # (bf16 Newton-Schulz, where the CPU picks it)


@pytest.mark.parametrize("bits", [8, 4])
def test_low_bit_state_quantizes_the_momentum_and_keeps_the_second_moment_plain(bits):
    """At 8/4 bits the momentum of a matrix of min_quant_size elements is stored quantized; the per-row second
    moment, not param-shaped and small, stays a plain tensor of the param's dtype, as Adafactor's factors do."""
    params, g = _params(5, [(64, 64), (8, 24)])
    full = fastoptim.NorMuon(_clone(params), lr=0.02)
    opt = fastoptim.NorMuon(params, lr=0.02, state_bits=bits)
    for _ in range(3):
        _grads(g, params, full.param_groups[0]["params"])
        opt.step()
        full.step()
    big, small = (opt.state[p] for p in params)
    assert isinstance(big["momentum_buffer"], storage.QuantizedState)
    assert isinstance(small["momentum_buffer"], torch.Tensor)  # (under min_quant_size)
    for state, p in ((big, params[0]), (small, params[1])):
        v = state["second_momentum_buffer"]
        assert type(v) is torch.Tensor and v.shape == (p.shape[0], 1) and v.dtype == torch.float32
    ours, theirs = params[0], full.param_groups[0]["params"][0]
    assert 0 < (ours - theirs).norm() < 0.05 * ours.norm()


def test_use_muon_false_groups_step_with_adamw_and_create_builds_the_recipe():
    """``create(model, "normuon")``: NorMuon for the hidden matrix, AdamW for the rest (the authors'
    NorMuonWithAuxAdam), in one optimizer, against the oracle plus torch's AdamW."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 12),
                                   torch.nn.ReLU(), torch.nn.Linear(12, 3))
    ours_m, ref_m = model(), model()
    opt = fastoptim.create(ours_m, "normuon", lr=0.02, adamw_lr=1e-2, weight_decay=0.05, ns_dtype="float32",
                           head=ours_m[4])
    groups = opt.param_groups
    assert [g["use_muon"] for g in groups] == [True, False, False]
    assert [tuple(p.shape) for p in groups[0]["params"]] == [(16, 6), (12, 16)]
    with pytest.warns(UserWarning, match="the last Linear registered, '4', is taken as the output head"):
        ref = ReferenceMuonRecipe(ref_m, lr=0.02, adamw_lr=1e-2, weight_decay=0.05, reference=ReferenceNorMuon,
                                  ns_dtype="float32", compute_dtype=None)
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        for m, o in ((ours_m, opt), (ref_m, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert "exp_avg_sq" in opt.state[ours_m[4].bias] and "second_momentum_buffer" in opt.state[ours_m[2].weight]


def test_bad_settings_and_params_are_named():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="NorMuon steps 2-D matrices only"):
        fastoptim.NorMuon([torch.nn.Parameter(torch.zeros(4))])
    fastoptim.NorMuon([{"params": [torch.nn.Parameter(torch.zeros(4))], "use_muon": False}])  # AdamW takes it
    for bad, match in ((dict(beta2=1.0), "beta2"), (dict(beta2=-0.1), "beta2"), (dict(norm_eps=-1.0), "norm_eps"),
                       (dict(adjust_lr_fn="spectral"), "adjust_lr_fn"), (dict(ns_steps=-1), "ns_steps")):
        with pytest.raises(ValueError, match=match):
            fastoptim.NorMuon([p], **bad)
    with pytest.raises(ValueError, match="flat=True"):
        fastoptim.NorMuon([p], flat=True)
