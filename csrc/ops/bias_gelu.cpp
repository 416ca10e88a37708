// Schemas of the bias + GELU ops (math and semantics: revkernels/ops/bias_gelu.py).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(revkernels, m) {
  // gelu(x + bias) in x's dtype, x (..., N), bias (N,); approximate "none" (erf) or "tanh".
  m.def("bias_gelu(Tensor x, Tensor bias, str approximate=\"none\") -> Tensor");
  // dx = dy * gelu'(x + bias) in x's dtype, dbias = dx summed over all rows in bias's dtype.
  m.def("bias_gelu_bwd(Tensor dy, Tensor x, Tensor bias, str approximate=\"none\") -> (Tensor dx, Tensor dbias)");
}
