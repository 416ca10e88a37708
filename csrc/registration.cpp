// Schemas of the revkernels op library and the `revkernels._C` Python module that loads it.
// Device implementations register themselves in ops/*_cpu.cpp and ops/*_cuda.cpp.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Importing revkernels._C runs the static registrations below; the module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(revkernels, m) {
  // x = y - f in y's dtype (the coupling rebuild); f may have another float dtype.
  m.def("coupling_sub(Tensor y, Tensor f) -> Tensor");
  // a + b in a's dtype (the coupling gradient add dx = dy + vjp); b may have another float dtype.
  m.def("coupling_add(Tensor a, Tensor b) -> Tensor");
}
