// Torch-free launcher of the CUDA fixed-point kernel (fixed_point.cu; semantics: fixed_point.h).
#pragma once

#include <cuda_runtime_api.h>

#include "fixed_point.h"

namespace revkernels {

// `op` over `numel` elements: out (int64, not for View) and view (`view_kind`; FromFloat: f's
// dtype) dense in the iteration order, x (int64, not for FromFloat) and f (`f_kind`, not for View)
// strided by `layout`'s a and b strides. Sets *flag (a bool the caller zeroed) where an element
// overflowed; never clears it. Returns the launch status.
cudaError_t fixed_point_cuda(FixedPointOp op, ScalarKind f_kind, ScalarKind view_kind, int64_t* out, void* view,
                             const int64_t* x, const void* f, int bits, bool* flag, const CouplingLayout& layout,
                             int64_t numel, cudaStream_t stream);

}  // namespace revkernels
