// Schemas of the training-mode BatchNorm (+ ReLU) ops (math and semantics:
// revkernels/ops/batch_norm.py).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(revkernels, m) {
  // out = act(BatchNorm(x) * weight + bias) with batch statistics per channel (dim 1), act = ReLU
  // when relu; mean and rstd (shape (C,), fp32 or fp64) as computed from x.
  m.def("batch_norm_act(Tensor x, Tensor weight, Tensor bias, float eps=1e-05, bool relu=True) "
        "-> (Tensor out, Tensor mean, Tensor rstd)");
  // Its VJP: dx in x's dtype; dweight, dbias (channel sums, in fp32 or fp64) in weight's and bias's dtype.
  m.def("batch_norm_act_bwd(Tensor dout, Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor rstd, "
        "bool relu=True) -> (Tensor dx, Tensor dweight, Tensor dbias)");
}
