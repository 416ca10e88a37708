// The revkernels op library and the `revkernels._C` Python module that loads it. Each op family
// defines its schemas in csrc/ops/<family>.cpp (TORCH_LIBRARY_FRAGMENT) and its device kernels in
// csrc/ops/<family>_cpu.cpp and <family>_cuda.cpp.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Importing revkernels._C runs the static registrations; the module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(revkernels, m) {}
