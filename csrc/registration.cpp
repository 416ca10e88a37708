// The revkernels op library and the `revkernels._C` Python module that loads it. Each op family
// defines its schemas in csrc/ops/<family>.cpp (TORCH_LIBRARY_FRAGMENT) and its device kernels in
// csrc/ops/<family>_cpu.cpp and <family>_cuda.cpp.
#include <Python.h>
#include <torch/library.h>

#include "cpu/vec_kernels.h"

namespace {

// _C.cpu_kernel_build(): the name of the CPU kernel build the ops run ("DEFAULT", "AVX2", "AVX512"
// or "AVX512_BF16"; picked once per process, see cpu/dispatch.cpp).
PyObject* cpu_kernel_build(PyObject*, PyObject*) { return PyUnicode_FromString(revkernels::cpu_kernels().name); }

// _C.cpu_kernel_builds(): the names of the CPU kernel builds compiled into this library, whether or
// not this CPU runs them (the ISA builds exist on x86-64 with GCC, see setup.py).
PyObject* cpu_kernel_builds(PyObject*, PyObject*) {
  const auto builds = revkernels::compiled_cpu_kernels();
  PyObject* names = PyTuple_New(static_cast<Py_ssize_t>(builds.size()));
  if (names == nullptr) return nullptr;
  for (size_t i = 0; i < builds.size(); ++i) {
    PyObject* name = PyUnicode_FromString(builds[i]->name);
    if (name == nullptr) {
      Py_DECREF(names);
      return nullptr;
    }
    PyTuple_SET_ITEM(names, static_cast<Py_ssize_t>(i), name);
  }
  return names;
}

// _C.last_level_cache_bytes(): the CPU's last-level cache (0 where unknown), by default the size
// above which the streaming ops write their outputs with non-temporal stores (cpu/vec_kernels.h).
PyObject* last_level_cache_bytes(PyObject*, PyObject*) { return PyLong_FromLongLong(revkernels::last_level_cache_bytes()); }

// _C.stream_above_bytes(): the size above which those ops stream (REVKERNELS_STREAM_ABOVE_BYTES or
// the last-level cache; 0: never). A bad value of the variable raises ValueError.
PyObject* stream_above_bytes(PyObject*, PyObject*) {
  try {
    return PyLong_FromLongLong(revkernels::stream_above_bytes());
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
}

PyMethodDef methods[] = {
    {"cpu_kernel_build", cpu_kernel_build, METH_NOARGS, "The CPU kernel build the ops run."},
    {"cpu_kernel_builds", cpu_kernel_builds, METH_NOARGS, "The CPU kernel builds compiled into the library."},
    {"last_level_cache_bytes", last_level_cache_bytes, METH_NOARGS,
     "The CPU's last-level cache in bytes (0: unknown)."},
    {"stream_above_bytes", stream_above_bytes, METH_NOARGS,
     "The call size in bytes above which the CPU ops stream their outputs (0: never)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" {
// Importing revkernels._C runs the static registrations (the ops); the module holds cpu_kernel_build.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(revkernels, m) {}
