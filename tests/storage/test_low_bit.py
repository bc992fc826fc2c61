"""state_bits=16 / 8 / 4 (``fastoptim.storage``): every optimizer at every level, checkpoints, conversions.

Per-step error against the 32-bit optimizer, with the low-bit state re-synced from the 32-bit state before
every step (so errors never accumulate and each step's error is the storage's alone): the L2 norm of the
difference of the two updates over the L2 norm of the 32-bit update, worst of 8 steps, must stay under
``STEP_ERROR`` (about twice what was measured on a random 48x80 matrix: 16-bit 0.16 %, 8-bit 1.05 %, 4-bit 24 %;
Lion, whose update is a sign, 4 % / 9 % / 30 %, from sign flips where its interpolation is near 0).
"""

import copy
import io
import zlib

import pytest
import torch

import fastoptim
from conftest import DEVICES, FLAT, STORED, assert_params_close, quantized, shapes_for
from fastoptim import storage
from fastoptim.levels import LEVELS, record_paths
from fastoptim.registry import OPTIMIZERS
from fastoptim.rules.base import Elementwise
from stored_state import FLIPPED_PARAM_ATOL, stored_state_flips

BITS = STORED
STEP_ERROR = {16: 0.004, 8: 0.025, 4: 0.5, "fp8_e4m3": 0.055}
STEP_ERROR_LION = {16: 0.08, 8: 0.18, 4: 0.6, "fp8_e4m3": 0.25}
SHAPES = [(48, 80), (80,), (3, 5)]  # quantized at min_quant_size=0: the matrices; 1-D stays 32-bit


def _params(seed=0, shapes=SHAPES, name=None, device="cpu"):
    """Params of ``shapes`` (for an optimizer of matrices, ``name``'s, matrices of the same sizes) on ``device``,
    drawn on the CPU (the same numbers on every device), and the generator that draws their grads."""
    g = torch.Generator().manual_seed(seed)
    if name is not None:
        shapes = shapes_for(name, shapes)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes], g


def _grads(g, *param_lists, scale=1.0):
    for ps in zip(*param_lists):
        grad = torch.randn(ps[0].shape, generator=g).to(ps[0].device) * scale
        for p in ps:
            p.grad = grad.clone()


def _option(name):
    return OPTIMIZERS[name].option_sets[1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_per_step_error_against_32_bit_with_state_resynced(name, bits, device):
    spec = OPTIMIZERS[name]
    full_p, g = _params(0, name=name, device=device)
    low_p = [torch.nn.Parameter(p.detach().clone()) for p in full_p]
    full = spec.cls(full_p, impl="loop", **_option(name))
    low = spec.cls(low_p, impl="loop", state_bits=bits, min_quant_size=0, **_option(name))
    # ASGD's one state is ax, the running average of the params, which never feeds back into them: its storage
    # shows in ax alone, measured as ax's error over ax's norm (16-bit 0.19 %, 8-bit 1.1 %, 4-bit 14 %)
    feeds_back = name != "asgd"
    worst = 0.0
    for _ in range(8):
        with torch.no_grad():
            for a, b in zip(low_p, full_p):
                a.copy_(b)
        for a, b in zip(low_p, full_p):  # a plain tensor put into state: converted to the format at the step
            low.state[a] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in full.state[b].items()}
        before = [p.detach().clone() for p in full_p]
        _grads(g, full_p, low_p)
        full.step()
        low.step()
        update = torch.cat([(p - b).flatten() for p, b in zip(full_p, before)])
        error = torch.cat([(a - b).flatten() for a, b in zip(low_p, full_p)])
        if not feeds_back:
            update = torch.cat([full.state[b]["ax"].flatten() for b in full_p])
            error = torch.cat([(storage.torch_value(low.state[a]["ax"], a) - full.state[b]["ax"]).flatten()
                               for a, b in zip(low_p, full_p)])
        worst = max(worst, (error.norm() / update.norm()).item())
    limit = (STEP_ERROR_LION if name == "lion" else STEP_ERROR)[bits]
    if name == "adafactor" and quantized(bits):
        # Adafactor's row and column factors stay fp32 (they are tiny) and 1-D params stay 32-bit at 8/4 bits:
        # nothing here is quantized, so the step is the 32-bit one exactly
        assert worst == 0, worst
        assert {type(v).__name__ for s in low.state.values() for k, v in s.items() if k != "step"} == {"Tensor"}
        return
    assert 0 < worst < limit, worst  # > 0: the state really is stored at fewer bits
    kinds = {type(v).__name__ for s in low.state.values() for k, v in s.items()
             if k != "step" and k not in spec.cls.rule.host_states}
    # (Muon's params are all matrices: every state quantized at 8/4 bits, but for states of another shape than
    # their param's, kept plain: NorMuon's per-row second moment)
    plain = spec.params != "matrices" or any(spec.cls.rule.state_shape(k, p) != tuple(p.shape)
                                             for p in low_p for k in spec.cls.rule.state_names)
    assert kinds == ({"Tensor"} if bits == 16 else {"QuantizedState", "Tensor"} if plain else {"QuantizedState"})


@pytest.mark.sample(("name", "level"), ("level", "bits"))
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_level_steps_low_bit_state_as_the_loop_level_does(name, level, bits):
    """Each level against the loop level in the same format, over 4 steps with nothing re-synced: after every
    step the params agree, and so does every state as stored (codes and absmax, bf16 tensors, plain tensors).
    A code may flip where a value lies within an ulp of a rounding boundary (``stored_state.FLIPS``)."""
    spec = OPTIMIZERS[name]
    base_p, g = _params(1, name=name)
    ours_p = [torch.nn.Parameter(p.detach().clone()) for p in base_p]
    base = spec.cls(base_p, impl="loop", state_bits=bits, min_quant_size=0, **_option(name))
    ours = spec.cls(ours_p, impl=level, state_bits=bits, min_quant_size=0, **_option(name))
    flipped = 0
    for step in range(4):
        _grads(g, base_p, ours_p)
        base.step()
        with record_paths() as paths:
            ours.step()
        own = level
        if any(not isinstance(st, Elementwise) for st in spec.cls.rule.stages):  # a per-tensor stage names its own
            own = {"loop": "stage_loop", "foreach": "stage_batched", "compiled": "stage_compiled"}.get(level)
        assert paths and own in paths if level in ("loop", "foreach", "compiled") else paths
        assert_params_close(ours_p, base_p, atol=FLIPPED_PARAM_ATOL if flipped else 1e-6)
        flipped += stored_state_flips(ours, base, ours_p, base_p, step)
    if quantized(bits) and spec.params != "matrices" and name != "adafactor":
        # the states compared above were stored at fewer bits (Adafactor's factors stay fp32)
        assert any(isinstance(v, storage.QuantizedState) for s in base.state.values() for v in s.values())


@pytest.mark.sample("name", "bits")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_save_load_continue_is_bit_identical_and_the_state_dict_round_trips_byte_exactly(name, bits, device):
    spec = OPTIMIZERS[name]
    a_p, g = _params(2, name=name, device=device)
    b_p = [torch.nn.Parameter(p.detach().clone()) for p in a_p]
    a = spec.cls(a_p, state_bits=bits, min_quant_size=0, **_option(name))
    for _ in range(3):
        _grads(g, a_p)
        a.step()
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    with torch.no_grad():
        for p, q in zip(b_p, a_p):
            p.copy_(q)
    b = spec.cls(b_p, state_bits=bits, min_quant_size=0, **_option(name))
    b.load_state_dict(saved)
    again = b.state_dict()
    for index, entry in a.state_dict()["state"].items():
        assert set(again["state"][index]) == set(entry)
        for k, v in entry.items():
            w = again["state"][index][k]
            assert (torch.equal(v, w) and v.dtype == w.dtype) if isinstance(v, torch.Tensor) else v == w, k
    if quantized(bits) and name != "adafactor":  # (Adafactor quantizes nothing here: fp32 factors, 1-D 32-bit)
        assert any(k.endswith(".format") for e in saved["state"].values() for k in e)
        assert any(v.dtype == torch.uint8 for e in saved["state"].values() for v in e.values()
                   if isinstance(v, torch.Tensor))
    for _ in range(3):
        _grads(g, a_p, b_p)
        a.step()
        b.step()
        assert all(torch.equal(p, q) for p, q in zip(a_p, b_p))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
def test_torch_checkpoints_load_into_low_bit_and_export_back_to_torch(bits, device):
    torch_p, g = _params(3, device=device)
    ours_p = [torch.nn.Parameter(p.detach().clone()) for p in torch_p]
    ref = torch.optim.AdamW(torch_p, lr=1e-2, foreach=False)
    for _ in range(2):
        _grads(g, torch_p)
        ref.step()
    ours = fastoptim.AdamW(ours_p, lr=1e-2, state_bits=bits, min_quant_size=0)
    ours.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for a, b in zip(ours_p, torch_p):
            a.copy_(b)
    _grads(g, torch_p, ours_p)
    ref.step()
    ours.step()  # (the fp32 states were converted to the format as they loaded)
    state = ours.state[ours_p[0]]["exp_avg"]
    assert (state.dtype == torch.bfloat16) if bits == 16 else isinstance(state, storage.QuantizedState)
    assert_params_close(ours_p, torch_p, atol={16: 2e-4, 8: 1e-3, 4: 1e-2, "fp8_e4m3": 1e-2}[bits], rtol=0)  # lr is 1e-2
    # exported: torch.optim loads it and holds the dequantized values
    exported = ours.torch_state_dict()
    back = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ours_p], lr=1e-2)
    back.load_state_dict(exported)
    for p, q in zip(ours_p, back.param_groups[0]["params"]):
        for name in ("exp_avg", "exp_avg_sq"):
            mine = ours.state[p][name]
            want = mine.dequantize() if isinstance(mine, storage.QuantizedState) else mine.float()
            got = back.state[q][name]
            assert got.dtype == torch.float32 and got.shape == p.shape and torch.equal(got, want)


def test_which_params_are_quantized_and_a_group_keeps_its_own_bits():
    emb = torch.nn.Parameter(torch.randn(300, 64))
    big = torch.nn.Parameter(torch.randn(128, 64))
    small = torch.nn.Parameter(torch.randn(16, 16))  # 256 elements < min_quant_size
    bias = torch.nn.Parameter(torch.randn(8192))     # 1-D: never quantized
    opt = fastoptim.AdamW([{"params": [emb], "state_bits": 32}, {"params": [big, small, bias]}], state_bits=8)
    for p in (emb, big, small, bias):
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[emb]["exp_avg"].dtype == torch.float32
    assert isinstance(opt.state[big]["exp_avg"], storage.QuantizedState)
    assert opt.state[big]["exp_avg"].fmt.signed and not opt.state[big]["exp_avg_sq"].fmt.signed
    assert opt.state[small]["exp_avg"].dtype == torch.float32 and opt.state[bias]["exp_avg"].dtype == torch.float32
    assert opt.param_groups[1].get("state_bits") is None  # groups carry it only where it is set


def test_state_memory_at_8_and_4_bits():
    p = torch.nn.Parameter(torch.randn(1024, 1024))
    sizes = {}
    for bits in (32, 8, 4):
        opt = fastoptim.AdamW([p], state_bits=bits)
        p.grad = torch.randn_like(p)
        opt.step()
        sizes[bits] = sum(storage.nbytes(v) for k, v in opt.state[p].items() if k != "step")
    assert sizes[8] / sizes[32] <= 0.27 and sizes[4] / sizes[32] <= 0.15, sizes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("first", [True, False])
def test_a_step_grad_scaler_skips_leaves_the_stored_state_as_it_was(bits, first, device):
    """Re-quantizing dequantized values need not give the same codes: a skipped step must store nothing."""
    ps, g = _params(4, device=device)
    opt = fastoptim.AdamW(ps, lr=1e-2, state_bits=bits, min_quant_size=0)
    if not first:
        _grads(g, ps)
        opt.step()
    before = copy.deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in ps]
    _grads(g, ps)
    opt.grad_scale = torch.tensor(1.0, device=device)
    opt.found_inf = torch.tensor(1.0, device=device)
    opt.step()
    del opt.grad_scale, opt.found_inf
    after = opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(ps, params_before))
    assert set(after["state"]) == set(before["state"])
    for index, entry in before["state"].items():
        for k, v in entry.items():
            w = after["state"][index][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w


def test_bad_state_bits_and_bad_checkpoints_are_named_and_change_nothing():
    p = torch.nn.Parameter(torch.randn(64, 64))
    with pytest.raises(ValueError, match="Invalid state_bits: 7"):
        fastoptim.AdamW([p], state_bits=7)
    opt = fastoptim.AdamW([p], state_bits=8, min_quant_size=0)
    with pytest.raises(ValueError, match="Invalid state_bits of a param group: 12"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "state_bits": 12})
    p.grad = torch.randn_like(p)
    opt.step()
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    bad["state"][0]["exp_avg.codes"] = bad["state"][0]["exp_avg.codes"][:10]
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"param 0: state 'exp_avg': codes must be a uint8 tensor of shape"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(good)  # the string form of checkpoints saved before format ids, checked as it was
    bad["state"][0]["exp_avg.format"] = "dynamic9s/256 [64, 64]"
    with pytest.raises(ValueError, match="unknown quantized state format 'dynamic9s/256'"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(good)
    bad["state"][0]["exp_avg.format"] = "dynamic8s/256 [64, 63]"
    with pytest.raises(ValueError, match=r"saved for a param of shape \[64, 63\], this param has shape \[64, 64\]"):
        opt.load_state_dict(bad)
    now = opt.state_dict()
    for k, v in before["state"][0].items():
        assert torch.equal(v, now["state"][0][k]) if isinstance(v, torch.Tensor) else v == now["state"][0][k]


def test_reset_state_is_made_again_in_its_format():
    ps, g = _params(5)
    opt = fastoptim.Adam(ps, lr=1e-2, state_bits=8, min_quant_size=0)
    _grads(g, ps)
    opt.step()
    opt.state.clear()
    _grads(g, ps)
    opt.step()
    assert isinstance(opt.state[ps[0]]["exp_avg"], storage.QuantizedState) and opt.state[ps[0]]["step"] == 1
    opt.state[ps[0]]["exp_avg"] = torch.zeros_like(ps[0])  # replaced by a plain tensor: quantized again
    _grads(g, ps)
    opt.step()
    assert isinstance(opt.state[ps[0]]["exp_avg"], storage.QuantizedState)


def test_torch_optim_refuses_a_quantized_state_dict_loudly():
    """No quantized entry keeps the state's own name, so torch.optim cannot take codes for moments."""
    ps, g = _params(6)
    ours = fastoptim.AdamW(ps, state_bits=8, min_quant_size=0)
    _grads(g, ps)
    ours.step()
    sd = ours.state_dict()
    assert "exp_avg" not in sd["state"][0] and sd["state"][0]["exp_avg.format"] == zlib.crc32(b"dynamic8s/256")
    ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps])
    ref.load_state_dict(sd)
    for p in ref.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    with pytest.raises(KeyError, match="exp_avg"):
        ref.step()


@pytest.mark.parametrize("form", ["shape entry", "string"])
def test_a_4_bit_checkpoint_of_another_row_length_is_refused(form):
    """(48, 80) and (48, 79) pack to the same code and absmax shapes: the ``.shape`` entry tells them apart (an id
    names the format alone), as the string entry of checkpoints saved before format ids did; nothing changes."""
    a = torch.nn.Parameter(torch.randn(48, 80))
    opt = fastoptim.AdamW([a], state_bits=4, min_quant_size=0)
    a.grad = torch.randn_like(a)
    opt.step()
    b = torch.nn.Parameter(torch.randn(48, 79))
    other = fastoptim.AdamW([b], state_bits=4, min_quant_size=0)
    saved = opt.state_dict()
    assert saved["state"][0]["exp_avg.shape"].tolist() == [48, 80]
    if form == "string":
        saved["state"][0]["exp_avg.format"] = "dynamic4s/128 [48, 80]"
        del saved["state"][0]["exp_avg.shape"]
    with pytest.raises(ValueError, match=r"saved for a param of shape \[48, 80\].*torch_state_dict"):
        other.load_state_dict(saved)
    assert not other.state


def test_a_tiny_second_moment_beside_a_large_one_is_never_divided_as_zero():
    """One large grad in a block and tiny ones around it: at 8 bits the tiny second moments must not round
    to 0 (m / eps would step thousands of times too far). The update stays within the 32-bit one's size."""
    steps = {}
    for bits in (32, 8, 4):
        p = torch.nn.Parameter(torch.zeros(4, 256))
        opt = fastoptim.Adam([p], lr=1e-3, state_bits=bits, min_quant_size=0)
        grad = torch.full((4, 256), 1e-4)
        grad[:, 0] = 1.0
        p.grad = grad
        opt.step()
        before = p.detach().clone()
        p.grad = torch.zeros(4, 256)
        opt.step()
        steps[bits] = (p - before)[:, 1:].abs().max().item()
    assert steps[8] <= 1.5 * steps[32] and steps[4] <= 1.5 * steps[32], steps


def test_centered_rmsprop_refuses_quantized_state_by_name():
    p = torch.nn.Parameter(torch.randn(64, 64))
    with pytest.raises(ValueError, match=r"RMSprop with state_bits=8: centered=True takes sqrt"):
        fastoptim.RMSprop([p], centered=True, state_bits=8)
    opt = fastoptim.RMSprop([p], state_bits=8, min_quant_size=0)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[0]["centered"] = True  # edited by hand: refused at the next step, nothing changed
    before = p.detach().clone()
    with pytest.raises(ValueError, match="centered=True"):
        opt.step()
    assert torch.equal(p, before) and opt.state[p]["step"] == 1


@pytest.mark.parametrize("bits", BITS)
def test_the_loading_optimizer_keeps_its_own_state_bits(bits):
    """A checkpoint says what the state was; the optimizer it is loaded into says how it is kept."""
    ps, g = _params(7)
    saver = fastoptim.AdamW(ps, lr=1e-2, state_bits=bits, min_quant_size=0)
    _grads(g, ps)
    saver.step()
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    loader = fastoptim.AdamW([{"params": qs[:1], "state_bits": bits}, {"params": qs[1:]}], lr=1e-2,
                             min_quant_size=0)
    sd = saver.state_dict()  # regrouped as the loader's two groups
    sd["param_groups"] = [{**sd["param_groups"][0], "params": [0]},
                          {**sd["param_groups"][0], "params": [1, 2]}]
    loader.load_state_dict(sd)
    assert loader.param_groups[0]["state_bits"] == bits and "state_bits" not in loader.param_groups[1]
    _grads(g, qs)
    loader.step()
    kept = loader.state[qs[0]]["exp_avg"]
    assert (kept.dtype == torch.bfloat16) if bits == 16 else isinstance(kept, storage.QuantizedState)
    assert loader.state[qs[1]]["exp_avg"].dtype == torch.float32  # the loader's second group is 32-bit


def test_state_bits_edited_on_a_group_apply_at_the_next_step_and_are_checked():
    p = torch.nn.Parameter(torch.randn(64, 128))
    opt = fastoptim.AdamW([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[0]["state_bits"] = 8
    p.grad = torch.randn_like(p)
    opt.step()
    assert isinstance(opt.state[p]["exp_avg"], storage.QuantizedState)
    opt.param_groups[0]["state_bits"] = 7
    before = p.detach().clone()
    with pytest.raises(ValueError, match="Invalid state_bits of a param group: 7"):
        opt.step()
    assert torch.equal(p, before)


# --- flat mode ---------------------------------------------------------------------------------------------

FLAT_SHAPES = [(80,), (48, 80), (3, 5), (64, 70), (7,)]  # 1-D and small params between the quantized ones


@pytest.mark.sample("name", "bits")
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", FLAT)
def test_flat_mode_steps_low_bit_state_as_without_it(name, bits):
    """flat=True at 16/8/4 bits: the same numbers as flat=False at every step, params and state (bit for bit
    where a state is quantized; the plain tail within fp32 tolerance: torch's fused CPU kernel rounds a flat
    buffer's elements and a list's last elements in different vector lanes, 1 ulp apart); params and grads
    are views of one buffer; the plain (or 16-bit) states of the rest are views of one buffer that holds only
    those params; quantized states are views of one codes and one absmax buffer per state."""
    opts = dict(_option(name))
    if quantized(bits) and OPTIMIZERS[name].cls.rule.refuses_quantized_state({**OPTIMIZERS[name].cls.rule.defaults,
                                                                             **opts}):
        opts = dict(OPTIMIZERS[name].option_sets[0])
    kw = dict(impl="fused", state_bits=bits, min_quant_size=1000, **opts)
    flat_p, g = _params(3, FLAT_SHAPES, name=name)
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in flat_p]
    flat = OPTIMIZERS[name].cls(flat_p, flat=True, **kw)
    ref = OPTIMIZERS[name].cls(ref_p, **kw)
    quantized_params = {1, 3} if quantized(bits) else set()
    for step in range(4):
        _grads(g, flat_p, ref_p)
        with record_paths() as paths:
            flat.step()
        ref.step()
        rule = OPTIMIZERS[name].cls.rule
        if rule.stages:  # quantized and plain states in one bucket through fp32 temporaries: one call a stage
            assert len(paths) == len(rule.stages) and paths.count("stage_batched") == 1, paths
        elif quantized(bits):  # one kernel call over the quantized params, one pass over the plain tail
            assert sorted(paths) == sorted(["cpu_kernel", OPTIMIZERS[name].cls.rule.torch_fused and "torch_fused"
                                            or paths[-1]]) and len(paths) == 2, paths
        for i, (a, b) in enumerate(zip(flat_p, ref_p)):
            assert torch.equal(a, b) if i in quantized_params else torch.allclose(a, b, atol=1e-6, rtol=1e-5), (i, step)
        flat_sd, ref_sd = flat.state_dict()["state"], ref.state_dict()["state"]
        assert flat_sd.keys() == ref_sd.keys()
        for a, b in ((flat_sd[i], ref_sd[i]) for i in ref_sd):
            assert a.keys() == b.keys()
            for k in a:
                if not isinstance(a[k], torch.Tensor):
                    assert a[k] == b[k], k
                elif a[k].is_floating_point() and "absmax" not in k:
                    torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
                else:  # codes and absmax: exact
                    assert torch.equal(a[k], b[k]), k
    (fb,) = flat._stepper.flat_buckets[0]
    assert all(p.data_ptr() == v.data_ptr() and p.grad.data_ptr() == w.data_ptr()
               for p, v, w in zip(fb.params, fb.param_views, fb.grad_views))
    # (each param starts 16 bytes aligned in the buffers: fp32 params are laid out 4 elements at a time)
    tail = sum(-(-p.numel() // 4) * 4 for i, p in enumerate(flat_p) if i not in quantized_params)
    for i, p in enumerate(flat_p):
        for k, v in flat.state[p].items():
            if k == "step" or k in flat.rule.host_states:  # (host numbers)
                continue
            if i in quantized_params:
                assert isinstance(v, storage.QuantizedState)
                for view, buffer in zip((v.codes, v.absmax), fb.pool(k)):
                    assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
                    assert buffer.data_ptr() <= view.data_ptr() < buffer.data_ptr() + buffer.nbytes
            else:
                buffer = fb.state_buffers[k]
                assert buffer.numel() == tail and buffer.dtype == (torch.bfloat16 if bits == 16 else torch.float32)
                assert buffer.data_ptr() <= v.data_ptr() < buffer.data_ptr() + buffer.nbytes


@pytest.mark.parametrize("bits", [8, 4])
def test_flat_mode_low_bit_checkpoint_and_changed_settings(bits):
    """Save -> load -> continue is bit-identical in flat mode; a group's state_bits edited between steps takes
    effect at the next step (states converted) and matches a flat=False optimizer edited the same way."""
    kw = dict(lr=1e-2, state_bits=bits, min_quant_size=1000)
    params, g = _params(5, FLAT_SHAPES)
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(6)]

    def run(ps, opt, steps):
        for gs in steps:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()

    straight = copy.deepcopy(params)
    run(straight, fastoptim.AdamW(straight, flat=True, **kw), grads)
    first = copy.deepcopy(params)
    opt = fastoptim.AdamW(first, flat=True, **kw)
    run(first, opt, grads[:3])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    resumed = copy.deepcopy(first)
    opt2 = fastoptim.AdamW(resumed, flat=True, **kw)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf))
    run(resumed, opt2, grads[3:])
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)

    flat_p = copy.deepcopy(params)
    ref_p = copy.deepcopy(params)
    flat, ref = fastoptim.AdamW(flat_p, flat=True, **kw), fastoptim.AdamW(ref_p, **kw)
    run(flat_p, flat, grads[:2])
    run(ref_p, ref, grads[:2])
    for o in (flat, ref):
        o.param_groups[0]["state_bits"] = 32
    run(flat_p, flat, grads[2:4])
    run(ref_p, ref, grads[2:4])
    for o in (flat, ref):
        o.param_groups[0]["state_bits"] = 16
    run(flat_p, flat, grads[4:])
    run(ref_p, ref, grads[4:])
    assert_params_close(flat_p, ref_p)
    assert all(v.dtype == torch.bfloat16 for s in flat.state.values() for k, v in s.items() if k != "step")


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("new_bits", [32, 8, 4])
def test_state_bits_edited_from_16_converts_the_bf16_states_of_every_param(new_bits, flat):
    """At 16 bits every state is bf16; at 32, or for the small and 1-D params that stay plain at 8/4 bits,
    the bf16 states convert to the param's dtype at the next step (as torch's loader casts them), and the run
    goes on as an optimizer started at 16 bits and switched the same way without flat mode."""
    runs = []
    for is_flat in (flat, False):
        params, g = _params(7, FLAT_SHAPES)
        opt = fastoptim.AdamW(params, lr=1e-2, state_bits=16, min_quant_size=1000, flat=is_flat)
        for step in range(4):
            if step == 2:
                opt.param_groups[0]["state_bits"] = new_bits
            _grads(g, params)
            opt.step()
        runs.append((params, opt))
    (ps, opt), (ref_ps, _) = runs
    assert_params_close(ps, ref_ps)
    for p in ps:
        for name in ("exp_avg", "exp_avg_sq"):
            state = opt.state[p][name]
            kept = storage.format_for(p, name, new_bits, 1000, opt.rule.unsigned_states)
            assert isinstance(state, storage.QuantizedState) if kept.quantized else state.dtype == torch.float32


def test_the_compiled_level_on_the_cpu_runs_low_bit_state_through_the_fused_kernel_and_says_so(monkeypatch):
    """Routing on (the library's default; the tests run with it off): the CPU kernel, with a warning; own
    paths: the compiled level itself, staged. The same numbers either way, within fp32 tolerance."""
    import warnings
    from fastoptim.engine import dispatch as levels

    monkeypatch.setattr(levels, "ROUTING", True)
    results = {}
    for routed in (True, False):
        ps, g = _params(11)
        opt = fastoptim.AdamW(ps, impl="compiled", state_bits=8, min_quant_size=0)
        levels._said.discard("compiled")
        with levels.own_paths(not routed), warnings.catch_warnings(record=True) as caught, record_paths() as paths:
            warnings.simplefilter("always")
            for _ in range(2):
                _grads(g, ps)
                opt.step()
        assert ("cpu_kernel" in paths) == routed and ("compiled" in paths) == (not routed), paths
        assert any("16/8/4 bits" in str(w.message) for w in caught) == routed
        results[routed] = ps
    assert_params_close(results[True], results[False])


def test_pooled_states_are_disjoint_aligned_views_of_their_shapes():
    """``storage.pooled`` (flat mode's head states): one view per quantized shape, of the codes and absmax shapes
    of a state of its own, each 16-byte aligned in its buffer, none overlapping another."""
    shapes = [(5, 33), (7,), (3, 4, 65), (2, 3, 4, 17), (1, 1)]
    formats = [storage.Format(8), None, storage.Format(4, signed=False), storage.Format(8, signed=False),
               storage.Format(4)]
    states, (codes, absmax) = storage.pooled([torch.Size(s) for s in shapes], formats, "cpu")
    spans = {"codes": [], "absmax": []}
    for shape, fmt, state in zip(shapes, formats, states):
        if fmt is None:
            assert state is None
            continue
        own = storage.make(torch.zeros(shape), fmt, 0.0)
        assert state.fmt == fmt and state.shape == own.shape
        for kind, view, mine, buffer in (("codes", state.codes, own.codes, codes),
                                         ("absmax", state.absmax, own.absmax, absmax)):
            assert view.shape == mine.shape and view.dtype == mine.dtype and view.is_contiguous()
            offset = view.data_ptr() - buffer.data_ptr()
            assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() and offset % 16 == 0
            assert offset + view.nbytes <= buffer.nbytes
            spans[kind].append((offset, offset + view.nbytes))
    for kind, span in spans.items():
        span.sort()
        assert all(end <= start for (_, end), (start, _) in zip(span, span[1:])), kind


def test_a_plain_state_re_typed_in_place_beside_quantized_ones_still_steps():
    """The params the CPU kernel leaves to torch's kernels keep a cache across steps; whether their states are
    plain is still looked at each step (``s.data = s.data.to(bf16)`` is not a replaced state)."""
    torch.manual_seed(0)
    big, small = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(32))
    opt = fastoptim.AdamW([big, small], lr=0.01, state_bits=8, min_quant_size=1000)
    for step in range(3):
        big.grad, small.grad = torch.randn(64, 128), torch.randn(32)
        if step == 2:
            s = opt.state[small]["exp_avg"]
            s.data = s.data.to(torch.bfloat16)
            before = small.detach().clone()
        opt.step()
    assert not torch.equal(small, before) and opt.state[small]["step"] == 3
