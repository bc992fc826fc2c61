// fastoptim_bulk: a step's per-tensor bookkeeping over a whole list of tensors in one call (see bulk.py), a CPython
// extension built against the installed torch's headers by native.load.
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

// layouts(tensors, shaped): the bytes of each tensor's data address (Tensor.data_ptr), and for the first shaped
// tensors also its dim, sizes and strides; equal bytes: every tensor lies where (and those as) it did
static PyObject* layouts(PyObject*, PyObject* args) {
    PyObject* seq;
    Py_ssize_t shaped;
    if (!PyArg_ParseTuple(args, "On", &seq, &shaped) || !sequence(seq, "layouts") || !all_tensors(seq, "layouts"))
        return nullptr;
    try {
        const std::vector<c10::TensorImpl*> x = impls(seq);
        std::vector<int64_t> out;
        out.reserve(x.size() + static_cast<size_t>(std::max<Py_ssize_t>(shaped, 0)) * 9);
        for (size_t i = 0; i < x.size(); ++i) {
            if (i + AHEAD < x.size()) prefetch(x[i + AHEAD], 4);
            const c10::TensorImpl* t = x[i];
            const char* data = t->has_storage() && !t->is_empty() ? static_cast<const char*>(t->storage().data()) +
                                                                      t->storage_offset() * t->itemsize() : nullptr;
            out.push_back(reinterpret_cast<int64_t>(data));
            if (static_cast<Py_ssize_t>(i) >= shaped) continue;
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

// kinds(tensors): each tensor's dtype (c10::ScalarType), whether it is contiguous, its dim and sizes; equal results:
// every tensor is of the dtype, contiguity and shape it was
static PyObject* kinds(PyObject*, PyObject* seq) {
    if (!sequence(seq, "kinds") || !all_tensors(seq, "kinds")) return nullptr;
    try {
        const std::vector<c10::TensorImpl*> x = impls(seq);
        std::vector<int64_t> out;
        out.reserve(x.size() * 5);
        for (size_t i = 0; i < x.size(); ++i) {
            if (i + AHEAD < x.size()) prefetch(x[i + AHEAD], 4);
            out.push_back(static_cast<int64_t>(c10::typeMetaToScalarType(x[i]->dtype())));
            out.push_back(x[i]->is_contiguous() ? 1 : 0);
            out.push_back(x[i]->dim());
            for (int64_t d : x[i]->sizes()) out.push_back(d);
        }
        return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
}

// with_grads(params, parameter_type): ([p for p in params if p.grad is not None], [their grads], whether every
// such grad is strided, of its param's dtype and not a lazily negated view, whether every one is also contiguous
// and of its param's sizes); None where an item is not exactly a Tensor or a parameter_type (a subclass may answer
// .grad by itself)
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
        bool plain = true, dense = true;
        for (Py_ssize_t i = 0; i < n && params && grads; ++i) {
            if (!g[i]) continue;
            const at::TensorBase& grad = THPVariable_Unpack(items[i]).grad();
            plain = plain && g[i]->layout() == c10::kStrided && g[i]->dtype() == x[i]->dtype() && !g[i]->is_neg();
            dense = dense && plain && g[i]->is_contiguous() && g[i]->sizes() == x[i]->sizes();
            PyObject* wrapped = THPVariable_Wrap(grad);
            if (!wrapped || PyList_Append(params, items[i]) || PyList_Append(grads, wrapped)) Py_CLEAR(params);
            Py_XDECREF(wrapped);
        }
        if (!params || !grads) {
            Py_XDECREF(params);
            Py_XDECREF(grads);
            return nullptr;
        }
        return Py_BuildValue("(NNOO)", params, grads, plain ? Py_True : Py_False, dense ? Py_True : Py_False);
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
}

static PyMethodDef methods[] = {{"all_set_to", all_set_to, METH_VARARGS, nullptr},
                                {"with_grads", with_grads, METH_VARARGS, nullptr},
                                {"layouts", layouts, METH_VARARGS, nullptr},
                                {"kinds", kinds, METH_O, nullptr},
                                {"bump_versions", bump_versions, METH_O, nullptr},
                                {"set_each", set_each, METH_VARARGS, nullptr},
                                {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastoptim_bulk", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_fastoptim_bulk() { return PyModule_Create(&module); }
