// Schemas of the fixed-point ops: the exact mode's int64 streams (math and semantics:
// revkernels/ops/fixed_point.py). Outputs (view, stream, overflow): the float view first.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(revkernels, m) {
  // X = round_half_even(x * 2^bits) as int64, its view in x's dtype, and whether a value did not fit.
  m.def("fixed_point_from_float(Tensor x, int bits=32) -> (Tensor, Tensor, Tensor)");
  // Y = X + q(f) (the exact coupling) and its view in `dtype`; f any float dtype.
  m.def("fixed_point_add(Tensor x, Tensor f, int bits=32, ScalarType dtype=float) -> (Tensor, Tensor, Tensor)");
  // X = Y - q(f) (the exact rebuild) and its view in `dtype`.
  m.def("fixed_point_sub(Tensor y, Tensor f, int bits=32, ScalarType dtype=float) -> (Tensor, Tensor, Tensor)");
  // view(X) = dtype(float(X) * 2^-bits) (double(X) for a float64 view).
  m.def("fixed_point_view(Tensor x, int bits=32, ScalarType dtype=float) -> Tensor");
}
