"""State formats as codecs, looked up by name: how one optimizer state is kept, and everything that depends on it.

A codec owns, for its format:

* ``name`` (what ``state_format=`` takes), ``aliases`` and ``bits`` (the ``state_bits=`` number it stands for:
  the key param groups and checkpoints carry, unchanged);
* ``format_for``: the ``Format`` a state of a param gets (quantized formats leave small params plain);
* ``make`` (a new state, every element one value), ``load`` (a temporary of the param's dtype, for the staged
  path) and ``store`` (fp32 values back into the state);
* ``entries`` and ``tag``: what ``state_dict()`` writes for a state (``storage.export_entry``) and the tag that
  ``load_state_dict`` reads back (``Format.from_tag``);
* its kernel hooks: ``cpp`` (the declarations, load and store the CPU kernel's template ``native/step_kernel.cpp``
  is filled with: ``paths.cpu_kernel.kernels``) and ``triton_load``/``triton_store`` (the lines of the Triton
  kernel over stored state: ``paths.triton_stored``).

Adding a format is one module here that defines its ``Codec`` (``base``), its line in the list below, and its
kernel hooks (a format the kernels are not offered, ``storage.kernel_format``, runs on the staged path, which needs
only ``load`` and ``store``).
"""

from __future__ import annotations

from typing import Any

from .base import Codec, CppPieces  # noqa: F401
from .bf16 import BF16_CODEC
from .dynamic import DYNAMIC4, DYNAMIC8
from .plain import PLAIN_CODEC

CODECS: dict[str, Codec] = {}  # by name
_BY_ALIAS: dict[Any, Codec] = {}
_BY_BITS: dict[int, Codec] = {}


def register(codec: Codec) -> Codec:
    """Make ``codec`` one of the formats (its names must be new)."""
    for key in (codec.name, *codec.aliases):
        if key in _BY_ALIAS:
            raise ValueError(f"state format name {key!r} is taken by {_BY_ALIAS[key].name!r}")
    CODECS[codec.name] = codec
    _BY_BITS[codec.bits] = codec
    for key in (codec.name, *codec.aliases):
        _BY_ALIAS[key] = codec
    return codec


for _codec in (PLAIN_CODEC, BF16_CODEC, DYNAMIC8, DYNAMIC4):  # the formats, in the order error messages list them
    register(_codec)


def names() -> str:
    """The names ``state_format=`` takes, for error messages and docs."""
    return ", ".join(repr(key) for c in CODECS.values() for key in (c.name, *c.aliases))


def lookup(name: Any, where: str = "state_format") -> Codec:
    """The codec called ``name`` (its name or an alias); ValueError naming the valid ones otherwise."""
    codec = _BY_ALIAS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise ValueError(f"Invalid {where}: {name!r} (must be one of {names()})")
    return codec


def for_bits(bits: int) -> Codec:
    """The codec that ``state_bits=bits`` names."""
    return _BY_BITS[bits]


def of(fmt: Format) -> Codec:
    """The codec of a state kept in ``fmt``."""
    return _BY_BITS[fmt.bits]

