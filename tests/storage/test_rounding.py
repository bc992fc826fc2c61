"""bf16/fp16 params without an fp32 master copy: ``rounding="nearest" | "stochastic" | "kahan"``.

With stochastic or Kahan rounding a 16-bit param steps through fp32 temporaries (the rule's math in fp32) and
is rounded back: stochastically (unbiased, from a random stream kept in the optimizer state) or to nearest
with a 16-bit compensation buffer that keeps what rounding lost.

The numeric tests run on every device there is (conftest.DEVICES); random values are drawn on the CPU and moved,
so each device gets the same numbers."""

import copy

import pytest
import torch

import fastoptim
from conftest import DEVICES
from fastoptim import storage
from fastoptim.levels import LEVELS, record_paths

BF16_ULP_AT_1 = 2 ** -7


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [1.0 + 2 ** -9, -(1.0 + 3 * 2 ** -10), 3.14159, -2.5e-30, 1e30, 0.7 + 1e-4])
def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour(value, device):
    n = 1 << 20
    x = torch.full((n,), value, dtype=torch.float32, device=device)
    r = storage.rounding.stochastic_round(x, key=987654321).float()
    down = x.to(torch.bfloat16).float()[0].item()  # one neighbour (to nearest), the other one ulp away
    below = torch.tensor(value).to(torch.bfloat16)
    neighbours = {float(below.float()), float(torch.nextafter(below, torch.tensor(float("inf"), dtype=torch.bfloat16)).float()),
                  float(torch.nextafter(below, torch.tensor(-float("inf"), dtype=torch.bfloat16)).float())}
    assert set(r.unique().tolist()) <= neighbours and down in neighbours
    assert len(set(r.unique().tolist())) == 2  # both neighbours drawn: the fraction is not 0
    mean, se = r.double().mean().item(), r.double().std().item() / n ** 0.5
    assert abs(mean - value) < 5 * se, (mean, value, se)


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_keeps_exact_values_nan_and_inf(device):
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, float("inf"), -float("inf"), float("nan"), 2 ** -133], device=device)
    r = storage.rounding.stochastic_round(x, key=5)
    assert r.float()[:6].tolist() == [1.0, -2.0, 0.0, -0.0, float("inf"), -float("inf")]
    assert torch.isnan(r[6]) and r.dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
def test_the_random_stream_depends_on_the_key_and_the_element_only(device):
    x = torch.full((4096,), 1.0 + 2 ** -9, device=device)
    a, b, c = (storage.rounding.stochastic_round(x, key=k) for k in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(storage.rounding.stochastic_round(x.view(64, 64), key=1).view(-1), a)


def _descend(mode: str, impl: str, steps: int = 200, name: str = "SGD", device="cpu", **kw):
    """Updates of 1e-4 a step on params of 1.0, far below bf16's ulp there (2**-7)."""
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    p = torch.nn.Parameter(torch.ones(32, 96, dtype=dtype, device=device))
    opt = getattr(fastoptim, name)([p], lr=1e-4, impl=impl, rounding="nearest" if mode == "fp32" else mode, **kw)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
    return p.detach().float(), opt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", LEVELS)
def test_stochastic_and_kahan_follow_fp32_where_nearest_stalls_at_every_level(impl, device):
    fp32, _ = _descend("fp32", impl, device=device)
    nearest, _ = _descend("nearest", impl, device=device)
    assert torch.equal(nearest, torch.ones_like(nearest))  # every update rounds away
    # measured, as a share of the distance fp32 travels (0.02): stochastic 0.9 %, Kahan 2.4 % (its 16-bit
    # compensation rounds the same way every step here, so its error adds up)
    for mode, share in (("stochastic", 0.02), ("kahan", 0.05)):
        got, opt = _descend(mode, impl, device=device)
        gap = (got.mean() - fp32.mean()).abs().item()
        assert gap < share * (1 - fp32.mean().item()), (mode, got.mean().item(), fp32.mean().item())
        assert set(opt.state[opt.param_groups[0]["params"][0]]) == {storage.rounding.KAHAN if mode == "kahan" else storage.rounding.RNG}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_every_level_rounds_the_same_numbers(mode, device):
    """SGD with momentum: one rounding per operation in fp32 at every level, so every level agrees exactly."""
    results = {}
    for impl in LEVELS:
        g = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(40, 70, generator=g).to(device, torch.bfloat16))
        opt = fastoptim.SGD([p], lr=1e-3, momentum=0.9, impl=impl, rounding=mode)
        for _ in range(5):
            p.grad = torch.randn(p.shape, generator=g).to(device, torch.bfloat16)
            opt.step()
        results[impl] = p.detach().clone()
    for impl in LEVELS:
        assert torch.equal(results[impl], results["loop"]), impl


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_save_load_continue_is_bit_identical(mode, bits, device):
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device, torch.bfloat16)) for s in [(64, 80), (80,)]]
    grads = [[torch.randn(p.shape, generator=g).to(device, torch.bfloat16) for p in params] for _ in range(6)]
    kw = dict(lr=1e-3, rounding=mode, state_bits=bits, min_quant_size=0)

    def run(ps, opt, steps):
        for gs in steps:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()

    straight = copy.deepcopy(params)
    run(straight, fastoptim.AdamW(straight, **kw), grads)
    first = copy.deepcopy(params)
    opt = fastoptim.AdamW(first, **kw)
    run(first, opt, grads[:3])
    saved = copy.deepcopy(opt.state_dict())
    assert all((storage.rounding.RNG if mode == "stochastic" else storage.rounding.KAHAN) in entry for entry in saved["state"].values())
    resumed = copy.deepcopy(first)
    opt2 = fastoptim.AdamW(resumed, **kw)
    opt2.load_state_dict(saved)
    run(resumed, opt2, grads[3:])
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)
    torch_sd = opt2.torch_state_dict()  # torch.optim has no use for the rounding's own state
    assert not any(set(entry) & set(storage.rounding.ROUNDING_STATES) for entry in torch_sd["state"].values())
    twin = [torch.nn.Parameter(p.detach().clone()) for p in resumed]
    torch.optim.AdamW(twin, lr=1e-3).load_state_dict(torch_sd)


def test_a_param_group_sets_its_own_rounding_and_fp32_params_are_untouched_by_it():
    bf = torch.nn.Parameter(torch.ones(8, 8, dtype=torch.bfloat16))
    kahan = torch.nn.Parameter(torch.ones(8, 8, dtype=torch.bfloat16))
    full = torch.nn.Parameter(torch.ones(8, 8))
    opt = fastoptim.SGD([{"params": [bf, full]}, {"params": [kahan], "rounding": "kahan"}], lr=1e-4,
                        rounding="stochastic")
    for p in (bf, kahan, full):
        p.grad = torch.ones_like(p)
    opt.step()
    assert set(opt.state[bf]) == {storage.rounding.RNG} and set(opt.state[kahan]) == {storage.rounding.KAHAN}
    assert full not in opt.state or not opt.state[full]  # fp32 params step as ever
    assert torch.equal(full.detach(), torch.full((8, 8), 1 - 1e-4))


def test_bad_rounding_is_named_and_changes_nothing():
    p = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="Invalid rounding: 'up'"):
        fastoptim.AdamW([p], rounding="up")
    with pytest.raises(ValueError, match="flat=True rounds to nearest"):
        fastoptim.AdamW([p], rounding="kahan", flat=True)
    opt = fastoptim.AdamW([p], rounding="stochastic")
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="fp16 params: use rounding='kahan'"):
        opt.step()
    assert torch.equal(p.detach(), before) and not opt.state
    opt.param_groups[0]["rounding"] = "kahan"  # the message's advice works
    opt.step()
    assert set(opt.state[p]) == {"exp_avg", "exp_avg_sq", "step", storage.rounding.KAHAN}


def test_a_step_grad_scaler_skips_draws_nothing_and_rounds_nothing():
    p = torch.nn.Parameter(torch.ones(16, 16, dtype=torch.bfloat16))
    opt = fastoptim.SGD([p], lr=1e-4, rounding="stochastic")
    p.grad = torch.ones_like(p)
    opt.step()
    draws = opt.state[p][storage.rounding.RNG].clone()
    before = p.detach().clone()
    opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
    opt.step()
    assert torch.equal(p.detach(), before) and torch.equal(opt.state[p][storage.rounding.RNG], draws)


def test_low_bit_state_with_stochastic_rounding_runs_the_staged_path():
    p = torch.nn.Parameter(torch.randn(64, 128).to(torch.bfloat16))
    opt = fastoptim.AdamW([p], state_bits=8, min_quant_size=0, rounding="stochastic", impl="fused")
    p.grad = torch.randn_like(p)
    with record_paths() as paths:
        opt.step()
    assert paths == ["torch_fused"]  # the fp32 temporaries take torch's own fused kernel on the CPU
    assert isinstance(opt.state[p]["exp_avg"], storage.QuantizedState)


@pytest.mark.sample("impl", "bits")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("impl", LEVELS)
def test_bf16_params_with_quantized_state_step_in_fp32_and_round_once(impl, bits, device):
    """bf16 params whose states are quantized: the rule's math runs in fp32 on the dequantized states and the
    param is rounded to nearest once, so each step equals an fp32 twin's step (same codes loaded) rounded once
    (bf16 temporaries would round the states and every operation on the way)."""
    g = torch.Generator().manual_seed(2)
    p = torch.nn.Parameter(torch.randn(40, 300, generator=g).to(device, torch.bfloat16))
    twin = torch.nn.Parameter(p.detach().float())
    kw = dict(lr=1e-2, weight_decay=0.1, state_bits=bits, min_quant_size=0, impl=impl)
    opt, ref = fastoptim.AdamW([p], **kw), fastoptim.AdamW([twin], **kw)
    for _ in range(3):
        with torch.no_grad():
            twin.copy_(p.float())
        if opt.state:
            ref.load_state_dict(opt.state_dict())
        grad = torch.randn(p.shape, generator=g).to(device, torch.bfloat16)
        p.grad, twin.grad = grad, grad.float()
        opt.step()
        ref.step()
        rounded = twin.detach().to(torch.bfloat16)
        if impl == "loop":  # the same math to the bit: equal
            assert torch.equal(p.detach(), rounded)
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][name].codes, ref.state[twin][name].codes)
        else:  # the fp32 twin takes the level's in-kernel path, the bf16 one torch's fused kernel on fp32
            # temporaries: last-bit differences in fp32 (of the update's size, lr = 1e-2) flip a rounding now
            # and then, never by more than 1 ulp of the result plus those differences
            off = p.detach().float() != rounded.float()
            one_ulp = rounded.float().abs() * BF16_ULP_AT_1 + 1e-8  # bf16 keeps 8 significant bits
            assert off.float().mean() < 0.01 and ((p.detach().float() - rounded.float()).abs() <= one_ulp).all()


@pytest.mark.parametrize("name,bad", [
    (storage.rounding.KAHAN, torch.zeros(3, dtype=torch.bfloat16)),
    (storage.rounding.KAHAN, torch.zeros(16, 16, dtype=torch.int32)),
    (storage.rounding.RNG, torch.zeros(3, dtype=torch.int64)),
    (storage.rounding.RNG, torch.zeros(2, dtype=torch.float32)),
])
def test_a_bad_rounding_state_put_in_by_hand_is_named_before_anything_steps(name, bad):
    mode = "kahan" if name == storage.rounding.KAHAN else "stochastic"
    p = torch.nn.Parameter(torch.randn(16, 16).to(torch.bfloat16))
    opt = fastoptim.AdamW([p], lr=1e-2, rounding=mode)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.state[p][name] = bad
    before = copy.deepcopy(opt.state_dict())
    param_before = p.detach().clone()
    with pytest.raises(ValueError, match=f"state '{name}' of param 0 must be"):
        opt.step()
    assert torch.equal(p.detach(), param_before)
    after = opt.state_dict()
    for k, v in before["state"][0].items():
        assert torch.equal(v, after["state"][0][k]) if isinstance(v, torch.Tensor) else v == after["state"][0][k], k


def test_complex32_params_with_stochastic_or_kahan_rounding_are_refused_by_name():
    p = torch.nn.Parameter(torch.randn(8, 2).to(torch.complex32))
    for mode in ("stochastic", "kahan"):
        opt = fastoptim.AdamW([p], rounding=mode)
        p.grad = torch.randn(8, 2).to(torch.complex32)
        with pytest.raises(ValueError, match="complex32 params: use rounding='nearest'"):
            opt.step()
        assert not opt.state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_clipping_in_the_step_rounds_the_same_numbers_at_every_level(mode, device):
    """max_grad_norm's factor comes from the bf16 grads' norm; the fp32 temporaries step with it at every level
    (torch's fused kernels take it only as fp32)."""
    results = {}
    for impl in LEVELS:
        g = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(torch.randn(64, 96, generator=g).to(device, torch.bfloat16))
        b = torch.nn.Parameter(torch.randn(96, generator=g).to(device, torch.bfloat16))
        opt = fastoptim.AdamW([w, b], lr=1e-3, impl=impl, rounding=mode, max_grad_norm=1.0, state_bits=8)
        for _ in range(3):
            w.grad = torch.randn(w.shape, generator=g).to(device, torch.bfloat16)
            b.grad = torch.randn(b.shape, generator=g).to(device, torch.bfloat16)
            opt.step()
        results[impl] = (w.detach().clone(), b.detach().clone())
    for impl, (w, b) in results.items():
        assert torch.equal(w, results["loop"][0]) and torch.equal(b, results["loop"][1]), impl
