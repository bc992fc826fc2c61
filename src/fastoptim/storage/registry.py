"""The codecs by name, width and tag: the one table every format is looked up in (``storage.codecs`` registers
the built-in ones). Below the codecs and ``state.Format``, it imports neither: ``Format`` asks it for its codec."""

from __future__ import annotations

import zlib
from typing import Any

Codec = Format = Any  # (``codecs.base.Codec``, ``state.Format``: not imported, they are above this table)

CODECS: dict[str, Codec] = {}  # by name
_BY_ALIAS: dict[Any, Codec] = {}
_BY_BITS: dict[int, Codec] = {}  # each width's own format: what ``state_bits=`` names


def register(codec: Codec) -> Codec:
    """Make ``codec`` one of the formats (its names must be new). The first codec of a width is that width's
    own: ``state_bits=bits`` names it, ``state_bits`` (the optimizer's, a group's own) holds the number and its
    states' formats are ``Format(bits)``. One registered beside it is named only by its name: ``state_bits``
    holds the name (its ``key``) and its formats name it (``Codec.format``). No two formats may have the same
    ``tag_id``: checkpoints name formats by it."""
    for key in (codec.name, *codec.aliases):
        if key in _BY_ALIAS:
            raise ValueError(f"state format name {key!r} is taken by {_BY_ALIAS[key].name!r}")
    own = codec.bits not in _BY_BITS
    codec.key, codec.format_name = (codec.bits, None) if own else (codec.name, codec.name)
    taken = {tag_id(c.tag(f)): (c.name, c.tag(f)) for c in CODECS.values() for f in c.formats()}
    for fmt in codec.formats():  # a checkpoint names a format by its id alone: no two formats may share one
        tag = codec.tag(fmt)
        if tag_id(tag) in taken:
            vars(codec).pop("key", None), vars(codec).pop("format_name", None)  # left as it came
            other, other_tag = taken[tag_id(tag)]
            raise ValueError(f"state format tag {tag!r} has the id {tag_id(tag)} of {other!r}'s tag {other_tag!r}: "
                             f"a checkpoint could not tell them apart; give it another tag")
        taken[tag_id(tag)] = (codec.name, tag)
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


def tag_id(tag: str) -> int:
    """The int a checkpoint names a format by (``Format.id``): fixed by its tag alone, so the same whatever the
    order codecs were registered in (an int, not the tag: DCP's flattened optimizer state takes no strings)."""
    return zlib.crc32(tag.encode())


def from_tag(tag: str) -> Format:
    """The format a checkpoint's ``tag`` names (``Codec.tag`` of one of a codec's ``formats``)."""
    for codec in CODECS.values():
        for fmt in codec.formats():
            if codec.tag(fmt) == tag:
                return fmt
    raise ValueError(f"unknown quantized state format {tag!r}")


def from_id(number: int) -> Format:
    """The format whose ``tag_id`` is ``number`` (one of a codec's ``formats``)."""
    for codec in CODECS.values():
        for fmt in codec.formats():
            if tag_id(codec.tag(fmt)) == number:
                return fmt
    known = ", ".join(f"{tag_id(c.tag(f))} ({c.tag(f)})" for c in CODECS.values() for f in c.formats())
    raise ValueError(f"unknown quantized state format id {number!r} (the registered formats' ids: {known})")


def keys() -> tuple:
    """What ``state_bits`` (a group's, the optimizer's) may hold: each width, then each other codec's name."""
    return tuple(c.key for c in CODECS.values())

