"""What a codec is: the ``Codec`` interface and ``CppPieces`` (``storage.codecs`` lists the codecs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ..state import Format


@dataclass
class CppPieces:
    """One state's part of the CPU kernel's source: file-scope ``constants``, the ``codec`` line made once per
    call, the ``load`` of a block into the fp32 array ``S<k>`` and its ``store`` back, and the codec's ``probe``
    (its test hook). Lines of C++; empty where the format has none."""
    load: str
    store: str
    constants: list[str] = field(default_factory=list)
    codec: str = ""
    probe: str = ""


class Codec:
    """One state format. Subclasses fill in what their format does; ``Format`` stays the small immutable value a
    state, a checkpoint tag and a kernel's cache key carry (``of`` finds its codec)."""
    name: str
    aliases: tuple = ()
    bits: int
    quantized = False

    def format_for(self, p: Tensor, state: str, min_quant_size: int, unsigned_states: frozenset) -> Format:
        raise NotImplementedError

    def make(self, p: Tensor, fmt: Format, value: float) -> Any:
        raise NotImplementedError

    def load(self, state: Any, p: Tensor) -> Tensor:
        return state.to(p.dtype)

    def store(self, state: Any, values: Tensor) -> None:
        state.copy_(values)

    def tag(self, fmt: Format) -> str:
        """What a checkpoint records of ``fmt`` (``Format.tag``: the map's name and block)."""
        return fmt.tag

    def entries(self, name: str, value: Any) -> dict:
        """What ``state_dict()`` holds for state ``name``: the state itself for tensors."""
        return {name: value}

    def cpp(self, k: int, fmt: Format, col: dict) -> CppPieces | None:
        """State ``k``'s pieces of the CPU kernel (``col``: the table's column of each address), or None: the
        kernel does not take this format."""
        return None

    def triton_load(self, i: int, fmt: Format, whole: bool) -> list[str]:
        raise NotImplementedError(f"no Triton kernel hook for {self.name}")

    def triton_store(self, i: int, fmt: Format, out: str) -> list[str]:
        raise NotImplementedError(f"no Triton kernel hook for {self.name}")
