"""Builds revkernels._C: C++ CPU kernels always; CUDA kernels when torch has CUDA and nvcc exists.

REVKERNELS_BUILD_CUDA=1 forces the CUDA kernels (failing if they cannot be built), =0 skips them.
REVKERNELS_SKIP_EXTENSION=1 installs the pure-PyTorch package without compiling anything.

CPU kernels: csrc/cpu/vec_kernels.cpp is compiled once per instruction set, as ATen compiles its
own (see that file): with the other sources for DEFAULT, and on x86-64 with GCC three times more,
once per entry of ISA_VARIANTS below (AVX2, AVX512, and AVX512 with the CPU's bf16 conversion;
build_ext compiles those objects itself with ninja: an Extension applies one flag set to all its
sources). cpu/dispatch.cpp picks one at run time.
"""
import glob
import os
import platform
import sysconfig

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _env_flag(name):
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if value not in ("0", "1"):
        raise SystemExit(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


# -DCPU_CAPABILITY... selects at::vec's implementation; the -m flags are those of ATen's kernels.
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mbmi", "-mbmi2"]
ISA_VARIANTS = {
    "avx2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2"],
    "avx512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", *_AVX512_FLAGS],
    # The AVX512 build (at::vec's AVX512 vectors) with the CPU's bf16 conversion, in a namespace of its own.
    "avx512_bf16": ["-DCPU_CAPABILITY=AVX512_BF16", "-DCPU_CAPABILITY_AVX512", "-DREVKERNELS_AVX512_BF16",
                    *_AVX512_FLAGS, "-mavx512bf16"],
}
VEC_SOURCE = "csrc/cpu/vec_kernels.cpp"


def _isa_variants():
    """The ISA variants to build: x86-64 with GCC (the flags above are GCC's)."""
    compiler = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or ""
    if platform.machine() not in ("x86_64", "AMD64") or "clang" in compiler:
        return {}
    return ISA_VARIANTS


def _ninja_path(path):
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _build_ext_class(BuildExtension, cxx_flags):
    class BuildExt(BuildExtension):
        """Compiles the ISA variants of VEC_SOURCE and links them into revkernels._C."""

        def build_extension(self, ext):
            variants = _isa_variants()
            if variants:
                objects = self._variant_objects(ext, variants)
                if objects is None:
                    return
                # After the extension's own objects, so for any symbol the objects share (none
                # expected) the linker keeps the baseline build's code.
                ext.extra_objects = list(ext.extra_objects or []) + objects
            super().build_extension(ext)

        def _variant_objects(self, ext, variants):
            """`_compile_variants`, or None where they fail to compile in an optional extension:
            skipped with a warning, as setuptools skips an optional extension whose compile fails
            (the pure-PyTorch package is installed; its filter does not catch ninja's error)."""
            import subprocess

            try:
                return self._compile_variants(ext, variants)
            except subprocess.CalledProcessError as error:
                if not ext.optional:
                    raise
                self.warn(f'building extension "{ext.name}" failed: the CPU ISA variants of {VEC_SOURCE}: {error}')
                return None

        def _compile_variants(self, ext, variants):
            """One object per ISA, built by ninja as BuildExtension builds the others: in parallel
            (MAX_JOBS), and again only when the source, a header it includes or the flags change."""
            import shlex
            import subprocess

            from torch.utils.cpp_extension import include_paths, is_ninja_available

            base = [*self.compiler.compiler_so, *(f"-I{d}" for d in ext.include_dirs + include_paths())]
            out_dir = os.path.abspath(os.path.join(self.build_temp, "isa_variants"))
            os.makedirs(out_dir, exist_ok=True)
            if not is_ninja_available():  # as BuildExtension does without ninja: one at a time
                return [self.compiler.compile([VEC_SOURCE], output_dir=os.path.join(out_dir, isa),
                                              include_dirs=ext.include_dirs + include_paths(),
                                              extra_postargs=cxx_flags + flags)[0]
                        for isa, flags in variants.items()]
            lines = ["ninja_required_version = 1.3", "rule cxx", "  command = $cmd -MMD -MF $out.d -c $in -o $out",
                     "  depfile = $out.d", "  deps = gcc"]
            objects = []
            for isa, flags in variants.items():
                objects.append(os.path.join(out_dir, f"vec_kernels_{isa}.o"))
                lines += [f"build {_ninja_path(objects[-1])}: cxx {_ninja_path(os.path.join(ROOT, VEC_SOURCE))}",
                          "  cmd = " + shlex.join(base + cxx_flags + flags).replace("$", "$$")]
            with open(os.path.join(out_dir, "build.ninja"), "w") as f:
                f.write("\n".join(lines) + "\n")
            jobs = ["-j", os.environ["MAX_JOBS"]] if os.environ.get("MAX_JOBS") else []
            subprocess.run(["ninja", "-C", out_dir, *jobs], check=True)
            return objects

    return BuildExt


def _extensions():
    if _env_flag("REVKERNELS_SKIP_EXTENSION"):
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    sources = sorted(glob.glob("csrc/registration.cpp") + glob.glob("csrc/ops/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    cpu_sources = [s for s in sources if not s.endswith("_cuda.cpp")]
    cuda_sources = [s for s in sources if s.endswith("_cuda.cpp")] + sorted(glob.glob("csrc/kernels/*.cu"))

    want_cuda = _env_flag("REVKERNELS_BUILD_CUDA")
    can_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if want_cuda and not can_cuda:
        raise SystemExit("REVKERNELS_BUILD_CUDA=1 but torch has no CUDA or nvcc was not found (set CUDA_HOME)")
    use_cuda = can_cuda if want_cuda is None else want_cuda

    # -fopenmp: at::parallel_for is inline and splits work only in OpenMP builds (the library then
    # uses the libgomp torch has loaded).
    # -g0: Python's CFLAGS carry -g; debug info over torch's headers took 28% (ops/layer_norm_autograd.cpp)
    # to 41% (cpu/vec_kernels.cpp) of the compile time and made the objects 15-30x larger.
    # -ffp-contract=off: GCC would fuse a * b + c into an FMA where an ISA variant has one (-mfma) and
    # not in the baseline build, so a vectorised forward and a scalar backward (chosen by layout)
    # could round the same pre-activation differently (BatchNorm+ReLU's recomputed mask).
    cxx_flags = ["-O3", "-fopenmp", "-g0", "-ffp-contract=off"]
    isa_flags = ["-DREVKERNELS_CPU_ISA_VARIANTS"] if _isa_variants() else []
    # Unless a backend was forced, a failed compile still installs the pure-PyTorch package
    # (`import revkernels` then warns that revkernels._C is missing).
    common = dict(name="revkernels._C", include_dirs=[os.path.join(ROOT, "csrc")], optional=want_cuda is None,
                  extra_link_args=["-fopenmp"])
    if use_cuda:
        ext = CUDAExtension(sources=cpu_sources + cuda_sources,
                            extra_compile_args={"cxx": cxx_flags + isa_flags, "nvcc": ["-O3"]},
                            **common)
    else:
        ext = CppExtension(sources=cpu_sources, extra_compile_args={"cxx": cxx_flags + isa_flags}, **common)
    # -Wno-*uninitialized: GCC 12's AVX-512 intrinsics headers trip them (_mm512_undefined_*).
    variant_flags = cxx_flags + ["-std=c++20", "-fPIC", "-Wno-maybe-uninitialized", "-Wno-uninitialized",
                                 f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    return [ext], {"build_ext": _build_ext_class(BuildExtension, variant_flags).with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
