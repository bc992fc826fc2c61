"""8-bit and 4-bit block-wise dynamic-map state (``state_format="dynamic8"``/``"dynamic4"``, ``state_bits=8``/``4``).

Codes (uint8; at 4 bits two a byte along the row) through a dynamic map, times one fp32 absmax per block of a row
(``quant``: 256 elements at 8 bits, 128 at 4), held in a ``QuantizedState``. Params under 2 dims or under
``min_quant_size`` elements keep plain state. The map is unsigned for states that are never negative (the rule's
``unsigned_states``), signed otherwise. A checkpoint holds ``name.codes``, ``name.absmax`` and ``name.format`` (the
id of the tag, ``Format.id``; the tag names the map and block: "dynamic8s/256").

Kernel hooks: the C++ codec (``native/codec.hpp``: decode through the map, encode to the exact nearest code with
``quant.Encoder``'s constants; at 8 bits with AVX-512 cell tables, ``cell_tables``) and the Triton lines."""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from ... import native
from .. import quant
from ..state import Format
from .base import CppPieces
from .blockwise import BlockScaled


class Dynamic(BlockScaled):
    def __init__(self, bits: int, aliases: tuple):
        self.bits, self.name, self.aliases = bits, f"dynamic{bits}", aliases

    def qmap(self, fmt: Format) -> quant.QuantMap:
        return quant.map_for(fmt.bits, fmt.signed)

    def tag(self, fmt: Format) -> str:
        return f"{self.qmap(fmt).name}/{self.block(fmt)}"

    def encode_span(self, values: Tensor, fmt: Format) -> tuple[Tensor, Tensor]:
        return quant.encode_span(values, fmt.qmap, fmt.block)

    def decode_span(self, codes: Tensor, absmax: Tensor, fmt: Format) -> Tensor:
        return quant.decode_span(codes, absmax, fmt.qmap, fmt.block)

    # --- kernel hooks ------------------------------------------------------------------------------------------

    def tables(self, fmt: Format, device: torch.device = torch.device("cpu")) -> tuple[Tensor, ...]:
        return fmt.qmap.table(device), quant.encoder(fmt.qmap, device).lut  # the map's values, the encoder's

    def cpp(self, k: int, fmt: Format, col: dict) -> CppPieces:
        tables, constants = _cpp_tables(k, fmt)
        codec = f"make_codec(maps[{2 * k}], maps[{2 * k + 1}], {tables}, {fmt.bits})"
        codes = f"reinterpret_cast<uint8_t*>(row[{col[f's{k}_codes']}])"
        codes += " + at" if fmt.bits == 8 else " + r * ((length + 1) / 2) + j * (BLOCK / 2)"
        absmax = f"reinterpret_cast<float*>(row[{col[f's{k}_absmax']}])[r * nblocks + j]"
        encode = _cpp_encoder(fmt, tables != "nullptr, nullptr, nullptr")
        return CppPieces(
            constants=constants, codec=f"const Codec codec{k} = {codec};",
            load=f"decode{fmt.bits}({codes}, n, codec{k}, {absmax}, S{k});",
            store=(f"{{ const float amax = from_bits(top{k}); "
                   f"{encode}(S{k}, n, amax == 0.0f ? 1.0f : amax, codec{k}, {codes}); {absmax} = amax; }}"),
            probe=f"if (k == {k}) fo_probe({codec}, {encode}, decode{fmt.bits}, x, n, codes, absmax, out);",
            top=True)

    def triton_tables(self, i: int, fmt: Format) -> list[tuple[str, str]]:
        return [(f"s{i}_map", "*fp32"), (f"s{i}_lut", "*i32")]

    def triton_prelude(self, whole: bool) -> list[str]:
        if self.bits == 8:
            return []
        kb = "tl.arange(0, QB // 2)"  # 4 bits: two codes a byte, so byte offsets of their own
        if whole:
            return ["byte_offs = tl.multiple_of(b0 * (QB // 2), QB // 2) + tile[:, None] * (QB // 2)"
                    f" + {kb}[None, :]",
                    "byte_mask = block_mask[:, None]"]
        return [f"byte_offs = (r * ((length + 1) // 2) + j * (QB // 2))[:, None] + {kb}[None, :]",
                f"byte_mask = block_mask[:, None] & ({kb}[None, :] < ((n_in + 1) // 2)[:, None])"]

    def triton_load(self, i: int, fmt: Format, whole: bool) -> list[str]:
        lines = [f"s{i}_amax = tl.load(s{i}_absmax + blocks, mask=block_mask, other=0.0)"]
        if fmt.bits == 8:
            lines.append(f"s{i}_code = tl.load(s{i}_codes + offs, mask=mask, other=0).to(tl.int32)")
        else:  # two codes a byte along the row, the first in the low nibble
            lines += [f"s{i}_byte = tl.load(s{i}_codes + byte_offs, mask=byte_mask, other=0).to(tl.int32)",
                      f"s{i}_code = tl.reshape(tl.join(s{i}_byte & 15, s{i}_byte >> 4), (TB, QB))"]
        lines.append(f"s{i} = tl.load(s{i}_map + s{i}_code) * s{i}_amax[:, None]")
        return lines

    def triton_store(self, i: int, fmt: Format, out: str) -> list[str]:
        enc = quant.encoder(fmt.qmap)
        lines = [f"s{i}_new = {out}",
                 # absmax through the bits: integer max orders |x| as the values do
                 f"s{i}_mag = tl.where(mask, s{i}_new.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)",
                 # (tl.reduce with the standard combine, not tl.max: a jit function chosen when triton is
                 # imported, which the interpreter cannot call when it is switched on later)
                 f"s{i}_amax = tl.reduce(s{i}_mag, 1, tl.standard._elementwise_max).to(tl.float32, bitcast=True)",
                 f"s{i}_div = tl.where(s{i}_amax == 0.0, 1.0, s{i}_amax)",
                 f"s{i}_y = tl.div_rn(s{i}_new, s{i}_div[:, None]).to(tl.int32, bitcast=True)",
                 f"s{i}_neg = s{i}_y < 0",
                 f"s{i}_m = tl.minimum(tl.maximum(s{i}_y & 0x7FFFFFFF, {enc.lowest}), {enc.highest})",
                 f"s{i}_entry = tl.load(s{i}_lut + (((s{i}_m - {enc.lowest}) >> {enc.shift}) "
                 f"+ tl.where(s{i}_neg, {enc.half}, 0)))",
                 f"s{i}_low = (s{i}_m & {enc.mask}) ^ tl.where(s{i}_neg, {enc.mask}, 0)",
                 f"s{i}_code = ((s{i}_entry >> 24) & 255) + (s{i}_low > (s{i}_entry & {enc.mask})).to(tl.int32)",
                 f"s{i}_code = tl.where(mask, s{i}_code, 0)"]  # past a row's end: a 4-bit pad nibble is 0
        if fmt.bits == 8:
            lines.append(f"tl.store(s{i}_codes + offs, s{i}_code.to(tl.uint8), mask=mask)")
        else:
            lines += [f"s{i}_even, s{i}_odd = tl.split(tl.reshape(s{i}_code, (TB, QB // 2, 2)))",
                      f"tl.store(s{i}_codes + byte_offs, (s{i}_even | (s{i}_odd << 4)).to(tl.uint8), mask=byte_mask)"]
        lines.append(f"tl.store(s{i}_absmax + blocks, s{i}_amax, mask=block_mask)")
        return lines


def _cpp_tables(k: int, fmt: Format) -> tuple[str, list[str]]:
    """``make_codec``'s table arguments for quantized state ``k`` (bounds, octaves, cells), and the constants
    that hold them: the 4-bit map's boundaries; the AVX-512 8-bit encoder's cell tables (``cell_tables``)."""
    if fmt.bits == 4:
        literals = ", ".join(map(native.float_literal, fmt.qmap.boundaries().tolist()))
        return f"BOUNDS{k}, nullptr, nullptr", [f"static const float BOUNDS{k}[15] = {{{literals}}};"]
    tables = cell_tables(fmt.qmap)
    if tables is None:
        return "nullptr, nullptr, nullptr", []
    octave_table, cell_table, bound_table = tables
    return f"BOUNDS{k}, OCTAVES{k}, CELLS{k}", [
        f"static const int32_t OCTAVES{k}[64] = {{{', '.join(map(str, octave_table))}}};",
        f"static const uint8_t CELLS{k}[512] = {{{', '.join(map(str, cell_table))}}};",
        f"static const float BOUNDS{k}[256] = {{{', '.join(map(native.float_literal, bound_table))}}};"]


def _cpp_encoder(fmt: Format, has_cells: bool) -> str:
    """The codec's encode for ``fmt``, its ``quant.Encoder`` constants and fast path as template arguments: 8 bits,
    whether the cell tables are there; 4 bits, whether the map is the linear one (encoded by its formula)."""
    enc = quant.encoder(fmt.qmap)
    if fmt.bits == 4:
        fast = fmt.qmap.boundaries().tolist() == [(k + 1.5) / 16 for k in range(15)]
    else:
        fast = has_cells
    return f"encode{fmt.bits}<{enc.shift}, {enc.lowest}u, {enc.highest}u, {enc.half}, {str(fast).lower()}>"


@lru_cache(maxsize=None)
def cell_tables(qmap: quant.QuantMap) -> tuple[list[int], list[int], list[float]] | None:
    """The AVX-512 8-bit encoder's tables for ``qmap`` (None where they do not fit: it then reads
    ``quant.Encoder``'s table lane by lane: slower).

    ``quant.Encoder`` cuts every octave of magnitudes into the same number of cells; here each octave (per
    sign) takes the fewest leading mantissa bits that leave at most one boundary in a cell, so all cells fit
    in 512 bytes. Per octave (index ``32 * sign + (exponent & 31)``): ``(adjust << 5) | shift``, the cell of
    magnitude bits ``m`` being ``(m >> shift) + adjust``; per cell: its lowest code; and the 255 boundaries
    and 2.0. A cell's code is its lowest code, plus one where the value is above the boundary that follows
    that code (the one boundary inside the cell, if any). Checked here on every cell's ends with the
    encoder itself."""
    enc = quant.encoder(qmap)
    first_exponent, last_exponent = enc.lowest >> 23, enc.highest >> 23
    if qmap.bits != 8 or last_exponent - first_exponent >= 32:
        return None

    def codes(magnitudes: list[int], negative: bool) -> list[int]:
        bits = torch.tensor(magnitudes, dtype=torch.int64) | ((1 << 31) if negative else 0)
        bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
        return enc.encode(bits.view(torch.float32)).tolist()

    octaves, cells = [0] * 64, []
    for sign in (0, 1):
        for exponent in range(first_exponent, last_exponent + 1):
            low, high = max(enc.lowest, exponent << 23), min(enc.highest, ((exponent + 1) << 23) - 1)
            for shift in range(23, -1, -1):
                index = range(low >> shift, (high >> shift) + 1)
                at_low = codes([max(k << shift, low) for k in index], bool(sign))
                at_high = codes([min(((k + 1) << shift) - 1, high) for k in index], bool(sign))
                if all(abs(a - b) <= 1 for a, b in zip(at_low, at_high)):
                    break
            octaves[32 * sign + (exponent & 31)] = ((len(cells) - index[0]) << 5) | shift
            cells += [min(a, b) for a, b in zip(at_low, at_high)]
    if len(cells) > 512:
        return None
    bounds = qmap.boundaries().tolist() + [2.0]
    return octaves, cells + [0] * (512 - len(cells)), bounds


DYNAMIC8 = Dynamic(8, ("int8",))
DYNAMIC4 = Dynamic(4, ("int4",))
