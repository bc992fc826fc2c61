"""``optimizer.state`` that counts its changes, so the step plan (``plan``) never outlives what it caches.

Every change made through the mapping or a per-param dict it owns (a cleared or deleted state, a state added,
removed or replaced) counts in ``StateMap.version``; the plan compares it at every step. Both are made as a
dict and a ``defaultdict`` are made, because code that walks ``optimizer.state`` (Lightning's
``apply_to_collection``, accelerate's ``send_to_device``) rebuilds each mapping it finds as
``type(m)(items)`` (a ``defaultdict`` as ``type(m)(factory, items)``) and gives the result back.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any


class StateDict(dict):
    """One param's state. Every change made through it counts in its mapping's ``version``. Made as a dict is
    made (code that walks ``optimizer.state`` rebuilds each mapping as ``type(m)(items)``), it belongs to no
    mapping until a ``StateMap`` takes it in."""

    __slots__ = ("_owner",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._owner: StateMap | None = None

    @classmethod
    def owned(cls, owner: "StateMap", *args) -> "StateDict":
        state = cls(*args)
        state._owner = owner
        return state

    def _changed(self) -> None:
        if self._owner is not None:
            self._owner.version += 1

    def __setitem__(self, key, value):
        self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._changed()
        super().__delitem__(key)

    def __ior__(self, other):
        self._changed()
        return super().__ior__(other)

    def clear(self):
        self._changed()
        super().clear()

    def pop(self, *args):
        self._changed()
        return super().pop(*args)

    def popitem(self):
        self._changed()
        return super().popitem()

    def setdefault(self, key, default=None):
        if key not in self:
            self._changed()
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        self._changed()
        super().update(*args, **kwargs)

    def __reduce__(self):  # pickles (torch.save, deepcopy) as a plain dict
        return dict, (dict(self),)


class StateMap(defaultdict):
    """``optimizer.state``: a ``defaultdict(dict)`` that counts its changes. The states it makes itself are
    ``StateDict``s, which count theirs; a dict you put in stays yours (the same object, as in torch), and
    the plan of a group holding one is made afresh every step, since its changes are not counted.
    ``adopt=True`` (loading a checkpoint) makes every plain dict a ``StateDict``. It is made as a dict or a
    ``defaultdict`` is (``StateMap(items)``, ``StateMap(factory, items)``: walkers rebuild mappings so; it
    makes ``StateDict``s whatever the factory), and takes in every ``StateDict`` of no mapping put into it."""

    def __init__(self, *args: Any, adopt: bool = False, **kwargs: Any):
        super().__init__(None)
        self.version = 0
        if args and (args[0] is None or callable(args[0])):  # a default factory: the states it makes are ours
            args = args[1:]
        for key, value in dict(*args, **kwargs).items():
            dict.__setitem__(self, key, StateDict.owned(self, value) if adopt and type(value) is dict
                             else self._take(value))

    def _take(self, value: Any) -> Any:
        if type(value) is StateDict and value._owner is None:
            value._owner = self
        return value

    def tracks(self, state: Any) -> bool:
        """Whether every change to ``state`` counts in this mapping's version."""
        return type(state) is StateDict and state._owner is self

    def __missing__(self, key):
        value = StateDict.owned(self)
        self.version += 1
        dict.__setitem__(self, key, value)
        return value

    def __setitem__(self, key, value):
        self.version += 1
        dict.__setitem__(self, key, self._take(value))

    def __delitem__(self, key):
        self.version += 1
        dict.__delitem__(self, key)

    def __ior__(self, other):
        self.update(other)
        return self

    def clear(self):
        self.version += 1
        dict.clear(self)

    def pop(self, *args):
        self.version += 1
        return dict.pop(self, *args)

    def popitem(self):
        self.version += 1
        return dict.popitem(self)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = StateDict.owned(self) if default is None else default
        return self[key]

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def copy(self):
        """A shallow copy, as torch's mapping gives: a ``defaultdict(dict)`` holding the same dicts."""
        return defaultdict(dict, self)

    __copy__ = copy

    def __reduce__(self):  # pickles as torch's own defaultdict(dict) of plain dicts
        return defaultdict, (dict,), None, None, iter((k, dict(v) if isinstance(v, dict) else v)
                                                      for k, v in self.items())

    def __repr__(self):
        return f"StateMap({dict.__repr__(self)})"

    def fresh_dict(self, key) -> StateDict:
        """A new, empty state for ``key``, put in place without counting (the plan's own bookkeeping)."""
        value = StateDict.owned(self)
        dict.__setitem__(self, key, value)
        return value


def as_state_map(state: Any, adopt: bool = False) -> StateMap:
    return state if isinstance(state, StateMap) else StateMap(state, adopt=adopt)


def quiet_set(state: dict, key: str, value: Any) -> None:
    """A write that the plan makes itself and already accounts for: not counted as a change."""
    dict.__setitem__(state, key, value)
