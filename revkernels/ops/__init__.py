"""torch.library ops of revkernels, one module per op family.

Each op has a schema in `csrc/ops/<family>.cpp` (or, without the compiled library, one defined
in Python), a C++ CPU kernel, Triton and (for elementwise ops) CUDA C++ kernels, a fake (meta)
implementation, an autograd formula and a pure-PyTorch reference that the tests compare against.
How an op reaches its kernel: `_library.py`.

    coupling_sub, coupling_add          the coupling's rebuild and gradient add (coupling.py)
    sub_layer_norm, layer_norm_bwd_add  rebuild + LayerNorm; LayerNorm backward + residual add
    bias_gelu, bias_gelu_bwd            bias + GELU and its backward with the bias-grad reduction
    linear_sub                          the GEMM-side rebuild y - (a @ W^T + b) as one GEMM
    batch_norm_act, batch_norm_act_bwd  training-mode BatchNorm (+ ReLU) and its backward
    fixed_point_from_float, fixed_point_add, fixed_point_sub, fixed_point_view
                                        exact mode's int64 streams: round onto the grid 2^-bits, the
                                        integer coupling and its rebuild with an overflow flag, the
                                        float view (fixed_point.py)
"""
from revkernels.ops._library import get_cuda_backend, set_cuda_backend
from revkernels.ops.batch_norm import (batch_norm_act, batch_norm_act_bwd, batch_norm_act_bwd_reference,
                                       batch_norm_act_reference)
from revkernels.ops.bias_gelu import bias_gelu, bias_gelu_bwd, bias_gelu_bwd_reference, bias_gelu_reference
from revkernels.ops.coupling import coupling_add, coupling_add_reference, coupling_sub, coupling_sub_reference
from revkernels.ops.fixed_point import (fixed_point_add, fixed_point_add_reference, fixed_point_from_float,
                                        fixed_point_from_float_reference, fixed_point_sub, fixed_point_sub_reference,
                                        fixed_point_view, fixed_point_view_reference)
from revkernels.ops.layer_norm import (layer_norm_bwd_add, layer_norm_bwd_add_reference, sub_layer_norm,
                                       sub_layer_norm_reference)
from revkernels.ops.linear_sub import linear_sub, linear_sub_reference

__all__ = [
    "coupling_sub", "coupling_add", "coupling_sub_reference", "coupling_add_reference",
    "sub_layer_norm", "layer_norm_bwd_add", "sub_layer_norm_reference", "layer_norm_bwd_add_reference",
    "bias_gelu", "bias_gelu_bwd", "bias_gelu_reference", "bias_gelu_bwd_reference",
    "linear_sub", "linear_sub_reference",
    "batch_norm_act", "batch_norm_act_bwd", "batch_norm_act_reference", "batch_norm_act_bwd_reference",
    "fixed_point_from_float", "fixed_point_add", "fixed_point_sub", "fixed_point_view",
    "fixed_point_from_float_reference", "fixed_point_add_reference", "fixed_point_sub_reference",
    "fixed_point_view_reference",
    "set_cuda_backend", "get_cuda_backend",
]
