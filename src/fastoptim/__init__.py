"""fastoptim: torch.optim drop-in optimizers, each written once and run at the level you choose."""

from . import schedules
from .clip import clip_grad_norm_, grad_norm
from .factory import create, param_groups
from .levels import IMPLS
from .optimizer import FastOptimizer
from .optimizers import ASGD, SGD, Adadelta, Adafactor, Adagrad, Adam, Adamax, AdamW, Lion, Muon, NAdam, RAdam, RMSprop, Rprop
from .registry import OPTIMIZERS

__version__ = "0.1.0"

__all__ = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Lion", "Adamax", "Adadelta", "RAdam", "NAdam", "Rprop", "ASGD", "Adafactor", "Muon",
           "FastOptimizer", "create", "param_groups", "OPTIMIZERS", "IMPLS", "clip_grad_norm_", "grad_norm", "schedules", "__version__"]
