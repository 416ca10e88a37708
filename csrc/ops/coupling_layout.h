// ATen glue shared by the CPU and CUDA bindings of the coupling ops: argument checks and the
// iteration layout handed to the torch-free kernels.
#pragma once

#include <ATen/ATen.h>

#include "../kernels/coupling.h"

namespace revkernels {

// TypeError naming `name` unless `t` is defined (a None passed for a Tensor argument arrives undefined).
void check_defined(const at::Tensor& t, const char* name);

// `dtype` as the kernels name it; TypeError naming `name` unless it is a float dtype they take.
ScalarKind scalar_kind(at::ScalarType dtype, const char* name);

// The dtype of `t`; TypeError naming `name` unless it is defined and a float dtype the kernels take.
ScalarKind scalar_kind(const at::Tensor& t, const char* name);

// `t`, or a copy of it where its data pointer is not a multiple of its element size (torch allows
// that: torch.frombuffer over a byte buffer at an odd offset, a numpy array over an unaligned
// buffer). The CPU kernels access elements through typed pointers, which C++ requires aligned to
// their type, so every tensor the glue hands them passes through here. The copy keeps t's strides
// where t is dense (clone's preserve_format).
at::Tensor element_aligned(const at::Tensor& t);

// A 1-d parameter or statistic (weight, bias, mean, rstd) as the CPU kernels read it: in the
// accumulation type `acc_dtype`, contiguous and element-aligned (t itself where it already is all three).
at::Tensor acc_vector(const at::Tensor& t, at::ScalarType acc_dtype);

// ValueError naming `b_name` and `a_name` unless `b` has the shape and the device of `a`.
void check_same_shape_and_device(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name);

// Checks the arguments of out = a + alpha * b: float dtypes, same shape and device.
void check_coupling_args(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name);

// The layout of `a` and `b` in the memory order of the dense `out`, with size-1 dims dropped
// and mergeable dims coalesced. Returns false when more than kMaxDims dims remain.
bool make_coupling_layout(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                          CouplingLayout* layout);

}  // namespace revkernels
