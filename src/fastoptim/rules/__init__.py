"""One file per algorithm family: the math, its defaults and torch's state names."""

from .adagrad import AdagradRule
from .adam import AdamRule
from .base import Rule
from .lion import LionRule
from .rmsprop import RMSpropRule
from .sgd import SGDRule

__all__ = ["Rule", "SGDRule", "AdamRule", "RMSpropRule", "AdagradRule", "LionRule"]
