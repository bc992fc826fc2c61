"""Whether each of many tensors still lies on the same memory the same way as its partner, in one C++ pass.

Flat mode checks every step that each param is still its view of the flat buffer and each ``.grad`` its view
of the grad buffer (``p.data = x``, ``p.t_()`` or a replaced ``.grad`` must be seen: a cache must never
outlive what it caches). ``Tensor.is_set_to`` from Python costs 0.4-0.9 us a tensor through torch's
dispatcher: 3-7 ms a step for the 4000 tensors of a 2000-layer MLP, as long as the 8-bit step's own work.
This module asks the same question of a whole list in C++ (about 10 ns a tensor): a small CPython
extension built against the installed torch's headers at first use, cached beside the CPU kernels (its name
carries the torch and Python versions it was built for). Where it cannot be built (no compiler, no Python
headers) the Python loop answers, with the same result.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from functools import lru_cache

import torch
from torch import Tensor

from .levels import cpu_kernels

SOURCE = r"""
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <vector>

// Each check reads a few objects per tensor (its Python object, TensorImpl, and for a grad the autograd meta and
// the grad's TensorImpl) that a step's streaming has evicted: one dependent miss after another. So the lists
// are walked level by level, each walk prefetching AHEAD items on, and the misses of many tensors overlap.
constexpr size_t AHEAD = 16;

static void prefetch(const void* p, int lines) {
    for (int k = 0; k < lines; ++k) __builtin_prefetch(static_cast<const char*>(p) + 64 * k);
}

static bool is_tensor(PyObject* x) {  // Tensor and Parameter by type; a subclass by its C type (no Python call)
    return THPVariable_CheckExact(x) || PyObject_TypeCheck(x, reinterpret_cast<PyTypeObject*>(THPVariableClass));
}

// the TensorImpl of each item of a list or tuple (its .grad's where grads); null where not a tensor or no grad
static std::vector<c10::TensorImpl*> impls(PyObject* seq, bool grads) {
    const size_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    std::vector<c10::TensorImpl*> out(n);
    for (size_t i = 0; i < n; ++i) {
        if (i + AHEAD < n) prefetch(items[i + AHEAD], 1);
        out[i] = is_tensor(items[i]) ? THPVariable_Unpack(items[i]).unsafeGetTensorImpl() : nullptr;
    }
    if (!grads) return out;
    std::vector<c10::AutogradMetaInterface*> meta(n);
    for (size_t i = 0; i < n; ++i) {
        if (i + AHEAD < n && out[i + AHEAD]) prefetch(out[i + AHEAD], 4);
        meta[i] = out[i] ? out[i]->autograd_meta() : nullptr;
    }
    for (size_t i = 0; i < n; ++i) {
        if (i + AHEAD < n && meta[i + AHEAD]) prefetch(meta[i + AHEAD], 2);
        const at::TensorBase* grad = meta[i] ? &meta[i]->grad() : nullptr;
        out[i] = grad && grad->defined() ? grad->unsafeGetTensorImpl() : nullptr;
    }
    return out;
}

// Whether a tensor's values are what its memory holds, read as it lies: strided, not one with a lazy negation or
// conjugation, not a zero tensor (the dispatcher materializes those into a copy, so is_set_to says False), not
// a meta tensor, and not a Python subclass that answers for itself
static bool plain(const c10::TensorImpl* t) {
    return t->layout() == c10::kStrided && t->has_storage() && !t->is_conj() && !t->is_neg() && !t->_is_zerotensor() &&
           t->device_type() != c10::DeviceType::Meta && !t->key_set().has(c10::DispatchKey::Python);
}

// is_set_to's own test (ATen's native is_set_to: the same storage, offset, dims, sizes and strides), on plain
// tensors of one dtype (a view re-typed in place, p.data = p.data.view(dtype), is another tensor)
static bool set_to(const c10::TensorImpl* a, const c10::TensorImpl* b) {
    if (!a || !b || !plain(a) || !plain(b) || a->dtype() != b->dtype() ||
        a->storage().unsafeGetStorageImpl() != b->storage().unsafeGetStorageImpl() ||
        a->storage_offset() != b->storage_offset() || a->dim() != b->dim())
        return false;
    for (int64_t d = 0; d < a->dim(); ++d)
        if (a->sizes()[d] != b->sizes()[d] || a->strides()[d] != b->strides()[d]) return false;
    return true;
}

// all_set_to(a, b, grads): two lists (or tuples) of one length, each a[i] (its .grad where grads) a tensor set
// to b[i] (anything else: False)
static PyObject* all_set_to(PyObject*, PyObject* args) {
    PyObject *a, *b;
    int grads;
    if (!PyArg_ParseTuple(args, "OOp", &a, &b, &grads)) return nullptr;
    if (!(PyList_Check(a) || PyTuple_Check(a)) || !(PyList_Check(b) || PyTuple_Check(b))) {
        PyErr_SetString(PyExc_TypeError, "all_set_to takes two lists or tuples");
        return nullptr;
    }
    if (PySequence_Fast_GET_SIZE(a) != PySequence_Fast_GET_SIZE(b)) Py_RETURN_FALSE;
    try {  // a tensor whose storage or sizes cannot be read here (sparse, symbolic, a subclass's own): False
        const std::vector<c10::TensorImpl*> x = impls(a, grads), y = impls(b, false);
        for (size_t i = 0; i < x.size(); ++i) {
            if (i + AHEAD < x.size()) {
                if (x[i + AHEAD]) prefetch(x[i + AHEAD], 4);
                if (y[i + AHEAD]) prefetch(y[i + AHEAD], 4);
            }
            if (!set_to(x[i], y[i])) Py_RETURN_FALSE;
        }
    } catch (...) {
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {{"all_set_to", all_set_to, METH_VARARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastoptim_same_memory", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_fastoptim_same_memory() { return PyModule_Create(&module); }
"""


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


native_calls = 0  # how many times the C++ pass answered (tests check that the fast path ran)


def unavailable() -> str | None:
    """None where the C++ pass runs here, else why the Python loop answers instead (found out once)."""
    return _loaded()[1]


@lru_cache(maxsize=1)
def _loaded() -> tuple[object | None, str | None]:
    try:
        return _module(), None
    except Exception as e:  # not built, or built but not loadable here: the Python check answers
        return None, str(e)


def _module():
    """The built extension, from the kernel cache folder or built into it (once per machine: about 25 s)."""
    cxx = cpu_kernels.required_compiler()
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        raise cpu_kernels.KernelUnavailable("no Python headers (Python.h) to build against")
    flags, libraries = _build_flags()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256("\0".join((SOURCE, cxx, *flags, *libraries, torch.__version__, torch.version.git_version, sys.version,
                                   suffix))
                         .encode()).hexdigest()[:24]
    path = os.path.join(cpu_kernels.cache_dir(), f"same_memory_{key}{suffix}")
    return cpu_kernels.load_built(_import, cxx, SOURCE, path, flags, libraries)


def _import(path: str):
    loader = importlib.machinery.ExtensionFileLoader("fastoptim_same_memory", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def all_set_to(a: list | tuple, b: list | tuple, grads: bool = False) -> bool:
    """``len(a) == len(b)`` and each ``a[i]`` (its ``.grad`` where ``grads``) is ``set_to(b[i])``."""
    global native_calls
    module = _loaded()[0]
    if module is not None:
        native_calls += 1
        return module.all_set_to(a, b, grads)
    if grads:
        a = [getattr(x, "grad", None) for x in a]
    return len(a) == len(b) and all(map(set_to, a, b))


def set_to(x, y) -> bool:
    """Whether ``x`` lies on ``y``'s memory exactly as ``y`` does (``is_set_to``: the same storage, offset,
    sizes and strides) with ``y``'s dtype, both read as they lie. False where either is no tensor, or one whose
    values are not its memory as it lies (not strided, a lazy negation or conjugation, a zero tensor, a meta tensor, a
    Python subclass that answers for itself)."""
    return isinstance(x, Tensor) and isinstance(y, Tensor) and _plain(x) and _plain(y) and x.dtype == y.dtype \
        and x.is_set_to(y)


def _plain(t: Tensor) -> bool:
    return not (t.is_conj() or t.is_neg() or t._is_zerotensor() or t.is_meta or t.layout != torch.strided
                or torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python))
