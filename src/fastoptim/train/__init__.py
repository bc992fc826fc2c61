"""A modern GPT training loop on the whole fastoptim stack (``fastoptim train``)."""

from .loop import TrainConfig, get_lr, main
from .model import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "TrainConfig", "get_lr", "main"]
