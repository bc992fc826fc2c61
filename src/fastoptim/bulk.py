"""A step's per-tensor bookkeeping over thousands of tensors, each in one C++ pass.

Every step: flat mode checks that each param is still its view of the flat buffer and each ``.grad`` its view
of the grad buffer (``all_set_to``), and other plans that each param lies where and as it did (``layouts``): a
cache must never outlive what it caches; the params with grads are collected (``with_grads``); every level
counts the step as an in-place write to each param (``bump_versions``); and each param's state dict gets the
new ``step`` (``set_each``). From Python each is 0.1-1.2 us a tensor with the caches cold after the step:
milliseconds a step for the 4000 tensors of a 2000-layer MLP, as long as the 8-bit step's own work. Here each
is one call over the whole list (15-90 ns a tensor, the cache misses of many tensors overlapped by
prefetching): a small CPython extension built against the installed torch's headers at first use, cached
beside the CPU kernels (its name carries the torch and Python versions it was built for). Where it cannot be
built (no compiler, no Python headers) Python loops give the same results.
"""

from __future__ import annotations

import hashlib
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

from .levels import cpu_kernels

SOURCE = r"""
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
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

// the TensorImpl of each item of a list or tuple; null where not a tensor
static std::vector<c10::TensorImpl*> impls(PyObject* seq) {
    const size_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    std::vector<c10::TensorImpl*> out(n);
    for (size_t i = 0; i < n; ++i) {
        if (i + AHEAD < n) prefetch(items[i + AHEAD], 1);
        out[i] = is_tensor(items[i]) ? THPVariable_Unpack(items[i]).unsafeGetTensorImpl() : nullptr;
    }
    return out;
}

// the TensorImpl of each tensor's .grad; null where no tensor or no grad
static std::vector<c10::TensorImpl*> grad_impls(const std::vector<c10::TensorImpl*>& tensors) {
    const size_t n = tensors.size();
    std::vector<c10::AutogradMetaInterface*> meta(n);
    for (size_t i = 0; i < n; ++i) {
        if (i + AHEAD < n && tensors[i + AHEAD]) prefetch(tensors[i + AHEAD], 4);
        meta[i] = tensors[i] ? tensors[i]->autograd_meta() : nullptr;
    }
    std::vector<c10::TensorImpl*> out(n);
    for (size_t i = 0; i < n; ++i) {
        if (i + AHEAD < n && meta[i + AHEAD]) prefetch(meta[i + AHEAD], 2);
        const at::TensorBase* grad = meta[i] ? &meta[i]->grad() : nullptr;
        out[i] = grad && grad->defined() ? grad->unsafeGetTensorImpl() : nullptr;
    }
    return out;
}

static bool sequence(PyObject* x, const char* what) {
    if (PyList_Check(x) || PyTuple_Check(x)) return true;
    PyErr_Format(PyExc_TypeError, "%s takes a list or tuple, not %s", what, Py_TYPE(x)->tp_name);
    return false;
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
    if (!PyArg_ParseTuple(args, "OOp", &a, &b, &grads) || !sequence(a, "all_set_to") || !sequence(b, "all_set_to"))
        return nullptr;
    if (PySequence_Fast_GET_SIZE(a) != PySequence_Fast_GET_SIZE(b)) Py_RETURN_FALSE;
    try {  // a tensor whose storage or sizes cannot be read here (sparse, symbolic, a subclass's own): False
        const std::vector<c10::TensorImpl*> x = grads ? grad_impls(impls(a)) : impls(a), y = impls(b);
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

static bool all_tensors(PyObject* seq, const char* what) {
    PyObject** items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i)
        if (!is_tensor(items[i])) {
            PyErr_Format(PyExc_TypeError, "%s: item %zd is %s, not a tensor", what, i, Py_TYPE(items[i])->tp_name);
            return false;
        }
    return true;
}

// bump_versions(tensors): torch._C._increment_version's count (not for inference tensors, which have none)
static PyObject* bump_versions(PyObject*, PyObject* seq) {
    if (!sequence(seq, "bump_versions") || !all_tensors(seq, "bump_versions")) return nullptr;
    const size_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    try {
        const std::vector<c10::TensorImpl*> x = impls(seq);
        for (size_t i = 0; i < n; ++i) {
            if (i + AHEAD < n) prefetch(x[i + AHEAD], 4);
            const at::Tensor& t = THPVariable_Unpack(items[i]);
            if (!t.is_inference()) torch::autograd::impl::bump_version(t);  // what torch._C._increment_version does
        }
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
    Py_RETURN_NONE;
}

// set_each(dicts, key, value): dict.__setitem__(d, key, value) for each d (a dict subclass's own __setitem__ is
// not called)
static PyObject* set_each(PyObject*, PyObject* args) {
    PyObject *seq, *key, *value;
    if (!PyArg_ParseTuple(args, "OOO", &seq, &key, &value) || !sequence(seq, "set_each")) return nullptr;
    const size_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    for (size_t i = 0; i < n; ++i)
        if (!PyDict_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "set_each: item %zu is %s, not a dict", i, Py_TYPE(items[i])->tp_name);
            return nullptr;
        }
    for (size_t i = 0; i < n; ++i) {
        if (i + AHEAD < n) prefetch(items[i + AHEAD], 1);
        if (i + AHEAD / 2 < n) prefetch(reinterpret_cast<PyDictObject*>(items[i + AHEAD / 2])->ma_keys, 2);
        if (PyDict_SetItem(items[i], key, value)) return nullptr;  // an unhashable key: its TypeError
    }
    Py_RETURN_NONE;
}

// layouts(tensors, shapes): the bytes of each tensor's data address (Tensor.data_ptr), and where shapes its dim,
// sizes and strides; equal bytes: every tensor lies where and as it did
static PyObject* layouts(PyObject*, PyObject* args) {
    PyObject* seq;
    int shapes;
    if (!PyArg_ParseTuple(args, "Op", &seq, &shapes) || !sequence(seq, "layouts") || !all_tensors(seq, "layouts"))
        return nullptr;
    try {
        const std::vector<c10::TensorImpl*> x = impls(seq);
        std::vector<int64_t> out;
        out.reserve(x.size() * (shapes ? 10 : 1));
        for (size_t i = 0; i < x.size(); ++i) {
            if (i + AHEAD < x.size()) prefetch(x[i + AHEAD], 4);
            const c10::TensorImpl* t = x[i];
            const char* data = t->has_storage() && !t->is_empty() ? static_cast<const char*>(t->storage().data()) +
                                                                      t->storage_offset() * t->itemsize() : nullptr;
            out.push_back(reinterpret_cast<int64_t>(data));
            if (!shapes) continue;
            out.push_back(t->dim());
            for (int64_t d : t->sizes()) out.push_back(d);
            for (int64_t d : t->strides()) out.push_back(d);
        }
        return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
}

// with_grads(params, parameter_type): ([p for p in params if p.grad is not None], [their grads], whether every
// such grad is strided and of its param's dtype); None where an item is not exactly a Tensor or a
// parameter_type (a subclass may answer .grad by itself)
static PyObject* with_grads(PyObject*, PyObject* args) {
    PyObject *seq, *parameter_type;
    if (!PyArg_ParseTuple(args, "OO", &seq, &parameter_type) || !sequence(seq, "with_grads")) return nullptr;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; ++i)
        if (!THPVariable_CheckExact(items[i]) && Py_TYPE(items[i]) != reinterpret_cast<PyTypeObject*>(parameter_type))
            Py_RETURN_NONE;
    try {
        const std::vector<c10::TensorImpl*> x = impls(seq), g = grad_impls(x);
        PyObject *params = PyList_New(0), *grads = PyList_New(0);
        bool plain = true;
        for (Py_ssize_t i = 0; i < n && params && grads; ++i) {
            if (!g[i]) continue;
            const at::TensorBase& grad = THPVariable_Unpack(items[i]).grad();
            plain = plain && g[i]->layout() == c10::kStrided && g[i]->dtype() == x[i]->dtype();
            PyObject* wrapped = THPVariable_Wrap(grad);
            if (!wrapped || PyList_Append(params, items[i]) || PyList_Append(grads, wrapped)) Py_CLEAR(params);
            Py_XDECREF(wrapped);
        }
        if (!params || !grads) {
            Py_XDECREF(params);
            Py_XDECREF(grads);
            return nullptr;
        }
        return Py_BuildValue("(NNO)", params, grads, plain ? Py_True : Py_False);
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
}

static PyMethodDef methods[] = {{"all_set_to", all_set_to, METH_VARARGS, nullptr},
                                {"with_grads", with_grads, METH_VARARGS, nullptr},
                                {"layouts", layouts, METH_VARARGS, nullptr},
                                {"bump_versions", bump_versions, METH_O, nullptr},
                                {"set_each", set_each, METH_VARARGS, nullptr},
                                {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastoptim_bulk", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_fastoptim_bulk() { return PyModule_Create(&module); }
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
    """The built extension, from the kernel cache folder or built into it (once per machine: about 25 s)."""
    cxx = cpu_kernels.required_compiler()
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        raise cpu_kernels.KernelUnavailable("no Python headers (Python.h) to build against")
    flags, libraries = _build_flags()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    parts = (SOURCE, cxx, *flags, *libraries, torch.__version__, torch.version.git_version, sys.version, suffix)
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
    path = os.path.join(cpu_kernels.cache_dir(), f"bulk_{key}{suffix}")
    return cpu_kernels.load_built(_import, cxx, SOURCE, path, flags, libraries)


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


def with_grads(params: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor], bool]:
    """The params whose ``.grad`` is not None, their grads, and whether every such grad is strided and of its
    param's dtype (where not, the caller looks at each)."""
    native = _native("with_grads")
    found = None if native is None else native(_sequence(params), torch.nn.Parameter)
    if found is not None:
        return found
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    return params, grads, all(g.layout == torch.strided and g.dtype == p.dtype for p, g in zip(params, grads))


def layouts(tensors: Sequence[Tensor], shapes: bool = True) -> object:
    """Where each tensor's data lies (``data_ptr``) and, where ``shapes``, its sizes and strides: equal
    results (of one process) mean every tensor lies where and as it did (``p.data = ...``, ``p.t_()``, a
    resize or ``share_memory_()`` since change it, even at the same address)."""
    native = _native("layouts")
    if native is not None:
        return native(_sequence(tensors), shapes)
    addresses = list(map(Tensor.data_ptr, tensors))
    return list(zip(addresses, map(Tensor.stride, tensors), map(Tensor.size, tensors))) if shapes else addresses


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
