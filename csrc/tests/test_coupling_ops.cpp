// Unit test of the registered CPU ops revkernels::coupling_sub / coupling_add, called through the
// dispatcher as Python would, against ATen: (a.to(acc) -/+ b.to(acc)).to(a.dtype()) with acc =
// double when either input is double, float otherwise. Results must match bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <vector>

#include "tests/check.h"

namespace {

using BinaryOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)>;

// Fails (rather than throws) when the op library's static registrations did not run, e.g. because
// the linker dropped the library.
std::optional<BinaryOp> find_op(const char* name) {
  try {
    const c10::OperatorHandle handle = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
    RK_CHECK(handle.hasKernelForDispatchKey(c10::DispatchKey::CPU), "%s has no CPU kernel", name);
    return handle.typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  } catch (const c10::Error& e) {
    RK_CHECK(false, "%s is not registered: %s", name, e.what_without_backtrace());
    return std::nullopt;
  }
}

at::Tensor reference(const at::Tensor& a, const at::Tensor& b, double alpha) {
  const bool any_double = a.scalar_type() == at::kDouble || b.scalar_type() == at::kDouble;
  const at::ScalarType acc = any_double ? at::kDouble : at::kFloat;
  const at::Tensor sum = alpha < 0 ? a.to(acc) - b.to(acc) : a.to(acc) + b.to(acc);
  return sum.to(a.scalar_type());
}

struct Op {
  const char* name;
  double alpha;
  BinaryOp handle;
};

void check_op(const Op& op, const char* what, const at::Tensor& a, const at::Tensor& b) {
  const std::string desc = c10::str(op.name, ", ", what, ": a ", a.scalar_type(), a.sizes(), " strides ", a.strides(),
                                    ", b ", b.scalar_type(), b.sizes(), " strides ", b.strides());
  const at::Tensor a_before = a.clone(), b_before = b.clone();
  at::Tensor out;
  try {
    out = op.handle.call(a, b);
  } catch (const c10::Error& e) {
    RK_CHECK(false, "%s: threw %s", desc.c_str(), e.what_without_backtrace());
    return;
  }
  const at::Tensor want = reference(a, b, op.alpha);
  RK_CHECK(out.scalar_type() == a.scalar_type() && out.sizes() == a.sizes(), "%s: got %s%s", desc.c_str(),
           c10::toString(out.scalar_type()), c10::str(out.sizes()).c_str());
  if (out.scalar_type() != want.scalar_type() || out.sizes() != want.sizes()) return;
  const bool same = at::equal(out, want);
  RK_CHECK(same, "%s: max |out - reference| = %g", desc.c_str(),
           same ? 0.0 : (out.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>());
  RK_CHECK(at::equal(a, a_before) && at::equal(b, b_before), "%s: modified an input", desc.c_str());
}

template <typename Error>
void check_throws(const Op& op, const char* what, const at::Tensor& a, const at::Tensor& b) {
  try {
    op.handle.call(a, b);
    RK_CHECK(false, "%s, %s: did not throw", op.name, what);
  } catch (const Error&) {
    RK_CHECK(true, "");
  } catch (const c10::Error& e) {
    RK_CHECK(false, "%s, %s: threw the wrong c10::Error subclass: %s", op.name, what, e.what_without_backtrace());
  }
}

at::Tensor randn(at::IntArrayRef sizes, at::ScalarType dtype = at::kFloat) {
  return at::randn(sizes, at::TensorOptions().dtype(dtype));
}

void check_all(const Op& op) {
  using namespace at;  // kFloat, ...
  check_op(op, "float32", randn({1000}), randn({1000}));
  check_op(op, "bfloat16", randn({64, 33}, kBFloat16), randn({64, 33}, kBFloat16));
  check_op(op, "float16", randn({64, 33}, kHalf), randn({64, 33}, kHalf));
  check_op(op, "float64", randn({5, 7}, kDouble), randn({5, 7}, kDouble));
  check_op(op, "bfloat16 with float32 b", randn({300}, kBFloat16), randn({300}));
  check_op(op, "float32 with float16 b", randn({300}), randn({300}, kHalf));
  check_op(op, "float16 with bfloat16 b", randn({300}, kHalf), randn({300}, kBFloat16));
  check_op(op, "float64 with float32 b", randn({300}, kDouble), randn({300}));
  check_op(op, "float32 with float64 b", randn({300}), randn({300}, kDouble));
  // Large enough for at::parallel_for to split it across threads.
  check_op(op, "transposed a", randn({300, 301}).t(), randn({301, 300}));
  check_op(op, "transposed b", randn({301, 300}, kBFloat16), randn({300, 301}).t());
  check_op(op, "both transposed", randn({40, 50}, kHalf).t(), randn({40, 50}).t());
  check_op(op, "broadcast (expanded) b", randn({33, 64}), randn({1, 64}).expand({33, 64}));
  check_op(op, "non-dense slice a", randn({10, 40}, kBFloat16).slice(1, 0, 40, 2), randn({10, 20}));
  check_op(op, "channels-last a", randn({2, 3, 4, 5}).contiguous(MemoryFormat::ChannelsLast), randn({2, 3, 4, 5}));
  // 13 dims that cannot be merged: more than kMaxDims, the glue densifies first.
  std::vector<int64_t> shape(13, 2), reversed(13);
  for (int d = 0; d < 13; ++d) reversed[d] = 12 - d;
  check_op(op, "13 unmergeable dims", randn(shape), randn(shape, kHalf).permute(reversed));
  check_op(op, "zero-dim", randn({}), randn({}));
  check_op(op, "empty", randn({0, 5}), randn({0, 5}));

  check_throws<c10::ValueError>(op, "shape mismatch", randn({3, 4}), randn({4, 3}));
  check_throws<c10::ValueError>(op, "broadcastable but different shapes", randn({3, 4}), randn({4}));
  check_throws<c10::TypeError>(op, "int32 a", at::ones({4}, at::kInt), randn({4}));
  check_throws<c10::TypeError>(op, "int64 b", randn({4}), at::ones({4}, at::kLong));
}

}  // namespace

int main() {
  at::manual_seed(0);
  at::set_num_threads(4);  // split the parallel_for ranges even on a one-core machine
  const std::optional<BinaryOp> sub = find_op("revkernels::coupling_sub");
  const std::optional<BinaryOp> add = find_op("revkernels::coupling_add");
  if (sub) check_all({"coupling_sub", -1.0, *sub});
  if (add) check_all({"coupling_add", 1.0, *add});
  return rktest::finish("test_coupling_ops");
}
