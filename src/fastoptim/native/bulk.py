"""A step's per-tensor bookkeeping over thousands of tensors, each in one C++ pass.

Every step: flat mode checks that each param is still its view of the flat buffer and each ``.grad`` its view
of the grad buffer (``all_set_to``), and other plans that each param lies where and as it did (``layouts``): a
cache must never outlive what it caches; the kernels', that each grad is of the dtype, contiguity and shape
their tables were made for (``kinds``); the params with grads are collected (``with_grads``); every level
counts the step as an in-place write to each param (``bump_versions``); and each param's state dict gets the
new ``step`` (``set_each``). From Python each costs a microsecond or so a tensor with the caches cold after
the step, which over the thousands of tensors of a deep model is as long as an 8-bit step's own work. Here each
is one call over the whole list (the cache misses of many tensors overlapped by prefetching): a small CPython
extension, ``native/bulk.cpp``, built against the installed torch's headers at first use and cached beside
the CPU kernels (its name carries the torch and Python versions it was built for). Where it cannot be built
(no compiler, no Python headers) Python loops give the same results.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import operator
import os
import sys
import sysconfig
from functools import lru_cache
from typing import Iterable, Sequence

import torch
from torch import Tensor

from .. import native  # (the package: its compiler, build and cache)


def _build_flags() -> tuple[list[str], list[str]]:
    """Compiler and linker flags for an extension of this torch and this Python."""
    torch_dir = os.path.dirname(torch.__file__)
    include = os.path.join(torch_dir, "include")
    lib = os.path.join(torch_dir, "lib")
    flags = ["-O2", "-shared", "-fPIC", "-std=c++17", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-I{include}", f"-I{os.path.join(include, 'torch', 'csrc', 'api', 'include')}",
             f"-I{sysconfig.get_paths()['include']}"]
    libraries = [f"-L{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib}"]
    return flags, libraries


native_calls = 0  # how many times a C++ pass ran (tests check that the fast path ran)


def unavailable() -> str | None:
    """None where the C++ passes run here, else why Python loops answer instead (found out once)."""
    return _loaded()[1]


@lru_cache(maxsize=1)
def _loaded() -> tuple[object | None, str | None]:
    try:
        return _module(), None
    except Exception as e:  # not built, or built but not loadable here: the Python loops answer
        return None, str(e)


def _module():
    """The built extension, from the kernel cache folder or built into it (once per machine)."""
    cxx = native.required_compiler()
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        raise native.KernelUnavailable("no Python headers (Python.h) to build against")
    flags, libraries = _build_flags()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = (torch.__version__, torch.version.git_version, sys.version, suffix)
    return native.load("bulk", native.read("bulk.cpp"), flags, libraries, key=key, suffix=suffix, loader=_import,
                       cxx=cxx)


def _import(path: str):
    loader = importlib.machinery.ExtensionFileLoader("fastoptim_bulk", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def _sequence(items: Iterable) -> list | tuple:
    return items if isinstance(items, (list, tuple)) else list(items)


def _native(name: str):
    """The C++ pass ``name`` (its use counted in ``native_calls``), or None where the extension is not here."""
    global native_calls
    module = _loaded()[0]
    if module is None:
        return None
    native_calls += 1
    return getattr(module, name)


def all_set_to(a: Sequence, b: Sequence, grads: bool = False) -> bool:
    """``len(a) == len(b)`` and each ``a[i]`` (its ``.grad`` where ``grads``) is ``set_to(b[i])``."""
    native = _native("all_set_to")
    if native is not None:
        return native(_sequence(a), _sequence(b), grads)
    if grads:
        a = [getattr(x, "grad", None) for x in a]
    if len(a) != len(b):
        return False
    try:  # set_to over the lists, each test one C-level loop (a Python call per tensor costs twice as much)
        return ({t.__torch_dispatch__ for t in {*map(type, a), *map(type, b)}} <= {_TORCHS_OWN}
                and {*map(_layout, a), *map(_layout, b)} <= {torch.strided}
                and all(map(operator.eq, map(_dtype, a), map(_dtype, b))) and all(map(Tensor.is_set_to, a, b)))
    except (AttributeError, TypeError, NotImplementedError, RuntimeError):  # no tensor (None), a meta tensor
        return False


def with_grads(params: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor], bool, bool]:
    """The params whose ``.grad`` is not None, their grads, whether every such grad is strided, of its param's
    dtype and not a lazily negated view (where not, the caller looks at each), and whether every one is also
    contiguous and of its param's shape (*dense*: a kernel's answers about the params then hold for the grads)."""
    native = _native("with_grads")
    found = None if native is None else native(_sequence(params), torch.nn.Parameter)
    if found is not None:
        return found
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    plain = all(g.layout == torch.strided and g.dtype == p.dtype and not g.is_neg() for p, g in zip(params, grads))
    dense = plain and all(type(g) is Tensor and g.is_contiguous() and g.shape == p.shape  # (a subclass: not known)
                          for p, g in zip(params, grads))
    return params, grads, plain, dense


def layouts(tensors: Sequence[Tensor], shapes: bool | int = True) -> object:
    """Where each tensor's data lies (``data_ptr``) and, where ``shapes`` (True: of every tensor; a number: of
    that many first ones), its sizes and strides: equal results (of one process) mean every tensor lies where
    and as it did (``p.data = ...``, ``p.t_()``, a resize or ``share_memory_()`` since change it, even at the
    same address)."""
    tensors = _sequence(tensors)
    shaped = len(tensors) if shapes is True else int(shapes)
    native = _native("layouts")
    if native is not None:
        return native(tensors, shaped)
    addresses = list(map(Tensor.data_ptr, tensors))
    return [(a, t.stride(), t.size()) if i < shaped else a for i, (a, t) in enumerate(zip(addresses, tensors))]


def kinds(tensors: Sequence[Tensor]) -> object:
    """Each tensor's dtype, whether it is contiguous, and its shape: equal results (of one process) mean every
    tensor is of the dtype, contiguity and shape it was."""
    native = _native("kinds")
    if native is not None:
        return native(_sequence(tensors))
    return list(zip(map(_dtype, tensors), map(Tensor.is_contiguous, tensors), map(Tensor.size, tensors)))


def bump_versions(tensors: Iterable[Tensor]) -> None:
    """``torch.autograd.graph.increment_version(tensors)``: autograd counts an in-place write to each."""
    native = _native("bump_versions")
    if native is not None:
        return native(_sequence(tensors))
    torch.autograd.graph.increment_version(tensors)


def set_each(dicts: Iterable[dict], key, value) -> None:
    """``dict.__setitem__(d, key, value)`` for each ``d`` (a subclass's own ``__setitem__`` is not called)."""
    native = _native("set_each")
    if native is not None:
        return native(_sequence(dicts), key, value)
    setitem = dict.__setitem__
    for d in dicts:
        setitem(d, key, value)


def set_to(x, y) -> bool:
    """Whether ``x`` lies on ``y``'s memory exactly as ``y`` does (``is_set_to``: the same storage, offset,
    sizes and strides) with ``y``'s dtype, both read as they lie. False where either is no tensor, or one whose
    values are not its memory as it lies (not strided, a lazy negation or conjugation, a zero tensor, a meta
    tensor, a Python subclass that answers for itself)."""
    try:  # is_set_to materializes a lazy negation, conjugation or zero tensor (a copy: False); meta: raises
        return (isinstance(x, Tensor) and isinstance(y, Tensor) and x.dtype == y.dtype
                and type(x).__torch_dispatch__ is _TORCHS_OWN and type(y).__torch_dispatch__ is _TORCHS_OWN
                and x.layout == torch.strided and y.layout == torch.strided and x.is_set_to(y))
    except (NotImplementedError, RuntimeError):
        return False


_TORCHS_OWN = Tensor.__torch_dispatch__  # a subclass that dispatches by itself overrides it
_layout, _dtype = operator.attrgetter("layout"), operator.attrgetter("dtype")
