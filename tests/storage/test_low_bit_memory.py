"""Low-bit state never passes through a temporary of the whole tensor: it is made as codes, and every conversion
(a torch.optim checkpoint loaded, ``torch_state_dict()``, ``state_bits`` edited, a state copied in) runs span by
span (``quant.spans``), so its temporaries are bounded by ``quant.CHUNK`` elements whatever the tensor's size.

Measured as torch's memory profiler sees it: the peak of the bytes held by live tensors over the block, above
what was live when it began (allocations minus frees in time order)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fastoptim
from fastoptim import storage
from fastoptim.levels import record_paths
from fastoptim.storage import quant

ROWS, COLS = 2048, 1024  # 2M elements: a whole-tensor fp32 temporary is 8 MiB, the conversions' bound ~2 MiB
SPAN_BYTES = 40 * quant.CHUNK  # a span's temporaries: at most ~33 bytes an element (codes as int32, fp32 blocks)


def peak_above_start(fn) -> tuple[int, object]:
    """(the peak of live tensors' bytes while ``fn`` runs, above those live when it started; what it returned)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, out


def _adamw(bits, **kw):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(ROWS, COLS))
    p.grad = torch.randn(ROWS, COLS)
    return p, fastoptim.AdamW([p], lr=1e-3, state_bits=bits, **kw)


def _state_bytes(opt, p) -> int:
    return sum(storage.nbytes(v) for v in opt.state[p].values())


@pytest.mark.parametrize("bits", [8, 4])
def test_the_first_step_makes_low_bit_state_as_codes(bits):
    """The first step's peak above params and grads is the low-bit state itself plus at most a span (the
    fp32 zeros quantized whole took 21 bytes an element: 40 MiB here)."""
    p, opt = _adamw(bits, impl="fused")
    with record_paths() as paths:
        peak, _ = peak_above_start(opt.step)
    assert paths == ["cpu_kernel"]
    state = _state_bytes(opt, p)
    assert all(isinstance(opt.state[p][name], storage.QuantizedState) for name in ("exp_avg", "exp_avg_sq"))
    assert state <= peak <= state + SPAN_BYTES, (peak, state)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_torch_optim_checkpoint_converts_as_it_loads(bits):
    """A torch.optim fp32 checkpoint loaded into low-bit state: no copy of its tensors, converted at once."""
    p, opt = _adamw(bits)
    ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())], lr=1e-3)
    ref.param_groups[0]["params"][0].grad = p.grad.clone()
    ref.step()
    saved = ref.state_dict()
    peak, _ = peak_above_start(lambda: opt.load_state_dict(saved))
    state = _state_bytes(opt, p)
    assert isinstance(opt.state[p]["exp_avg"], storage.QuantizedState)
    assert state <= peak <= state + SPAN_BYTES, (peak, state)
    for name in ("exp_avg", "exp_avg_sq"):  # the values are the checkpoint's, quantized
        want = storage.QuantizedState.of(saved["state"][0][name], opt.state[p][name].fmt)
        assert torch.equal(opt.state[p][name].codes, want.codes)
        assert torch.equal(opt.state[p][name].absmax, want.absmax)
    opt.step()  # and it steps from there


@pytest.mark.parametrize("bits", [8, 4])
def test_torch_state_dict_holds_only_its_own_output(bits):
    """``torch_state_dict()``: the fp32 tensors it returns, plus at most a span (and the codes' copies)."""
    p, opt = _adamw(bits)
    opt.step()
    state = _state_bytes(opt, p)
    peak, out = peak_above_start(opt.torch_state_dict)
    output = sum(v.nbytes for v in out["state"][0].values() if isinstance(v, torch.Tensor) and v.dim())
    assert output == 2 * 4 * ROWS * COLS
    assert output <= peak <= output + state + SPAN_BYTES, (peak, output)
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(out["state"][0][name], opt.state[p][name].dequantize())


@pytest.mark.parametrize("old,new", [(8, 4), (4, 8), (8, 16)])
def test_state_bits_edited_converts_span_by_span(old, new):
    """A group's ``state_bits`` edited between steps: the new states plus at most a span (before, each went
    through an fp32 copy of the whole tensor)."""
    p, opt = _adamw(old, impl="foreach")
    opt.step()
    before = {name: opt.state[p][name].dequantize() for name in ("exp_avg", "exp_avg_sq")}
    opt.param_groups[0]["state_bits"] = new
    formats = {name: opt._stepper.state_format(p, name, opt.param_groups[0]) for name in before}
    peak, converted = peak_above_start(
        lambda: {name: storage.adopt(opt.state[p][name], p, fmt) for name, fmt in formats.items()})
    new_bytes = sum(storage.nbytes(v) for v in converted.values())
    assert new_bytes <= peak <= new_bytes + SPAN_BYTES, (peak, new_bytes)
    for name, value in converted.items():  # the values converted, as from the dequantized values
        fmt = formats[name]
        if isinstance(value, storage.QuantizedState):
            want = storage.QuantizedState.of(before[name], fmt)
            assert torch.equal(value.codes, want.codes) and torch.equal(value.absmax, want.absmax)
        else:
            assert torch.equal(value, before[name].to(value.dtype))


@pytest.mark.parametrize("fmt", [storage.Format(8, True), storage.Format(8, False), storage.Format(4, True),
                                 storage.Format(4, False)], ids=lambda f: f.tag)
@pytest.mark.parametrize("shape", [(3, 1000), (7, 3, 257), (2, 3 * quant.CHUNK + 77), (5, 1)])
@pytest.mark.parametrize("value", [0.0, 1.5, -2.0])
def test_a_constant_state_is_the_codes_quantizing_it_gives(fmt, shape, value):
    """``make`` writes codes and absmax directly: byte for byte what quantizing the full tensor gives (rows
    longer than a span included, and a 4-bit row's pad nibble)."""
    made = storage.make(torch.empty(shape), fmt, value)
    x = torch.full(shape, value)
    rows, length = quant.rows_of(shape)
    blocks = -(-length // fmt.block)
    want_absmax = torch.full((rows, blocks), abs(value))
    normalized = torch.full((rows, length), 0.0 if value == 0 else value / abs(value))
    code = int(torch.argmin((fmt.qmap.table()[None, :] - normalized[:1, :1].T).abs()))
    want_codes = torch.full((rows, length), code, dtype=torch.uint8)
    if fmt.bits == 4:
        want_codes = quant.pack4(want_codes)
    assert torch.equal(made.absmax, want_absmax)
    assert torch.equal(made.codes.reshape(want_codes.shape), want_codes)
    assert torch.equal(made.dequantize(), storage.QuantizedState.of(x, fmt).dequantize())


@pytest.mark.parametrize("fmt", [storage.Format(8, True), storage.Format(4, False)], ids=lambda f: f.tag)
def test_spans_give_the_codes_of_the_whole_tensor(fmt, monkeypatch):
    """Quantized and dequantized span by span (a row cut into several spans, several rows in one) equals the
    whole tensor at once."""
    torch.manual_seed(1)
    x = torch.randn(6, 5000) * torch.rand(6, 1) ** 3
    whole_codes, whole_absmax = quant.quantize(x, fmt.qmap, fmt.block)
    whole = quant.dequantize(whole_codes, whole_absmax, fmt.qmap, fmt.block, x.shape)
    for chunk in (fmt.block, 3 * fmt.block, 2 * 5000):
        monkeypatch.setattr(quant, "CHUNK", chunk)
        assert len(list(quant.spans(x.shape, fmt.block))) > 1
        codes, absmax = quant.quantize(x, fmt.qmap, fmt.block)
        assert torch.equal(codes, whole_codes) and torch.equal(absmax, whole_absmax)
        assert torch.equal(quant.dequantize(codes, absmax, fmt.qmap, fmt.block, x.shape), whole)
