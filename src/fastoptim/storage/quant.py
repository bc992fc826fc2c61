"""Block-wise quantization of optimizer state: the codec every level will share.

A state tensor is read as rows (one row per index of its first dimension, the trailing dimensions
flattened; a 0-d or 1-d tensor is one row). Each row is cut into blocks of ``block`` elements along
the row, the last one possibly short; blocks never span two rows, so a tensor sharded on dim 0 (FSDP2's
``Shard(0)``) has its codes and scales sharded at exactly the same place, and the numbers do not depend
on the world size.

Per block: ``absmax = max |x|`` (fp32), and each element is stored as the index of the map value nearest
to ``x / absmax`` (ties to the lower index, as an arg-min over the sorted map does). Dequantized:
``map[code] * absmax``.

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


def _blocked(x: Tensor, block: int) -> Tensor:
    """x as (rows, blocks, block), fp32, zero-padded at the end of each row."""
    rows, length = rows_of(x.shape)
    nblocks = -(-length // block)
    x = x.reshape(rows, length).float()
    pad = nblocks * block - length
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(rows, nblocks, block)


def quantize(x: Tensor, qmap: QuantMap, block: int) -> tuple[Tensor, Tensor]:
    """``(codes, absmax)`` of ``x`` (any float dtype, read as fp32)."""
    rows, length = rows_of(x.shape)
    blocks = _blocked(x, block)
    absmax = blocks.abs().amax(dim=2) if blocks.numel() else blocks.new_zeros(blocks.shape[:2])
    divisor = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    normalized = blocks / divisor.unsqueeze(2)
    codes = torch.bucketize(normalized, qmap.boundaries(x.device)).to(torch.uint8)
    codes = codes.reshape(rows, blocks.shape[1] * block)[:, :length]
    if qmap.bits == 8:
        return codes.reshape(x.shape), absmax
    return pack4(codes), absmax


def dequantize(codes: Tensor, absmax: Tensor, qmap: QuantMap, block: int, shape, out: Tensor | None = None
               ) -> Tensor:
    """fp32 values of shape ``shape`` (written into ``out`` when given)."""
    rows, length = rows_of(shape)
    if qmap.bits == 4:
        codes = unpack4(codes, length)
    values = qmap.table(codes.device)[codes.reshape(rows, length).long()]
    nblocks = absmax.shape[1]
    if nblocks * block != length:
        values = torch.nn.functional.pad(values, (0, nblocks * block - length))
    values = (values.reshape(rows, nblocks, block) * absmax.unsqueeze(2)).reshape(rows, nblocks * block)[:, :length]
    values = values.reshape(shape)
    if out is None:
        return values
    return out.copy_(values)


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
