// Torch-free launchers of the CUDA bias + GELU kernels (bias_gelu.cu); math and layouts as in
// bias_gelu.h: x (and dy) `rows` rows of `n` elements with unit column stride and any row stride,
// out / dx contiguous, bias / dbias n contiguous elements.
#pragma once

#include <cuda_runtime_api.h>

#include "bias_gelu.h"

namespace revkernels {

// out = gelu(x + bias). `x_kind` is the dtype of x and out, `bias_kind` that of bias.
cudaError_t bias_gelu_cuda(ScalarKind x_kind, ScalarKind bias_kind, GeluApprox approx, void* out, const void* x,
                           int64_t x_row_stride, const void* bias, int64_t rows, int64_t n, cudaStream_t stream);

// Bytes of scratch bias_gelu_bwd_cuda needs for its per-block dbias partial sums (0 when rows or
// n is 0). Depends on the shape and dtypes only.
int64_t bias_gelu_bwd_cuda_workspace_bytes(ScalarKind x_kind, ScalarKind bias_kind, int64_t rows, int64_t n);

// dx = dy * gelu'(x + bias) and dbias = column sums of dx (accumulated in float, double when x or
// bias is double). `x_kind` is the dtype of dy, x and dx; `bias_kind` that of bias and dbias.
// `workspace` holds bias_gelu_bwd_cuda_workspace_bytes(...) bytes, aligned for double. Two
// launches: dx with per-block partial sums, then their reduction (in a fixed order: the result
// does not depend on scheduling). With rows == 0, dbias is zeroed.
cudaError_t bias_gelu_bwd_cuda(ScalarKind x_kind, ScalarKind bias_kind, GeluApprox approx, void* dx, void* dbias,
                               const void* dy, int64_t dy_row_stride, const void* x, int64_t x_row_stride,
                               const void* bias, int64_t rows, int64_t n, void* workspace, cudaStream_t stream);

}  // namespace revkernels
