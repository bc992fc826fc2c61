"""State formats as codecs, looked up by name: how one optimizer state is kept, and everything that depends on it.

A codec owns, for its format:

* ``name`` (what ``state_format=`` takes), ``aliases`` and ``bits`` (the ``state_bits=`` number it stands for:
  the key param groups and checkpoints carry, unchanged);
* ``format_for``: the ``Format`` a state of a param gets (quantized formats leave small params plain);
* ``make`` (a new state, every element one value), ``load`` (a temporary of the param's dtype, for the staged
  path) and ``store`` (fp32 values back into the state);
* ``tensor_dtype`` (the dtype of a state kept as one tensor; None: kept as several, ``parts``/``assemble``/
  ``tensors``, which flat mode pools and keeps apart from its buffers) and ``adopt`` (a tensor found in
  ``optimizer.state`` converted to it);
* ``entries`` and ``tag``: what ``state_dict()`` writes for a state (``storage.export_entry``) and the tag that
  ``load_state_dict`` reads back (``Format.from_tag``);
* its kernel hooks: ``kernel_format`` (which states a kernel may take in place), the walk over a param
  (``kernel_block``, ``walk``, ``tables``), ``columns``/``cpp`` (the table's columns and the declarations, load
  and store the CPU kernel's template ``native/step_kernel.cpp`` is filled with: ``paths.cpu_kernel.kernels``)
  and ``triton_pointers``/``triton_tables``/``triton_prelude``/``triton_load``/``triton_store`` (the lines of
  the Triton kernel over stored state: ``paths.triton_stored``).

Adding a format is one module here that defines its ``Codec`` (``base``), its line in the list below, and its
kernel hooks (a format the kernels are not offered, ``kernel_format`` None, runs on the staged path, which needs
only ``make``, ``load`` and ``store``). A codec registered beside its width's own (a test's, a user's) is named by
its name only: ``state_format=`` takes it, param groups carry the name where they carry a width, and its states'
``Format`` names it. A state kept as one tensor is told apart by its dtype alone (``storage.kernel_format`` asks
each codec in turn), so two such codecs should not keep the same dtype with different kernel hooks.
"""

from __future__ import annotations

from typing import Any

from ..state import Format
from .base import Codec, CppPieces  # noqa: F401
from .bf16 import BF16_CODEC
from .dynamic import DYNAMIC4, DYNAMIC8
from .plain import PLAIN_CODEC

CODECS: dict[str, Codec] = {}  # by name
_BY_ALIAS: dict[Any, Codec] = {}
_BY_BITS: dict[int, Codec] = {}  # each width's own format: what ``state_bits=`` names


def register(codec: Codec) -> Codec:
    """Make ``codec`` one of the formats (its names must be new). The first codec of a width is that width's
    own: ``state_bits=bits`` names it, param groups and checkpoints carry the number and its states' formats
    are ``Format(bits)``. One registered beside it is named only by its name: groups carry the name (its
    ``key``) and its formats name it (``Codec.format``)."""
    for key in (codec.name, *codec.aliases):
        if key in _BY_ALIAS:
            raise ValueError(f"state format name {key!r} is taken by {_BY_ALIAS[key].name!r}")
    own = codec.bits not in _BY_BITS
    codec.key, codec.format_name = (codec.bits, None) if own else (codec.name, codec.name)
    CODECS[codec.name] = codec
    if own:
        _BY_BITS[codec.bits] = codec
    for key in (codec.name, *codec.aliases):
        _BY_ALIAS[key] = codec
    return codec


def unregister(codec: Codec) -> None:
    """Take back a codec registered beside its width's own (a test's; the built-in formats stay)."""
    if CODECS.get(codec.name) is not codec or codec.format_name is None:
        raise ValueError(f"{codec.name!r} is not a state format registered beside the built-in ones")
    del CODECS[codec.name]
    for key in (codec.name, *codec.aliases):
        del _BY_ALIAS[key]


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


def for_bits(bits: int | str) -> Codec:
    """The codec that ``state_bits=bits`` names: a width, or a codec's ``key`` (its name, for one registered
    beside its width's own)."""
    return CODECS[bits] if isinstance(bits, str) else _BY_BITS[bits]


def of(fmt: Format) -> Codec:
    """The codec of a state kept in ``fmt``."""
    return _BY_BITS[fmt.bits] if fmt.codec is None else CODECS[fmt.codec]


def from_tag(tag: str) -> Format:
    """The format a checkpoint's ``tag`` names (``Codec.tag`` of one of a codec's ``formats``)."""
    for codec in CODECS.values():
        for fmt in codec.formats():
            if codec.tag(fmt) == tag:
                return fmt
    raise ValueError(f"unknown quantized state format {tag!r}")


def keys() -> tuple:
    """What ``state_bits`` (a group's, the optimizer's) may hold: each width, then each other codec's name."""
    return tuple(c.key for c in CODECS.values())

