"""Other libraries' optimizers, timed beside fastoptim when they are installed.

Each entry: (label, module to import, factory(params, kwargs) -> optimizer, state precision). Imports happen
only when a row is built, so a missing library costs nothing but its rows. Peers that compile on their first
step (heavyball, torchao's low-bit states: how long, in docs/performance.md) come with "all" only.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable, NamedTuple

Factory = Callable[[list, dict], object]


def _lib(name: str):
    return importlib.import_module(name)


def _optimi(cls: str) -> Factory:
    return lambda ps, kw: getattr(_lib("optimi"), cls)(ps, foreach=True, **kw)


def _bnb(cls: str, **extra) -> Factory:
    return lambda ps, kw: getattr(_lib("bitsandbytes").optim, cls)(ps, **extra, **kw)


def _torchao(cls: str) -> Factory:
    return lambda ps, kw: getattr(_lib("torchao.optim"), cls)(ps, **kw)


def _heavyball(cls: str) -> Factory:
    return lambda ps, kw: getattr(_lib("heavyball"), cls)(ps, **kw)


class Peer(NamedTuple):
    label: str
    module: str          # what must be importable
    factory: Factory
    state_bits: int
    compiles: bool = False  # compiles on its first step: timed with --peers all only


PEERS: dict[str, list[Peer]] = {
    "adamw": [Peer("optimi AdamW", "optimi", _optimi("AdamW"), 32),
              Peer("heavyball AdamW", "heavyball", _heavyball("AdamW"), 32, compiles=True),
              Peer("bitsandbytes AdamW", "bitsandbytes", _bnb("AdamW"), 32),
              Peer("bitsandbytes AdamW8bit", "bitsandbytes", _bnb("AdamW8bit", min_8bit_size=4096), 8),
              Peer("torchao AdamW8bit", "torchao", _torchao("AdamW8bit"), 8, compiles=True),
              Peer("torchao AdamW4bit", "torchao", _torchao("AdamW4bit"), 4, compiles=True)],
    "adam": [Peer("optimi Adam", "optimi", _optimi("Adam"), 32),
             Peer("bitsandbytes Adam", "bitsandbytes", _bnb("Adam"), 32),
             Peer("bitsandbytes Adam8bit", "bitsandbytes", _bnb("Adam8bit", min_8bit_size=4096), 8)],
    "sgd": [Peer("optimi SGD", "optimi", _optimi("SGD"), 32),
            Peer("bitsandbytes SGD", "bitsandbytes", _bnb("SGD"), 32)],
    "lion": [Peer("optimi Lion", "optimi", _optimi("Lion"), 32),
             Peer("bitsandbytes Lion", "bitsandbytes", _bnb("Lion"), 32),
             Peer("bitsandbytes Lion8bit", "bitsandbytes", _bnb("Lion8bit", min_8bit_size=4096), 8)],
    "rmsprop": [Peer("bitsandbytes RMSprop", "bitsandbytes", _bnb("RMSprop"), 32)],
    "adagrad": [Peer("bitsandbytes Adagrad", "bitsandbytes", _bnb("Adagrad"), 32)],
}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def peer_rows(optimizer: str, kwargs: dict, everything: bool = False) -> list[tuple[str, str, Callable, int]]:
    """(label, library, build, state bits) for the installed peers: full-precision ones that start fast, or with
    ``everything`` also low-bit and compile-on-first-step ones."""
    rows = []
    for peer in PEERS.get(optimizer, []):
        if (everything or (peer.state_bits == 32 and not peer.compiles)) and installed(peer.module):
            rows.append((peer.label, peer.module, lambda ps, f=peer.factory: f(ps, dict(kwargs)), peer.state_bits))
    return rows
