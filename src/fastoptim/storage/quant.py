"""Block-wise quantization of optimizer state: the codec every level will share.

A state tensor is read as rows (one row per index of its first dimension, the trailing dimensions
flattened; a 0-d or 1-d tensor is one row). Each row is cut into blocks of ``block`` elements along
the row, the last one possibly short; blocks never span two rows, so a tensor sharded on dim 0 (FSDP2's
``Shard(0)``) has its codes and scales sharded at exactly the same place, and the numbers do not depend
on the world size.

Per block: ``absmax = max |x|`` (fp32), and each element is stored as the index of the map value nearest
to ``x / absmax`` (ties to the lower index, as an arg-min over the sorted map does). Dequantized:
``map[code] * absmax``.

Finding the nearest code (``Encoder``): the sign and the top bits of an fp32 value index a table of the
lowest code its cell of values can take, and one comparison with the boundary inside the cell finds the
code. The table is made fine enough that no cell holds two boundaries (checked where it is built), so the
result is exactly the nearest-code search; every level (the CPU kernels too) encodes with these tables.

Layout of one quantized tensor:
  * ``codes``  uint8. 8 bits: the tensor's shape. 4 bits: (rows, ceil(row_length / 2)), two codes per
    byte along the row, the first one in the low nibble.
  * ``absmax`` fp32, (rows, ceil(row_length / block)).

Maps (sorted ascending, 2**bits values in [-1, 1]):
  * ``dynamic(bits, signed)``: dynamic tree quantization (Dettmers et al. 2021, "8-bit Optimizers via
    Block-wise Quantization"). After the sign bit, E leading zero bits pick the magnitude 10**-E, the
    next bit ends the run, and the bits left index linear fractions of [0.1, 1] (bin midpoints); 1.0
    completes the table. Signed (first moments, momentum): zero is a code. Unsigned (second moments):
    *no* zero; the code that would be zero is one more magnitude, 10**-(bits-1) * 0.55. A second moment
    is divided by: one rounded to zero beside a large one in its block would turn m / (sqrt(v) + eps)
    into m / eps (thousands of times the step); without zero it rounds up to at least that magnitude
    times the block's absmax. An all-zero block still comes back as zeros (its absmax is 0).
  * Both ends: every map holds 1.0, and a signed map -1.0 too (in place of its smallest negative
    magnitude, 10**-(bits-2) * 0.55), so a block's largest value comes back exactly whatever its sign, and
    quantizing dequantized codes gives the same codes: a state that goes through fp32 and back (a
    checkpoint converted twice, a level that stores what it loaded) never drifts.
  * ``linear_no_zero(bits)``: ``(k + 1) / 2**bits``, k = 0 .. 2**bits - 1 (Li et al. 2023, "Memory
    Efficient Optimizers with 4-bit States"): the 4-bit map of second moments, which must never round
    a small positive value to zero (it would be divided by).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

BLOCK = {8: 256, 4: 128}  # elements per block at each width


def dynamic_map_values(bits: int, signed: bool) -> list[float]:
    """The dynamic map's values, sorted, in float64 (rounded to fp32 where they are stored)."""
    fraction_bits_at_top = bits - 1 - (1 if signed else 0)  # after the sign and the run-ending bit
    values = {0.0, 1.0} if signed else {1.0}
    for exponent in range(bits if not signed else bits - 1):  # unsigned: one more magnitude, no zero
        bins = max(2 ** (fraction_bits_at_top - exponent), 1)
        scale = 10.0 ** -exponent
        for k in range(bins):
            mid = 0.1 + 0.9 * (k + 0.5) / bins  # midpoint of bin k of [0.1, 1]
            values.add(scale * mid)
            if signed:
                values.add(-scale * mid)
    if signed:  # -1.0 in place of the smallest negative magnitude: see "Both ends" above
        values.remove(max(v for v in values if v < 0))
        values.add(-1.0)
    out = sorted(values)
    assert len(out) == 2 ** bits, (bits, signed, len(out))
    return out


def linear_no_zero_values(bits: int) -> list[float]:
    return [(k + 1) / 2 ** bits for k in range(2 ** bits)]


@dataclass(frozen=True)
class QuantMap:
    """A sorted code table and the decision boundaries that find the nearest code."""
    name: str
    bits: int
    values: tuple[float, ...]  # fp32-representable, ascending

    @property
    def signed(self) -> bool:
        return self.values[0] < 0

    def table(self, device: torch.device | str = "cpu") -> Tensor:
        return _table(self, torch.device(device))

    def boundaries(self, device: torch.device | str = "cpu") -> Tensor:
        """``len(values) - 1`` fp32 boundaries: an fp32 ``y`` belongs to code ``i`` exactly when
        ``b[i-1] < y <= b[i]``. Each is the exact midpoint of two neighbours rounded *down* to fp32, so for
        every fp32 ``y`` the comparison ``y <= b[i]`` equals ``y <= midpoint`` in exact arithmetic, and a
        tie goes to the lower code, like an arg-min over the map."""
        return _boundaries(self, torch.device(device))


@lru_cache(maxsize=None)
def _table(qmap: QuantMap, device: torch.device) -> Tensor:
    return torch.tensor(qmap.values, dtype=torch.float32, device=device)


@lru_cache(maxsize=None)
def _boundaries(qmap: QuantMap, device: torch.device) -> Tensor:
    v = qmap.values
    mids = [(a + b) / 2 for a, b in zip(v[:-1], v[1:])]  # exact in float64: a and b are fp32 values
    rounded = torch.tensor(mids, dtype=torch.float64).float()
    up = rounded.double() > torch.tensor(mids, dtype=torch.float64)  # rounded up: step one fp32 down
    rounded[up] = torch.nextafter(rounded[up], torch.tensor(-math.inf))
    return rounded.to(device)


@dataclass(frozen=True)
class Encoder:
    """The nearest-code lookup of one map, in integer operations on the bits of an fp32 ``y``.

    ``|y|``'s bits are clamped to ``[lowest, highest]`` (``highest`` is 1.0: every map ends at +-1, so any
    larger ``|y|`` has the code of +-1; no boundary lies below ``lowest``, so any smaller one has the code of
    ``lowest``), then cut into *cells* of ``2 ** shift`` bit patterns, positive cells first, ``half`` of them a
    sign. ``entry = lut[cell]`` holds the lowest code of any value in the cell (bits 24..31) and the low
    ``shift`` bits of the one boundary inside it (``split``; no boundary: all ones). Within a cell the low bits
    order the values (reversed for negative ones, hence the XOR), so
    ``code = (entry >> 24) + ((m & mask) ^ (mask if y < 0 else 0) > (entry & mask))``: one table read. The
    table is a few thousand entries, small enough to stay in L1."""
    shift: int
    lowest: int   # magnitude bits, a multiple of 2 ** shift
    highest: int  # magnitude bits of 1.0
    lut: Tensor   # int32, 2 * half cells

    @property
    def mask(self) -> int:
        return (1 << self.shift) - 1

    @property
    def half(self) -> int:
        return self.lut.numel() // 2

    def encode(self, y: Tensor) -> Tensor:
        """int32 codes of fp32 ``y``."""
        bits = y.view(torch.int32)
        negative = bits < 0
        m = (bits & 0x7FFFFFFF).clamp(self.lowest, self.highest)
        cell = ((m - self.lowest) >> self.shift) + negative.to(torch.int32) * self.half
        entry = self.lut[cell]
        low = (m & self.mask) ^ (negative.to(torch.int32) * self.mask)
        return ((entry >> 24) & 0xFF) + (low > (entry & self.mask)).to(torch.int32)


def _bits(x: Tensor) -> Tensor:
    return x.float().view(torch.int32).long()


def _float(bits: Tensor) -> Tensor:
    return bits.to(torch.int32).view(torch.float32)


@lru_cache(maxsize=None)
def encoder(qmap: QuantMap, device: torch.device = torch.device("cpu")) -> Encoder:
    """The coarsest table with at most one boundary per cell."""
    if device.type != "cpu":
        host = encoder(qmap)
        return Encoder(host.shift, host.lowest, host.highest, host.lut.to(device))
    bounds = qmap.boundaries()
    magnitudes = _bits(bounds.abs())
    assert bool((magnitudes > 0).all()), qmap.name  # a boundary at 0 would need a cell of its own per sign
    highest = int(_bits(torch.tensor(1.0)))
    for mantissa_bits in range(2, 12):
        shift = 23 - mantissa_bits
        lowest = max((int(magnitudes.min()) >> shift << shift) - (1 << shift), 0)  # below every boundary
        half = ((highest - lowest) >> shift) + 1
        first = lowest + (torch.arange(half, dtype=torch.int64) << shift)
        low, high = _float(first), _float(torch.clamp(first + (1 << shift) - 1, max=highest))
        positive = torch.bucketize(low, bounds), torch.bucketize(high, bounds)
        negative = torch.bucketize(-high, bounds), torch.bucketize(-low, bounds)
        if not all(bool((hi - lo).le(1).all()) for lo, hi in (positive, negative)):
            continue
        mask = (1 << shift) - 1
        codes = torch.cat([positive[0], negative[0]])
        split = torch.full_like(codes, mask)
        cells = ((magnitudes - lowest) >> shift) + (bounds < 0).long() * half
        split[cells] = (magnitudes & mask) ^ torch.where(bounds < 0, mask, 0)
        lut = (codes << 24) | split
        return Encoder(shift, lowest, highest, torch.where(lut >= 1 << 31, lut - (1 << 32), lut).to(torch.int32))
    raise AssertionError(f"{qmap.name}: no table of up to 2**20 cells a sign separates its boundaries")


def _fp32_values(values: list[float]) -> tuple[float, ...]:
    return tuple(torch.tensor(values, dtype=torch.float32).double().tolist())


@lru_cache(maxsize=None)
def dynamic(bits: int, signed: bool) -> QuantMap:
    return QuantMap(f"dynamic{bits}{'s' if signed else 'u'}", bits, _fp32_values(dynamic_map_values(bits, signed)))


@lru_cache(maxsize=None)
def linear_no_zero(bits: int) -> QuantMap:
    return QuantMap(f"linear{bits}", bits, _fp32_values(linear_no_zero_values(bits)))


def map_for(bits: int, signed: bool) -> QuantMap:
    """The map a state of this width and sign is stored with (the issue's choice: 4-bit second moments
    take the linear map without zero, everything else the dynamic map)."""
    if bits == 4 and not signed:
        return linear_no_zero(4)
    return dynamic(bits, signed)


# --- rows and blocks ---------------------------------------------------------------------------------

def rows_of(shape: torch.Size | tuple) -> tuple[int, int]:
    """(rows, row_length) of a tensor of this shape: dim 0 by the rest; 0-d and 1-d tensors are one row."""
    if len(shape) < 2:
        return 1, math.prod(shape)
    return shape[0], math.prod(shape[1:])


def absmax_shape(shape, block: int) -> tuple[int, int]:
    rows, length = rows_of(shape)
    return rows, -(-length // block)


def codes_shape(shape, bits: int) -> tuple[int, ...]:
    if bits == 8:
        return tuple(shape)
    rows, length = rows_of(shape)
    return rows, -(-length // 2)


# --- conversions in bounded spans ----------------------------------------------------------------------

CHUNK = 1 << 16  # the most elements a conversion works on at once: its temporaries are O(CHUNK), never O(tensor)


def spans(shape, block: int, chunk: int | None = None):
    """(rows, columns) slices that cover a tensor of ``shape`` read as rows, each at most ``chunk`` elements (at
    least one block) and cut between blocks (``block``: a multiple of every block size the conversion meets), so
    each span quantizes on its own to exactly the codes of the whole tensor."""
    chunk = CHUNK if chunk is None else chunk
    rows, length = rows_of(shape)
    if rows == 0 or length == 0:
        return
    if length <= chunk:
        per = max(1, chunk // length)
        for r in range(0, rows, per):
            yield slice(r, min(r + per, rows)), slice(0, length)
        return
    width = max(block, chunk // block * block)
    for r in range(rows):
        for c in range(0, length, width):
            yield slice(r, r + 1), slice(c, min(c + width, length))


def rows_view(t: Tensor, shape) -> Tensor:
    """``t`` (of ``shape``) as (rows, row_length); a view where its layout allows."""
    return t.reshape(rows_of(shape))


def blocked(values: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """A span ``values`` (rows, n; any float dtype, read as fp32; only a row's last block may be short) as fp32
    blocks (rows, blocks, block), the last zero-padded, and each block's absmax."""
    rows, length = values.shape
    nblocks = -(-length // block)
    x = values.float()
    if nblocks * block != length:
        x = torch.nn.functional.pad(x, (0, nblocks * block - length))
    x = x.reshape(rows, nblocks, block)
    return x, x.abs().amax(dim=2) if x.numel() else x.new_zeros(x.shape[:2])


def unblocked(span: Tensor, blocks: Tensor, length: int) -> Tensor:
    """(rows, blocks, block) ``blocks`` (codes, values) of ``span`` back to (rows, ``length``): padding dropped."""
    return blocks.reshape(span.shape[0], -1)[:, :length]


def scaled(values: Tensor, scale: Tensor, block: int) -> Tensor:
    """Values (rows, n) of a span times each block's ``scale`` (rows, blocks)."""
    rows, length = values.shape
    nblocks = scale.shape[1]
    if nblocks * block != length:
        values = torch.nn.functional.pad(values, (0, nblocks * block - length))
    return (values.reshape(rows, nblocks, block) * scale.unsqueeze(2)).reshape(rows, -1)[:, :length]


def encode_span(values: Tensor, qmap: QuantMap, block: int) -> tuple[Tensor, Tensor]:
    """Codes (uint8, one a value: not packed) and absmax of a span of whole blocks ``values`` (``blocked``)."""
    x, absmax = blocked(values, block)
    divisor = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    codes = encoder(qmap, x.device).encode(x / divisor.unsqueeze(2)).to(torch.uint8)
    return unblocked(values, codes, values.shape[1]), absmax


def decode_span(codes: Tensor, absmax: Tensor, qmap: QuantMap, block: int) -> Tensor:
    """fp32 values (rows, n) of unpacked ``codes`` (rows, n) and their blocks' ``absmax`` (rows, blocks)."""
    return scaled(qmap.table(codes.device)[codes.long()], absmax, block)


def read_span(codes: Tensor, absmax: Tensor, shape, bits: int, block: int, rs: slice, cs: slice
              ) -> tuple[Tensor, Tensor]:
    """The unpacked codes and the absmax of the span (``rs``, ``cs``) of a tensor of ``shape`` (``cs`` starts at
    a block)."""
    rows, length = rows_of(shape)
    blocks = slice(cs.start // block, -(-cs.stop // block))
    if bits == 8:
        return codes.reshape(rows, length)[rs, cs], absmax[rs, blocks]
    packed = codes[rs, cs.start // 2:-(-cs.stop // 2)]
    return unpack4(packed, cs.stop - cs.start), absmax[rs, blocks]


def write_span(codes: Tensor, absmax: Tensor, shape, bits: int, block: int, rs: slice, cs: slice,
               span_codes: Tensor, span_absmax: Tensor) -> None:
    """``span_codes`` (unpacked) and ``span_absmax`` into the span (``rs``, ``cs``) of a state of ``shape``."""
    rows, length = rows_of(shape)
    absmax[rs, cs.start // block:-(-cs.stop // block)] = span_absmax
    if bits == 8:
        codes.view(rows, length)[rs, cs] = span_codes
    else:
        codes[rs, cs.start // 2:-(-cs.stop // 2)] = pack4(span_codes)


def quantize(x: Tensor, qmap: QuantMap, block: int) -> tuple[Tensor, Tensor]:
    """``(codes, absmax)`` of ``x`` (any float dtype, read as fp32), converted span by span."""
    codes = torch.empty(codes_shape(x.shape, qmap.bits), dtype=torch.uint8, device=x.device)
    absmax = torch.empty(absmax_shape(x.shape, block), dtype=torch.float32, device=x.device)
    rows = rows_view(x, x.shape)
    for rs, cs in spans(x.shape, block):
        write_span(codes, absmax, x.shape, qmap.bits, block, rs, cs, *encode_span(rows[rs, cs], qmap, block))
    return codes, absmax


def dequantize(codes: Tensor, absmax: Tensor, qmap: QuantMap, block: int, shape, out: Tensor | None = None
               ) -> Tensor:
    """Values of shape ``shape`` (fp32, or ``out``'s dtype written into ``out``), converted span by span."""
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=codes.device)
    rows = rows_view(out, shape)
    for rs, cs in spans(shape, block):
        rows[rs, cs] = decode_span(*read_span(codes, absmax, shape, qmap.bits, block, rs, cs), qmap, block)
    if rows.data_ptr() != out.data_ptr() or not out.is_contiguous():  # (a copy: ``out`` is not row-major)
        out.copy_(rows.reshape(shape))
    return out


def fill(codes: Tensor, absmax: Tensor, shape, bits: int, code: int, scale: float) -> None:
    """Every element's code ``code`` and every block's absmax ``scale`` (a state of one value throughout), laid
    out as ``quantize`` lays out a full tensor (a 4-bit row's pad nibble 0)."""
    absmax.fill_(scale)
    if bits == 8:
        codes.fill_(code)
        return
    codes.fill_(code | code << 4)
    if rows_of(shape)[1] % 2:
        codes[:, -1] = code


def pack4(codes: Tensor) -> Tensor:
    """(rows, length) codes < 16 -> (rows, ceil(length / 2)) bytes, the first of each pair low."""
    rows, length = codes.shape
    if length % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.reshape(rows, codes.shape[1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def unpack4(packed: Tensor, length: int) -> Tensor:
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])[:, :length]
