"""What this process can run and where a warning points: whether Triton is here and runs a device's tensors,
and the stack level of the user's frame under a step."""

from __future__ import annotations

import os
import sys
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def uses_triton(device: torch.device) -> bool:
    """Whether the fused level runs its Triton kernel here: CUDA tensors, or CPU tensors while Triton's
    interpreter is on (``TRITON_INTERPRET=1``, how the kernels are tested without a GPU)."""
    wanted = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return wanted and triton_available()


_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside fastoptim and torch (the user's
    ``opt.step()``), however deep inside the step it is raised."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level
