// Schemas of the LayerNorm ops with the coupling fused in (math and semantics:
// revkernels/ops/layer_norm.py).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(revkernels, m) {
  // x = y - g in y's dtype (the coupling rebuild), then ln = LayerNorm(x) * weight + bias over the
  // last dim, computed from the rounded x; mean and rstd per row (shape y.shape[:-1]).
  m.def("sub_layer_norm(Tensor y, Tensor g, Tensor weight, Tensor bias, float eps=1e-05) "
        "-> (Tensor x, Tensor ln, Tensor mean, Tensor rstd)");
  // LayerNorm backward with the residual-gradient add: dx = dres + LN_bwd(dln) in dres's dtype;
  // dweight, dbias (sums over rows, in fp32 or fp64) in weight's dtype.
  m.def("layer_norm_bwd_add(Tensor dln, Tensor x, Tensor weight, Tensor mean, Tensor rstd, Tensor dres) "
        "-> (Tensor dx, Tensor dweight, Tensor dbias)");
}
