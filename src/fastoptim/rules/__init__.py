"""One file per algorithm family: the math, its defaults, torch's state names and everything else that is said
about the optimizer once (``base.Rule``). Every module of this package is imported here, and each registers its
rules (``base.register``): a new optimizer is a new file, and ``RULES`` lists it."""

import importlib
import pkgutil

from .base import RULES, Rule, register

_NOT_RULES = {"base", "common", "declared", "prims"}

__all__ = ["Rule", "RULES", "register"]
for _module in pkgutil.iter_modules(__path__):
    if _module.name in _NOT_RULES or _module.name.startswith("_"):
        continue
    _loaded = importlib.import_module(f"{__name__}.{_module.name}")
    for _name, _value in vars(_loaded).items():  # the rule classes, as before: ``from fastoptim.rules import AdamRule``
        if isinstance(_value, type) and issubclass(_value, Rule) and _value is not Rule and _name.endswith("Rule"):
            globals()[_name] = _value
            if _name not in __all__:
                __all__.append(_name)
