// CUDA fixed-point kernel (semantics: fixed_point.h). Torch-free, so it compile-checks with a bare
// nvcc. Inputs laid out as the outputs (one dense run) take a unit-stride grid-stride loop; any
// other layout computes each element's offsets from its linear index. A block that met an overflow
// stores true to the flag (every such store writes the same value: no atomics needed).
#include <algorithm>

#include "fixed_point_cuda.h"

namespace revkernels {
namespace {

constexpr int kThreads = 256;

template <FixedPointOp op, typename f_t, typename view_t, bool kDense>
__global__ void fixed_point_kernel(int64_t* __restrict__ out, view_t* __restrict__ view,
                                   const int64_t* __restrict__ x, const f_t* __restrict__ f, FixedPointScales s,
                                   bool* __restrict__ flag, CouplingLayout layout, int64_t numel) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  bool bad = false;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += step) {
    int64_t a_off = i, b_off = i;
    if constexpr (!kDense) layout_offsets(layout, i, a_off, b_off);
    bad |= fixed_point_element<op>(op == FixedPointOp::View ? nullptr : out + i, view + i,
                                   op == FixedPointOp::FromFloat ? nullptr : x + a_off,
                                   op == FixedPointOp::View ? nullptr : f + b_off, s);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = true;
}

}  // namespace

cudaError_t fixed_point_cuda(FixedPointOp op, ScalarKind f_kind, ScalarKind view_kind, int64_t* out, void* view,
                             const int64_t* x, const void* f, int bits, bool* flag, const CouplingLayout& layout,
                             int64_t numel, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  // Enough blocks to fill the device several times over; the grid-stride loop covers the rest.
  const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, 65536);
  const FixedPointScales s = fixed_point_scales(bits);
  const bool dense = is_one_dense_run(layout);
  return dispatch_fixed_point(op, f_kind, view_kind, [&](auto op_tag, auto f_tag, auto view_tag) {
    constexpr FixedPointOp kOp = decltype(op_tag)::value;
    using f_t = typename decltype(f_tag)::type;
    using view_t = typename decltype(view_tag)::type;
    auto* v = static_cast<view_t*>(view);
    const auto* pf = static_cast<const f_t*>(f);
    if (dense) {
      fixed_point_kernel<kOp, f_t, view_t, true><<<blocks, kThreads, 0, stream>>>(out, v, x, pf, s, flag, layout, numel);
    } else {
      fixed_point_kernel<kOp, f_t, view_t, false><<<blocks, kThreads, 0, stream>>>(out, v, x, pf, s, flag, layout, numel);
    }
    return cudaGetLastError();
  });
}

}  // namespace revkernels
