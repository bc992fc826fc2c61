"""fastoptim: torch.optim drop-in optimizers, each written once and run at the level you choose."""

from . import schedules
from .clip import clip_grad_norm_, grad_norm
from .factory import create, param_groups
from .levels import IMPLS
from .optimizer import FastOptimizer
from . import optimizers as _optimizers
from .optimizers import *  # noqa: F401,F403  (one class per registered rule)
from .registry import OPTIMIZERS

__version__ = "0.1.0"

__all__ = [*_optimizers.__all__, "FastOptimizer", "create", "param_groups", "OPTIMIZERS", "IMPLS", "clip_grad_norm_", "grad_norm", "schedules", "__version__"]
