"""The block-wise state codec against a brute-force nearest-code search, on the cases that break codecs."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fastoptim.storage import quant

MAPS = [(quant.dynamic(8, True), 256), (quant.dynamic(8, False), 256), (quant.dynamic(4, True), 128),
        (quant.linear_no_zero(4), 128)]
IDS = [m.name for m, _ in MAPS]


def brute_force(x: torch.Tensor, qmap: quant.QuantMap, block: int):
    """Codes and absmax by the definition: per row, per block of ``block`` elements, the arg-min over the
    map (float64 distances; the first of equal distances) of |x / absmax - value|."""
    rows, length = quant.rows_of(x.shape)
    flat = x.reshape(rows, length).float()
    table = torch.tensor(qmap.values, dtype=torch.float64)
    codes = torch.empty(rows, length, dtype=torch.long)
    nblocks = -(-length // block)
    absmax = torch.zeros(rows, nblocks)
    for r in range(rows):
        for b in range(nblocks):
            piece = flat[r, b * block:(b + 1) * block]
            scale = piece.abs().max()
            absmax[r, b] = scale
            normalized = (piece / scale if scale != 0 else piece).double()  # fp32 division, as the codec
            codes[r, b * block:(b + 1) * block] = (normalized[:, None] - table[None, :]).abs().argmin(dim=1)
    return codes, absmax


def unpacked(codes, qmap, shape):
    rows, length = quant.rows_of(shape)
    if qmap.bits == 4:
        return quant.unpack4(codes, length).long()
    return codes.reshape(rows, length).long()


def sample(shape, signed, seed, kind="normal"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 3)  # many magnitudes
    return x if signed else x.abs()


@pytest.mark.parametrize("qmap,block", MAPS, ids=IDS)
def test_maps_are_sorted_tables_of_their_width_in_unit_range(qmap, block):
    v = qmap.values
    assert len(v) == 2 ** qmap.bits and list(v) == sorted(set(v))
    assert v[-1] == 1.0 and -1.0 <= v[0]
    assert all(float(torch.tensor(x, dtype=torch.float32)) == x for x in v)  # stored exactly in fp32
    assert (0.0 in v) == qmap.signed  # unsigned maps hold second moments: never rounded to zero


def test_dynamic_map_has_the_paper_s_magnitudes():
    signed = quant.dynamic(8, True).values
    positive = [x for x in signed if x > 0]
    # 7 magnitudes 1e0 .. 1e-6, with 64, 32, ..., 1 linear bins of [0.1, 1]; plus 1.0
    assert len(positive) == 127 + 1
    assert min(positive) == pytest.approx(0.55e-6, rel=1e-6)
    assert sum(0.1 <= x < 1 for x in positive) == 64
    unsigned = quant.dynamic(8, False).values
    assert sum(0.1 <= x < 1 for x in unsigned) == 128 and min(unsigned) == pytest.approx(0.55e-7, rel=1e-6)


@pytest.mark.parametrize("qmap,block", MAPS, ids=IDS)
@pytest.mark.parametrize("shape", [(3, 700), (2, 3, 129), (1000,), (), (0, 5), (4, 0), (7, 1), (2, 256)])
def test_codes_are_the_nearest_map_values(qmap, block, shape):
    x = sample(shape, qmap.signed, seed=len(shape) * 7 + sum(shape))
    codes, absmax = quant.quantize(x, qmap, block)
    want_codes, want_absmax = brute_force(x, qmap, block)
    assert codes.dtype == torch.uint8 and codes.shape == quant.codes_shape(x.shape, qmap.bits)
    assert absmax.dtype == torch.float32 and absmax.shape == quant.absmax_shape(x.shape, block)
    assert torch.equal(absmax, want_absmax)
    assert torch.equal(unpacked(codes, qmap, x.shape), want_codes)


@pytest.mark.parametrize("qmap,block", MAPS, ids=IDS)
def test_blocks_of_zeros_a_lone_huge_value_and_exact_midpoints(qmap, block):
    x = torch.zeros(3, 2 * block + 5)
    x[1, 3] = 1e30 if qmap.signed else 3e38  # one huge value: its block keeps it, others are untouched
    x[1, block + 1] = 1e-30
    x[2, :block] = sample((block,), qmap.signed, seed=3)
    codes, absmax = quant.quantize(x, qmap, block)
    assert torch.equal(unpacked(codes, qmap, x.shape), brute_force(x, qmap, block)[0])
    y = quant.dequantize(codes, absmax, qmap, block, x.shape)
    assert y[1, 3] == x[1, 3]  # the block's largest value comes back exactly (1.0 is in every map)
    zero_code = qmap.values.index(0.0) if qmap.signed else 0
    assert (unpacked(codes, qmap, x.shape)[0] == zero_code).all() and (y[0] == 0).all()  # all-zero blocks
    # values at exact midpoints between neighbouring codes go to the lower code, as the arg-min does
    v = torch.tensor(qmap.values, dtype=torch.float64)
    mids = ((v[:-1] + v[1:]) / 2).float()
    exact = mids.double() == (v[:-1] + v[1:]) / 2
    ties = torch.cat([mids[exact], torch.ones(1)])  # 1.0 sets the block's absmax to 1
    codes, _ = quant.quantize(ties[None], qmap, block)
    got = unpacked(codes, qmap, ties[None].shape)[0, :-1]
    assert torch.equal(got, torch.nonzero(exact).flatten())
    # the fp32 numbers right beside a midpoint that fp32 cannot hold go to the nearer code
    mid64 = (v[:-1] + v[1:]) / 2
    nearest = mid64.float()
    below = torch.where(nearest.double() < mid64, nearest, torch.nextafter(nearest, torch.tensor(-1.0)))
    above = torch.nextafter(below, torch.tensor(2.0))
    lone = ~exact
    for beside, want in [(below, torch.arange(len(mids))), (above, torch.arange(1, len(mids) + 1))]:
        y = torch.cat([beside[lone], torch.ones(1)])
        codes, _ = quant.quantize(y[None], qmap, block)
        assert torch.equal(unpacked(codes, qmap, y[None].shape)[0, :-1], want[lone])


@pytest.mark.parametrize("qmap,block", MAPS, ids=IDS)
def test_dequantize_error_is_bounded_by_half_the_widest_gap(qmap, block):
    x = sample((16, 1000), qmap.signed, seed=11)
    codes, absmax = quant.quantize(x, qmap, block)
    y = quant.dequantize(codes, absmax, qmap, block, x.shape)
    v = torch.tensor(qmap.values)
    widest = (v[1:] - v[:-1]).max().item()
    if not qmap.signed:
        widest = max(widest, 2 * v[0].item())  # below the smallest code: up to it, not to zero
    per_element_absmax = quant.dequantize(torch.full_like(codes, 255 if qmap.bits == 8 else 0xFF), absmax, qmap,
                                          block, x.shape)  # 1.0 * absmax of each element's block
    assert ((y - x).abs() <= per_element_absmax * widest / 2 * (1 + 1e-5)).all()
    out = torch.empty_like(x)
    assert quant.dequantize(codes, absmax, qmap, block, x.shape, out=out) is out and torch.equal(out, y)


@pytest.mark.parametrize("qmap,block", MAPS, ids=IDS)
def test_rows_quantize_alone_as_they_do_together(qmap, block):
    """Blocks never span rows: the codes and absmax of a slice of rows (an FSDP2 shard) are the same
    rows of the whole tensor's, so the numbers do not depend on how the tensor is sharded."""
    x = sample((10, 3, 100), qmap.signed, seed=5)
    codes, absmax = quant.quantize(x, qmap, block)
    for lo, hi in [(0, 5), (5, 10), (3, 4)]:
        part_codes, part_absmax = quant.quantize(x[lo:hi], qmap, block)
        assert torch.equal(part_codes, codes[lo:hi]) and torch.equal(part_absmax, absmax[lo:hi])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), length=st.integers(0, 600), which=st.integers(0, len(MAPS) - 1),
       seed=st.integers(0, 1000), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_random_shapes_and_dtypes_match_brute_force(rows, length, which, seed, dtype):
    qmap, block = MAPS[which]
    x = sample((rows, length), qmap.signed, seed).clamp(-6e4, 6e4).to(dtype)
    codes, absmax = quant.quantize(x, qmap, block)
    want_codes, want_absmax = brute_force(x, qmap, block)
    assert torch.equal(unpacked(codes, qmap, x.shape), want_codes) and torch.equal(absmax, want_absmax)
    y = quant.dequantize(codes, absmax, qmap, block, x.shape)
    assert y.shape == x.shape and y.dtype == torch.float32 and bool(torch.isfinite(y).all())


def test_pack4_round_trips_odd_lengths():
    codes = torch.randint(0, 16, (3, 7), dtype=torch.uint8)
    packed = quant.pack4(codes)
    assert packed.shape == (3, 4) and torch.equal(quant.unpack4(packed, 7), codes)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)  # first of a pair in the low nibble


def test_state_bytes_per_element():
    shape = (1024, 1024)
    for bits, block in quant.BLOCK.items():
        nbytes = math.prod(quant.codes_shape(shape, bits)) + 4 * math.prod(quant.absmax_shape(shape, block))
        assert nbytes / math.prod(shape) == bits / 8 + 4 / block


@pytest.mark.parametrize("qmap", [quant.dynamic(8, False), quant.linear_no_zero(4)], ids=["dynamic8u", "linear4"])
def test_unsigned_maps_never_round_a_positive_value_to_zero(qmap):
    """A second moment 1e-12 of its block's largest still comes back positive (it is divided by)."""
    x = torch.full((1, 256), 1e-12)
    x[0, 0] = 1.0
    codes, absmax = quant.quantize(x, qmap, 256)
    y = quant.dequantize(codes, absmax, qmap, 256, x.shape)
    assert (y > 0).all() and y[0, 1] == qmap.values[0]


@pytest.mark.parametrize("qmap,block", MAPS, ids=IDS)
def test_quantizing_dequantized_codes_gives_the_same_codes(qmap, block):
    """Every map holds its ends (1.0, and -1.0 when signed): a block's largest value, of either sign, comes
    back exactly, so a state taken through fp32 and back (a checkpoint converted twice) never drifts."""
    for seed in range(5):
        x = sample((6, 700), qmap.signed, seed=seed + 20)
        codes, absmax = quant.quantize(x, qmap, block)
        again = quant.quantize(quant.dequantize(codes, absmax, qmap, block, x.shape), qmap, block)
        assert torch.equal(again[0], codes) and torch.equal(again[1], absmax)
    if qmap.signed:
        x = torch.tensor([[-3.0, 1.0, 0.5]])
        codes, absmax = quant.quantize(x, qmap, block)
        assert quant.dequantize(codes, absmax, qmap, block, x.shape)[0, 0] == -3.0


@pytest.mark.slow
@pytest.mark.parametrize("qmap,block", MAPS, ids=IDS)
def test_the_cell_table_finds_the_nearest_code_of_every_fp32_in_a_sweep_of_bit_patterns(qmap, block):
    """``Encoder`` against the arg-min over the map in float64, on every 1021st fp32 bit pattern of [-1, 1]
    (about 2M values, every cell of the table many times), each boundary and its fp32 neighbours, zeros,
    values past +-1 (clamped: the code of +-1) and below the table's lowest cell."""
    enc = quant.encoder(qmap)
    one = int(torch.tensor(1.0).view(torch.int32))
    magnitudes = torch.arange(0, one + 1, 1021, dtype=torch.int64).to(torch.int32).view(torch.float32)
    b = qmap.boundaries()
    edges = torch.cat([b, torch.nextafter(b, torch.tensor(2.0)), torch.nextafter(b, torch.tensor(-2.0))])
    y = torch.cat([magnitudes, -magnitudes, edges, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30])])
    table = torch.tensor(qmap.values, dtype=torch.float64)
    want = torch.cat([(chunk.double()[:, None] - table[None, :]).abs().argmin(dim=1) for chunk in y.split(1 << 16)])
    assert torch.equal(enc.encode(y).long(), want)
    beyond = torch.tensor([1.5, 3e38, float("inf"), -1.5, -float("inf")])
    assert enc.encode(beyond).tolist() == [2 ** qmap.bits - 1] * 3 + [0] * 2
    assert enc.lut.numel() * 4 <= 32 << 10  # small enough for L1
