// Schemas of the coupling ops (math and semantics: revkernels/ops/coupling.py).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(revkernels, m) {
  // x = y - f in y's dtype (the coupling rebuild); f may have another float dtype.
  m.def("coupling_sub(Tensor y, Tensor f) -> Tensor");
  // a + b in a's dtype (the coupling gradient add dx = dy + vjp); b may have another float dtype.
  m.def("coupling_add(Tensor a, Tensor b) -> Tensor");
}
