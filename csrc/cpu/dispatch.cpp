// Picks the vectorised CPU kernels (vec_kernels.h) for this CPU at run time, as ATen picks its own.
// REVKERNELS_CPU_ISA_VARIANTS: the build linked the AVX2 and AVX512 objects (x86-64, GCC).
#include <ATen/Version.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <string>

#include "vec_kernels.h"

namespace revkernels {
namespace DEFAULT { extern const CpuKernels kCpuKernels; }
#if defined(REVKERNELS_CPU_ISA_VARIANTS)
namespace AVX2 { extern const CpuKernels kCpuKernels; }
namespace AVX512 { extern const CpuKernels kCpuKernels; }
namespace AVX512_BF16 { extern const CpuKernels kCpuKernels; }
#endif

namespace {

// Whether this CPU runs the code of `isa` (the flags vec_kernels_<isa>.cpp enable).
bool cpu_supports(CpuIsa isa) {
#if defined(REVKERNELS_CPU_ISA_VARIANTS)
  switch (isa) {
    case CpuIsa::Avx512Bf16:
      return __builtin_cpu_supports("avx512bf16") && cpu_supports(CpuIsa::Avx512);
    case CpuIsa::Avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && cpu_supports(CpuIsa::Avx2);
    case CpuIsa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
    case CpuIsa::Default:
      break;
  }
#endif
  return isa == CpuIsa::Default;
}

}  // namespace

const CpuKernels* cpu_kernels_for(CpuIsa isa) {
  if (!cpu_supports(isa)) return nullptr;
  switch (isa) {
#if defined(REVKERNELS_CPU_ISA_VARIANTS)
    case CpuIsa::Avx512Bf16: return &AVX512_BF16::kCpuKernels;
    case CpuIsa::Avx512: return &AVX512::kCpuKernels;
    case CpuIsa::Avx2: return &AVX2::kCpuKernels;
#endif
    case CpuIsa::Default: return &DEFAULT::kCpuKernels;
    default: return nullptr;
  }
}

std::vector<const CpuKernels*> compiled_cpu_kernels() {
#if defined(REVKERNELS_CPU_ISA_VARIANTS)
  return {&DEFAULT::kCpuKernels, &AVX2::kCpuKernels, &AVX512::kCpuKernels, &AVX512_BF16::kCpuKernels};
#else
  return {&DEFAULT::kCpuKernels};
#endif
}

const CpuKernels& cpu_kernels() {
  static const CpuKernels* const chosen = [] {
    // "AVX512", "AVX2" or "DEFAULT" (ATEN_CPU_CAPABILITY=default|avx2|avx512 lowers it).
    const std::string aten = at::get_cpu_capability();
    const CpuKernels* kernels = nullptr;
    if (aten == "AVX512") {  // with the bf16 conversion instructions where the CPU has them
      kernels = cpu_kernels_for(CpuIsa::Avx512Bf16);
      if (kernels == nullptr) kernels = cpu_kernels_for(CpuIsa::Avx512);
    }
    if (kernels == nullptr && (aten == "AVX512" || aten == "AVX2")) kernels = cpu_kernels_for(CpuIsa::Avx2);
    return kernels != nullptr ? kernels : cpu_kernels_for(CpuIsa::Default);
  }();
  return *chosen;
}

int64_t last_level_cache_bytes() {
  static const int64_t bytes = [] {
    int64_t best_level = 0, best_bytes = 0;
    for (int index = 0;; ++index) {
      const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
      std::ifstream level_file(dir + "level"), type_file(dir + "type"), size_file(dir + "size");
      int64_t level = 0, size = 0;
      std::string type, unit;
      if (!(level_file >> level) || !(type_file >> type) || !(size_file >> size)) break;
      size_file >> unit;  // "32768K": sizes are given in KiB (or MiB)
      size *= unit == "M" ? int64_t(1) << 20 : unit == "K" ? int64_t(1) << 10 : 1;
      if (type != "Instruction" && level > best_level) best_level = level, best_bytes = size;
    }
    return best_bytes;
  }();
  return bytes;
}

int64_t stream_above_bytes() {
  static const int64_t bytes = [] {
    const char* text = std::getenv("REVKERNELS_STREAM_ABOVE_BYTES");
    if (text == nullptr || *text == '\0') return last_level_cache_bytes();
    char* end = nullptr;
    errno = 0;
    const long long value = std::strtoll(text, &end, 10);
    TORCH_CHECK_VALUE(errno == 0 && *end == '\0' && value >= 0,
                      "REVKERNELS_STREAM_ABOVE_BYTES must be a non-negative integer (bytes; 0: never stream), got '",
                      text, "'");
    return static_cast<int64_t>(value);
  }();
  return bytes;
}

bool stream_outputs(int64_t bytes) {
  const int64_t threshold = stream_above_bytes();
  return threshold > 0 && bytes > threshold;
}

}  // namespace revkernels
