// Torch-free launcher of the CUDA BatchNorm (+ ReLU) apply kernel (batch_norm.cu); math as in
// batch_norm.h. x and out are dense tensors of one layout, NCHW-contiguous ((N, C, S) in memory
// order) or channels_last ((N, S, C) in memory order); mean, rstd, weight and bias are C contiguous
// values of the accumulation type (float, double for double data).
#pragma once

#include <cuda_runtime_api.h>

#include "scalar.h"

namespace revkernels {

// out = act((x - mean_c) * rstd_c * weight_c + bias_c) over `total` elements, act = ReLU when
// `relu`; c of element e is (e / s) % c for NCHW, e % c for channels_last.
cudaError_t batch_norm_act_apply_cuda(ScalarKind x_kind, void* out, const void* x, const void* mean, const void* rstd,
                                      const void* weight, const void* bias, int64_t total, int64_t c, int64_t s,
                                      bool channels_last, bool relu, cudaStream_t stream);

}  // namespace revkernels
