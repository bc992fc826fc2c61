"""``--state-format`` and ``--state-bits``: one setting, two spellings (``storage.codecs``: a format by name, or
by the width it stands for). Given both, they must name the same formats, or the parser says so."""

from __future__ import annotations

import argparse
from typing import Any

from ..storage import codecs

OTHER = {"state_bits": "state_format", "state_format": "state_bits"}
FLAG = {"state_bits": "--state-bits", "state_format": "--state-format"}


def names() -> list[str]:
    """What ``--state-format`` takes: every format's name and aliases, in the registry's order."""
    return [key for c in codecs.CODECS.values() for key in (c.name, *c.aliases)]


def _as_list(values: Any) -> list:
    return list(values) if isinstance(values, (list, tuple)) else [values]


def chosen(dest: str, values: Any) -> list[codecs.Codec]:
    """The formats that flag ``dest``'s ``values`` (one or a list) name."""
    by = codecs.for_bits if dest == "state_bits" else codecs.lookup
    return [by(v) for v in _as_list(values)]


class Agreeing(argparse.Action):
    """Stores the flag's value; where the other spelling was given too, it must name the same formats."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        other = getattr(namespace, OTHER[self.dest], None)
        if other is not None and {c.name for c in chosen(self.dest, values)} != {
                c.name for c in chosen(OTHER[self.dest], other)}:
            ours = " ".join(map(str, _as_list(values)))
            theirs = " ".join(map(str, _as_list(other)))
            parser.error(f"{FLAG[OTHER[self.dest]]} {theirs} and {option_string} {ours} name different state "
                         f"formats; give one of them (--state-bits is --state-format by width)")


def resolve(state_bits: Any, state_format: Any) -> list[codecs.Codec]:
    """The formats the two flags name (``--state-format`` where given: the parser checked that they agree);
    [] when neither was given."""
    if state_format is not None:
        return chosen("state_format", state_format)
    return [] if state_bits is None else chosen("state_bits", state_bits)
