"""Builds revkernels._C: C++ CPU kernels always; CUDA kernels when torch has CUDA and nvcc exists.

REVKERNELS_BUILD_CUDA=1 forces the CUDA kernels (failing if they cannot be built), =0 skips them.
Unset, a CUDA build that fails (a toolkit without the headers torch's CUDA code includes, a CUDA
version other than torch's, a compile error) warns and builds the CPU kernels alone.
REVKERNELS_SKIP_EXTENSION=1 installs the pure-PyTorch package without compiling anything.

CUDA architectures: TORCH_CUDA_ARCH_LIST, else those of the visible GPUs (torch's rule), else, with
no GPU visible (a container build, a login node), those this torch was built for (the newest also
as PTX), so the kernels run wherever this torch runs.

CPU kernels: csrc/cpu/vec_kernels.cpp is compiled once per instruction set, as ATen compiles its
own (see that file): for DEFAULT, and on x86-64 with GCC once more per entry of ISA_VARIANTS below
(AVX2, AVX512, and AVX512 with the CPU's bf16 conversion; build_ext then compiles all four objects
itself with ninja: an Extension applies one flag set to all its sources). cpu/dispatch.cpp picks
one at run time.
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


def _default_cuda_arch_list(torch, required):
    """TORCH_CUDA_ARCH_LIST for a CUDA build on a machine with no GPU visible and no list set: the
    sm_XY architectures torch was built for, as "X.Y;...", the newest with +PTX (None where a list is
    set or a GPU is visible: torch's own rule applies; with neither, torch fails with an IndexError).
    Where torch names none: SystemExit for a `required` CUDA build, else None (the build then fails
    and falls back to the CPU kernels)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.is_available():
        return None
    # (torch.cuda.get_arch_list() returns none with no GPU visible in torch 2.11; the flags it reads do)
    read_flags = getattr(torch._C, "_cuda_getArchFlags", None)
    archs = (read_flags() or "").split() if read_flags is not None else torch.cuda.get_arch_list()
    numbers = sorted({int(arch[3:]) for arch in archs if arch.startswith("sm_") and arch[3:].isdigit()})
    if not numbers:
        if not required:
            return None
        raise SystemExit("revkernels: REVKERNELS_BUILD_CUDA=1, no GPU is visible and this torch names no CUDA "
                         "architecture: set TORCH_CUDA_ARCH_LIST (e.g. 9.0 for an H100/H200)")
    versions = [f"{n // 10}.{n % 10}" for n in numbers]
    return ";".join(versions[:-1] + [versions[-1] + "+PTX"])


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
PRECOMPILED_HEADER = "csrc/precompiled.h"


def _gcc():
    compiler = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or ""
    return "clang" not in compiler


def _isa_variants():
    """The ISA variants to build: x86-64 with GCC (the flags above are GCC's)."""
    if platform.machine() not in ("x86_64", "AMD64") or not _gcc():
        return {}
    return ISA_VARIANTS


def _ninja_path(path):
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _build_ext_class(BuildExtension, variant_flags):
    class BuildExt(BuildExtension):
        """Compiles the precompiled header and the ISA variants of VEC_SOURCE (GCC), then
        revkernels._C against the one and linked with the others."""

        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as error:  # noqa: BLE001  (torch raises RuntimeError, IndexError, ... here)
                fallbacks = [getattr(ext, "cpu_fallback", None) for ext in self.extensions]
                if not all(fallbacks):
                    raise
                first_line = (str(error).splitlines() or [""])[0]
                self.warn(f"revkernels: the CUDA kernels could not be built ({type(error).__name__}: {first_line}); "
                          "building the CPU kernels only (REVKERNELS_BUILD_CUDA=1 makes this an error)")
                for ext, fallback in zip(self.extensions, fallbacks):
                    # in place: setuptools keeps per-extension state (set in finalize_options) on ext
                    ext.__dict__.update({k: v for k, v in vars(fallback).items() if not k.startswith("_")})
                super().build_extensions()

        def build_extension(self, ext):
            variants = _isa_variants()
            if variants:
                # Then every build of VEC_SOURCE is ours, the baseline one at -O2: only CPUs without
                # AVX2 run it, and at -O3 its compile was the longest of all (the scalar at::vec).
                ext.sources = [s for s in ext.sources if os.path.normpath(s) != os.path.normpath(VEC_SOURCE)]
                variants = {"default": ["-O2"], **variants}
            objects = self._own_builds(ext, variants)
            if objects is None:
                return
            if _gcc():
                # Added after the header was built, with exactly the flags the sources get. ninja's
                # dependencies of a source using it do not name the header (GCC lists none of a
                # precompiled header's includes): -D with the header's build id makes every source's
                # command line change, and so recompile, when the header was rebuilt.
                ext.extra_compile_args["cxx"] += ["-Winvalid-pch", "-include", self._header_copy(),
                                                  f"-DREVKERNELS_PCH_ID={self._header_id()}"]
            # After the extension's own objects, so for any symbol the objects share (none
            # expected) the linker keeps the baseline build's code.
            ext.extra_objects = list(ext.extra_objects or []) + objects
            super().build_extension(ext)

        def _own_builds(self, ext, variants):
            """Builds the precompiled header (GCC) and the `variants` of VEC_SOURCE; returns the
            variants' objects, or None where they fail to compile in an optional extension: skipped
            with a warning, as setuptools skips an optional extension whose compile fails (the
            pure-PyTorch package is installed; its filter does not catch ninja's error)."""
            import subprocess

            builds = [self._precompiled_header(ext)] if _gcc() else []  # (output, source, flags)
            objects = []
            for isa, flags in variants.items():
                objects.append(os.path.join(self._own_dir(), f"vec_kernels_{isa}.o"))
                builds.append((objects[-1], VEC_SOURCE, self._base_flags(ext) + variant_flags + flags))
            try:
                self._ninja(builds)
            except subprocess.CalledProcessError as error:
                if not ext.optional:
                    raise
                self.warn(f'building extension "{ext.name}" failed: the precompiled header or the CPU ISA '
                          f'variants of {VEC_SOURCE}: {error}')
                return None
            return objects

        def _own_dir(self):
            path = os.path.abspath(os.path.join(self.build_temp, "own_builds"))
            os.makedirs(path, exist_ok=True)
            return path

        def _base_flags(self, ext):
            from torch.utils.cpp_extension import include_paths

            dirs = ext.include_dirs + include_paths() + list(self.compiler.include_dirs)
            return [*self.compiler.compiler_so[1:], *(f"-I{d}" for d in dirs)]

        def _header_copy(self):
            # GCC takes <header>.gch from the folder of the header it includes: the sources
            # include a copy beside the .gch (read only if the .gch is unusable).
            return os.path.join(self._own_dir(), os.path.basename(PRECOMPILED_HEADER))

        def _header_id(self):
            """The precompiled header's size and modification time (ns): a new one for each build of it."""
            info = os.stat(self._header_copy() + ".gch")
            return f"{info.st_size}_{info.st_mtime_ns}"

        def _precompiled_header(self, ext):
            """The header built with the flags BuildExtension compiles the sources with."""
            def read(path):
                with open(path) as f:
                    return f.read()

            text = read(os.path.join(ROOT, PRECOMPILED_HEADER))
            if not os.path.exists(self._header_copy()) or read(self._header_copy()) != text:
                with open(self._header_copy(), "w") as f:  # only then: a new copy rebuilds every source
                    f.write(text)
            flags = list(ext.extra_compile_args["cxx"])  # (their -std: see _extensions)
            return self._header_copy() + ".gch", PRECOMPILED_HEADER, self._base_flags(ext) + flags + ["-x", "c++-header"]

        def _ninja(self, builds):
            """Runs `builds` as BuildExtension builds the sources: with ninja, in parallel (MAX_JOBS)
            and again only when a source, a header it includes or the flags change."""
            import shlex
            import subprocess

            from torch.utils.cpp_extension import is_ninja_available

            compiler = self.compiler.compiler_cxx[0]  # the driver BuildExtension compiles with
            if not is_ninja_available():  # as BuildExtension does without ninja: one at a time
                for output, source, flags in builds:
                    subprocess.run([compiler, *flags, "-c", os.path.join(ROOT, source), "-o", output], check=True)
                return
            lines = ["ninja_required_version = 1.3", "rule cxx", "  command = $cmd -MMD -MF $out.d -c $in -o $out",
                     "  depfile = $out.d", "  deps = gcc"]
            for output, source, flags in builds:
                lines += [f"build {_ninja_path(output)}: cxx {_ninja_path(os.path.join(ROOT, source))}",
                          "  cmd = " + shlex.join([compiler, *flags]).replace("$", "$$")]
            with open(os.path.join(self._own_dir(), "build.ninja"), "w") as f:
                f.write("\n".join(lines) + "\n")
            jobs = ["-j", os.environ["MAX_JOBS"]] if os.environ.get("MAX_JOBS") else []
            subprocess.run(["ninja", "-C", self._own_dir(), *jobs], check=True)

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
    # -std=c++20 given here: BuildExtension adds its own standard only where none is given, and that
    # is C++17 in torch 2.11 (C++20 from 2.13): the op sources, the precompiled header and the ISA
    # variants are then compiled alike (with 2.11's C++17 the header went unused, 16 warnings).
    cxx_flags = ["-O3", "-fopenmp", "-g0", "-ffp-contract=off", "-std=c++20"]
    isa_flags = ["-DREVKERNELS_CPU_ISA_VARIANTS"] if _isa_variants() else []
    # optional: unless a backend was forced, a failed compile still installs the pure-PyTorch package
    # (`import revkernels` then warns that revkernels._C is missing). Each extension gets lists of
    # its own: torch's constructors extend them in place.
    def common():
        return dict(name="revkernels._C", include_dirs=[os.path.join(ROOT, "csrc")], optional=want_cuda is None,
                    extra_link_args=["-fopenmp"])

    cpu_ext = CppExtension(sources=cpu_sources, extra_compile_args={"cxx": cxx_flags + isa_flags}, **common())
    if use_cuda:
        arch_list = _default_cuda_arch_list(torch, required=bool(want_cuda))
        if arch_list is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        ext = CUDAExtension(sources=cpu_sources + cuda_sources,
                            extra_compile_args={"cxx": cxx_flags + isa_flags, "nvcc": ["-O3"]},
                            **common())
        if want_cuda is None:
            ext.cpu_fallback = cpu_ext  # built instead where the CUDA build fails (BuildExt.build_extensions)
    else:
        ext = cpu_ext
    # -Wno-*uninitialized: GCC 12's AVX-512 intrinsics headers trip them (_mm512_undefined_*).
    variant_flags = cxx_flags + ["-fPIC", "-Wno-maybe-uninitialized", "-Wno-uninitialized",
                                 f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    return [ext], {"build_ext": _build_ext_class(BuildExtension, variant_flags).with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
