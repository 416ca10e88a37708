// Torch-free launcher of the CUDA coupling kernel (coupling.cu): out = a + alpha * b.
#pragma once

#include <cuda_runtime_api.h>

#include "coupling.h"

namespace revkernels {

// `out_kind` is the dtype of `out` and `a`; `b_kind` that of `b`. Returns the launch status.
cudaError_t coupling_axpy_cuda(ScalarKind out_kind, ScalarKind b_kind, void* out, const void* a,
                               const void* b, double alpha, const CouplingLayout& layout,
                               int64_t numel, cudaStream_t stream);

}  // namespace revkernels
