"""One file per algorithm family: the math, its defaults and torch's state names."""

from .adadelta import AdadeltaRule
from .adafactor import AdafactorRule
from .adagrad import AdagradRule
from .asgd import ASGDRule
from .adam import AdamRule
from .adamax import AdamaxRule
from .base import Rule
from .lion import LionRule
from .muon import MuonRule
from .nadam import NAdamRule
from .radam import RAdamRule
from .rmsprop import RMSpropRule
from .rprop import RpropRule
from .sgd import SGDRule

__all__ = ["Rule", "SGDRule", "AdamRule", "RMSpropRule", "AdagradRule", "LionRule", "AdamaxRule", "AdadeltaRule",
           "RAdamRule", "NAdamRule", "RpropRule", "ASGDRule", "AdafactorRule", "MuonRule"]
