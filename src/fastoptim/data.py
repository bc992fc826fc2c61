"""Text that ships with Python: the pydoc topic help (``pydoc_data.topics``, ~0.5 MB of English), as bytes."""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def corpus_bytes() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def corpus_tensor() -> torch.Tensor:
    """The corpus as a uint8 tensor (byte-level tokens 0..255)."""
    return torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8)


def batches(tokens: torch.Tensor, batch_size: int, context: int, seed: int):
    """Endless (inputs, next-token targets) windows, in an order fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - context - 1, (batch_size,), generator=g)
        windows = torch.stack([tokens[s:s + context + 1] for s in starts.tolist()]).long()
        yield windows[:, :-1], windows[:, 1:]
