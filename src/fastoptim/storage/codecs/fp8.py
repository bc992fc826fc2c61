"""8-bit floating-point state with a per-block scale (``state_format="fp8_e4m3"``, alias ``"fp8"``).

Each block of 256 elements along a row keeps its absmax (fp32); an element is kept as the 8-bit float nearest
to ``x * (max / absmax)`` (round half to even, saturating at the format's largest value ``max``), and read back
as ``code's value * (absmax / max)``: the semantics of torchao's ``AdamWFp8`` (e4m3 codes, the block's absmax
mapped to 448). First moments (signed states) are e4m3; second moments and other states that are never
negative (the rule's ``unsigned_states``) are ``ue4m4``: no sign bit, so one more mantissa bit, and a positive
value never rounds to 0 (it is divided by: a 0 beside a large value in its block would turn m / (sqrt(v) + eps)
into m / eps); measured in docs/low-bit.md.

Encoding is a few integer operations on the fp32 bits (exponent rebias, round half to even by a bias and a
mask, saturate: ``Minifloat.encode``), and decoding likewise, so no path reads a table: the CPU kernel
(``native/minifloat.hpp``) and the Triton kernel carry the same operations, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import quant
from ..state import Format
from .base import CppPieces, Deferred
from .blockwise import BlockScaled


@dataclass(frozen=True)
class Minifloat:
    """An 8-bit float: a sign bit where ``signed``, ``exponent_bits``, ``mantissa_bits``, ``bias``; exponent 0 holds
    the subnormals ``m * 2**(1 - bias - mantissa_bits)``; the magnitude code ``max_code`` is the largest value,
    every larger one saturates to it (no inf or NaN codes are written). ``signed``: a negative value's code is
    its magnitude's with bit 7 set; unsigned: a negative value is 0 and a positive one never rounds to 0."""
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_code: int
    signed: bool

    @property
    def max_value(self) -> float:
        return float(self.decode(torch.tensor([self.max_code], dtype=torch.int32)))

    @property
    def max_bits(self) -> int:
        return int(torch.tensor(self.max_value, dtype=torch.float32).view(torch.int32))

    def encode(self, y: Tensor, positive: Tensor | None = None, negative: Tensor | None = None) -> Tensor:
        """int32 codes of fp32 ``y``, by the integer operations every kernel runs. Unsigned: ``positive`` (``y > 0``
        by default) says which values never round to 0 (the scaled value of a positive one may underflow).
        ``negative`` (``y``'s sign bit by default) gives each code's sign: a block's codes take the unscaled
        values' (a NaN product's sign depends on the order of its operands, which compilers choose)."""
        M, shift = self.mantissa_bits, 23 - self.mantissa_bits
        bits = y.float().view(torch.int32)
        mag = (bits & 0x7FFFFFFF).clamp(max=self.max_bits)
        normal = ((mag + ((1 << (shift - 1)) - 1) + ((mag >> shift) & 1)) >> shift) - ((127 - self.bias) << M)
        exponent = mag >> 23
        s = (151 - self.bias - M - exponent).clamp(1, 25)  # the significand's shift to subnormal units
        mant = (mag & 0x7FFFFF) | 0x800000
        sub = (mant + torch.bitwise_left_shift(torch.ones_like(s), s - 1) - 1 + ((mant >> s) & 1)) >> s
        code = torch.where(exponent < 128 - self.bias, sub, normal)
        negative = bits < 0 if negative is None else negative
        if self.signed:
            return code | negative.to(torch.int32) << 7
        code = torch.where((code == 0) & (bits > 0 if positive is None else positive), 1, code)
        return torch.where(negative, 0, code)

    def decode(self, codes: Tensor) -> Tensor:
        """fp32 values of ``codes`` (any integer dtype)."""
        M = self.mantissa_bits
        codes = codes.to(torch.int32)
        mag = codes & 0x7F if self.signed else codes
        normal = ((mag << (23 - M)) + ((127 - self.bias) << 23)).view(torch.float32)
        sub = (mag & ((1 << M) - 1)).float() * 2.0 ** (1 - self.bias - M)
        value = torch.where(mag >> M == 0, sub, normal)
        return torch.where(codes >= 128, -value, value) if self.signed else value


E4M3 = Minifloat("e4m3", 4, 3, 7, 0x7E, signed=True)      # torch.float8_e4m3fn's values, largest 448
E5M2 = Minifloat("e5m2", 5, 2, 15, 0x7B, signed=True)     # torch.float8_e5m2's finite values, largest 57344
UE4M4 = Minifloat("ue4m4", 4, 4, 7, 0xFF, signed=False)   # unsigned: 1.9375 * 2**8 down to 2**-10
UE5M3 = Minifloat("ue5m3", 5, 3, 15, 0xFF, signed=False)  # unsigned: 1.875 * 2**16 down to 2**-17
BLOCK = 256
# a block's absmax is at least this (unless 0): max / absmax stays finite (448 / 1e-36 is not in fp32) and
# absmax / max normal; values of such a block are far below any eps an optimizer adds
SMALLEST_SCALE = 2.0 ** -100


class Fp8(BlockScaled):
    """Block-scaled 8-bit floats: ``signed_format`` for signed states, ``unsigned_format`` for those never negative."""
    bits = 8

    def __init__(self, name: str, aliases: tuple, signed_format: Minifloat, unsigned_format: Minifloat):
        self.name, self.aliases = name, aliases
        self.signed_format, self.unsigned_format = signed_format, unsigned_format

    def minifloat(self, fmt: Format) -> Minifloat:
        return self.signed_format if fmt.signed else self.unsigned_format

    def block(self, fmt: Format) -> int:
        return BLOCK

    def tag(self, fmt: Format) -> str:
        return f"fp8{self.minifloat(fmt).name}/{BLOCK}"

    def encode_span(self, values: Tensor, fmt: Format) -> tuple[Tensor, Tensor]:
        x, absmax = quant.blocked(values, BLOCK)
        absmax = torch.where((absmax > 0) & (absmax < SMALLEST_SCALE), SMALLEST_SCALE, absmax)
        number = self.minifloat(fmt)
        divisor = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
        # (a tensor over a tensor: a number over a tensor is a reciprocal times it in torch, an ulp off)
        inv = torch.full_like(absmax, number.max_value) / divisor
        codes = number.encode(x * inv.unsqueeze(2), positive=x > 0, negative=torch.signbit(x)).to(torch.uint8)
        return quant.unblocked(values, codes, values.shape[1]), absmax

    def decode_span(self, codes: Tensor, absmax: Tensor, fmt: Format) -> Tensor:
        number = self.minifloat(fmt)
        scale = absmax / torch.full_like(absmax, number.max_value)  # (on CUDA a tensor over a number is not IEEE)
        return quant.scaled(number.decode(codes), scale, BLOCK)

    # --- kernel hooks: the same integer operations, no table ---------------------------------------------------

    def cpp(self, k: int, fmt: Format, col: dict) -> CppPieces:
        number = self.minifloat(fmt)
        args = f"{number.mantissa_bits}, {number.bias}, {number.max_bits}u, {str(number.signed).lower()}"
        codes = f"reinterpret_cast<uint8_t*>(row[{col[f's{k}_codes']}]) + at"
        absmax = f"reinterpret_cast<float*>(row[{col[f's{k}_absmax']}])[r * nblocks + j]"
        encode, decode = f"minifloat_encode<{args}>", f"minifloat_decode<{args}>"
        lanes = f"minifloat_lanes<{args}>"
        return CppPieces(
            codec=f"const Codec codec{k}{{}};",
            load=f"const float scale{k} = {absmax} / from_bits({number.max_bits}u);",
            lanes=f"{lanes}({codes} + i, scale{k})",
            tail=f"{decode}({codes} + i, n - i, codec{k}, {absmax}, S{k} + i);",
            deferred=Deferred(
                decls=f"uint8_t* last_codes{k} = nullptr; float last_divisor{k} = 1.0f, last_inv{k} = 1.0f;",
                finish=(f"{{ const float amax = fp8_scale(from_bits(top{k})); {absmax} = amax; "
                        f"last_divisor{k} = amax == 0.0f ? 1.0f : amax; "
                        f"last_inv{k} = from_bits({number.max_bits}u) / last_divisor{k}; last_codes{k} = {codes}; }}"),
                lanes=(f"fo_narrow(last_codes{k} + i, minifloat_code_lanes<{args}>(fo_lanes(last{k} + i), "
                       f"last_inv{k}));"),
                rest=f"{encode}(last{k} + i, n_last - i, last_divisor{k}, codec{k}, last_codes{k} + i);"),
            probe=f"if (k == {k}) fo_probe(Codec{{}}, {encode}, {decode}, x, n, codes, absmax, out, fp8_scale);",
            top=True)

    def triton_load(self, i: int, fmt: Format, whole: bool) -> list[str]:
        number = self.minifloat(fmt)
        M = number.mantissa_bits
        mag = f"s{i}_c & 127" if number.signed else f"s{i}_c"
        lines = [f"s{i}_amax = tl.load(s{i}_absmax + blocks, mask=block_mask, other=0.0)",
                 f"s{i}_c = tl.load(s{i}_codes + offs, mask=mask, other=0).to(tl.int32)",
                 f"s{i}_mag = {mag}",
                 f"s{i}_normal = ((s{i}_mag << {23 - M}) + {(127 - number.bias) << 23}).to(tl.float32, bitcast=True)",
                 f"s{i}_sub = (s{i}_mag & {(1 << M) - 1}).to(tl.float32) * {2.0 ** (1 - number.bias - M)!r}",
                 f"s{i} = tl.where((s{i}_mag >> {M}) == 0, s{i}_sub, s{i}_normal)"]
        if number.signed:
            lines.append(f"s{i} = tl.where(s{i}_c >= 128, -s{i}, s{i})")
        lines.append(f"s{i} = s{i} * tl.div_rn(s{i}_amax, {number.max_value})[:, None]")
        return lines

    def triton_store(self, i: int, fmt: Format, out: str) -> list[str]:
        number = self.minifloat(fmt)
        M, shift, bias = number.mantissa_bits, 23 - number.mantissa_bits, number.bias
        lines = [f"s{i}_new = {out}",
                 f"s{i}_top = tl.where(mask, s{i}_new.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)",
                 f"s{i}_amax = tl.reduce(s{i}_top, 1, tl.standard._elementwise_max).to(tl.float32, bitcast=True)",
                 f"s{i}_amax = tl.where((s{i}_amax > 0.0) & (s{i}_amax < {SMALLEST_SCALE!r}), {SMALLEST_SCALE!r}, "
                 f"s{i}_amax)",
                 f"s{i}_inv = tl.div_rn({number.max_value}, tl.where(s{i}_amax == 0.0, 1.0, s{i}_amax))",
                 f"s{i}_u = (s{i}_new * s{i}_inv[:, None]).to(tl.int32, bitcast=True)",
                 f"s{i}_m = tl.minimum(s{i}_u & 0x7FFFFFFF, {number.max_bits})",
                 f"s{i}_normal = ((s{i}_m + {(1 << (shift - 1)) - 1} + ((s{i}_m >> {shift}) & 1)) >> {shift})"
                 f" - {(127 - bias) << M}",
                 f"s{i}_e = s{i}_m >> 23",
                 f"s{i}_s = tl.minimum(tl.maximum({151 - bias - M} - s{i}_e, 1), 25)",
                 f"s{i}_mant = (s{i}_m & 0x7FFFFF) | 0x800000",
                 f"s{i}_half = tl.full(s{i}_s.shape, 1, tl.int32) << (s{i}_s - 1)",
                 f"s{i}_sub = (s{i}_mant + (s{i}_half - 1) + ((s{i}_mant >> s{i}_s) & 1)) >> s{i}_s",
                 f"s{i}_code = tl.where(s{i}_e < {128 - bias}, s{i}_sub, s{i}_normal)"]
        if number.signed:
            lines.append(f"s{i}_code = s{i}_code | tl.where(s{i}_new.to(tl.int32, bitcast=True) < 0, 128, 0)")
        else:
            lines += [f"s{i}_code = tl.where((s{i}_code == 0) & (s{i}_new > 0.0), 1, s{i}_code)",
                      f"s{i}_code = tl.where(s{i}_new.to(tl.int32, bitcast=True) < 0, 0, s{i}_code)"]
        lines += [f"tl.store(s{i}_codes + offs, tl.where(mask, s{i}_code, 0).to(tl.uint8), mask=mask)",
                  f"tl.store(s{i}_absmax + blocks, s{i}_amax, mask=block_mask)"]
        return lines


FP8_E4M3 = Fp8("fp8_e4m3", ("fp8",), E4M3, UE4M4)
