"""The fp8 codec (``storage/codecs/fp8.py``): its 8-bit floats against torch's own float8 dtypes and a brute-force
nearest-value search, and its block scale at the ends of fp32's range. (The kernels against it, byte for byte:
``tests/paths/test_cpu_kernels.py``, ``tests/paths/test_triton_stored.py``.)"""

import pytest
import torch

from fastoptim import storage
from fastoptim.storage.codecs import fp8

CODES = torch.arange(256)


def _sweep(number: fp8.Minifloat, g: torch.Generator) -> torch.Tensor:
    """fp32 values whose codes are easy to get wrong: every value, every midpoint between neighbours and the fp32
    numbers either side of it, the subnormal range, random values at every scale, +-0, and beyond the largest."""
    values = number.decode(CODES)
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))])
    scales = 2.0 ** torch.randint(-30, 20, (20000,), generator=g).float()
    random = torch.randn(20000, generator=g) * scales
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3e38, -3e38, float("inf"), -float("inf")])
    return torch.cat([values, near, random, special])


@pytest.mark.parametrize("number,dtype", [(fp8.E4M3, torch.float8_e4m3fn), (fp8.E5M2, torch.float8_e5m2)])
def test_signed_formats_are_torchs_float8_values_and_rounding(number, dtype):
    """Every code decodes to torch's value of that byte (but its NaN and inf codes, never written), and every
    fp32 value within the largest encodes to the byte torch's conversion gives; beyond it, the largest."""
    torch_values = CODES.to(torch.uint8).view(dtype).float()
    finite = torch_values.isfinite()
    assert torch.equal(number.decode(CODES)[finite], torch_values[finite])
    y = _sweep(number, torch.Generator().manual_seed(0))
    inside = y.abs() <= number.max_value
    assert torch.equal(number.encode(y[inside]).to(torch.uint8), y[inside].to(dtype).view(torch.uint8))
    outside = y[~inside & ~y.isnan()]
    assert (number.decode(number.encode(outside)).abs() == number.max_value).all()


@pytest.mark.parametrize("number", [fp8.UE4M4, fp8.UE5M3])
def test_unsigned_formats_round_to_the_nearest_value_half_to_even_and_never_to_zero(number):
    """Brute force over the 256 values: the nearest, a tie to the even code; a positive value whose nearest is 0
    takes the smallest positive value instead; a negative value (never stored) is 0."""
    table = number.decode(CODES).double()
    assert (table[1:] > table[:-1]).all() and table[0] == 0
    y = _sweep(number, torch.Generator().manual_seed(1))
    y = y[y.isfinite()]
    distance = (table[None, :] - y.double().clamp(max=number.max_value)[:, None]).abs()
    best = distance.min(dim=1, keepdim=True).values
    ties = distance == best
    want = torch.where(ties & (CODES[None, :] % 2 == 0), CODES[None, :], 255).min(dim=1).values
    want = torch.where(ties.sum(1) == 1, distance.argmin(dim=1), want)
    want = torch.where((want == 0) & (y > 0), 1, want)
    want = torch.where(y <= 0, 0, want)
    assert torch.equal(number.encode(y), want.int())


def test_a_block_with_a_tiny_absmax_keeps_finite_values_of_the_right_sign():
    """A block whose largest magnitude is near fp32's smallest normal: ``max / absmax`` would overflow to inf (and
    0 * inf to NaN), so the stored absmax is at least ``SMALLEST_SCALE``; the values come back finite, of their
    sign or 0, within that scale, and zeros stay zeros (before, such a block decoded to +-absmax and NaN)."""
    codec = storage.codecs.lookup("fp8")
    for signed in (True, False):
        fmt = codec.format(signed)
        x = torch.tensor([[1.0, 0.5, 0.25, 0.0, 0.0] + [0.1] * 251]) * 1e-37
        if signed:
            x[0, 1] = -x[0, 1]
        codes, absmax = codec.encode_span(x, fmt)
        assert float(absmax) == fp8.SMALLEST_SCALE
        back = codec.decode_span(codes, absmax, fmt)
        assert back.isfinite().all() and (back[0, 3:5] == 0).all()
        assert (back * x >= 0).all()
        if not signed:  # positive second moments stay positive
            assert ((back > 0) == (x > 0)).all()
        assert (back - x).abs().max() <= fp8.SMALLEST_SCALE


def test_an_unsigned_positive_value_whose_scaled_value_underflows_is_not_zero():
    """1e-40 beside 1e10 in a block: its quotient underflows fp32, yet it is a positive second moment that will be
    divided by, so it keeps the smallest positive code (as the unsigned dynamic map never rounds to 0)."""
    codec = storage.codecs.lookup("fp8")
    fmt = codec.format(signed=False)
    x = torch.tensor([[1e10, 1e-40, 0.0]])
    codes, absmax = codec.encode_span(x, fmt)
    assert codes.tolist() == [[fp8.UE4M4.max_code, 1, 0]]
    assert codec.decode_span(codes, absmax, fmt)[0, 1] > 0


def test_fp8_state_is_made_and_converted_as_its_codes_alone():
    """A new state is its constant's codes (zeros: code 0, absmax 0); a state quantized and read back and
    quantized again keeps its codes."""
    fmt = storage.codecs.lookup("fp8").format(signed=True)
    made = storage.make(torch.empty(6, 700), fmt, 0.0)
    assert not made.codes.any() and not made.absmax.any()
    x = torch.randn(6, 700, generator=torch.Generator().manual_seed(2))
    state = storage.QuantizedState.of(x, fmt)
    again = storage.QuantizedState.of(state.dequantize(), fmt)
    assert torch.equal(again.codes, state.codes)
    torch.testing.assert_close(again.absmax, state.absmax, rtol=2 ** -23, atol=0)  # an ulp: 448 * (a / 448)
