"""Builds revkernels._C: C++ CPU kernels always; CUDA kernels when torch has CUDA and nvcc exists.

REVKERNELS_BUILD_CUDA=1 forces the CUDA kernels (failing if they cannot be built), =0 skips them.
REVKERNELS_SKIP_EXTENSION=1 installs the pure-PyTorch package without compiling anything.
"""
import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _env_flag(name):
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if value not in ("0", "1"):
        raise SystemExit(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def _extensions():
    if _env_flag("REVKERNELS_SKIP_EXTENSION"):
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    sources = sorted(glob.glob("csrc/registration.cpp") + glob.glob("csrc/ops/*.cpp"))
    cpu_sources = [s for s in sources if not s.endswith("_cuda.cpp")]
    cuda_sources = [s for s in sources if s.endswith("_cuda.cpp")] + sorted(glob.glob("csrc/kernels/*.cu"))

    want_cuda = _env_flag("REVKERNELS_BUILD_CUDA")
    can_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if want_cuda and not can_cuda:
        raise SystemExit("REVKERNELS_BUILD_CUDA=1 but torch has no CUDA or nvcc was not found (set CUDA_HOME)")
    use_cuda = can_cuda if want_cuda is None else want_cuda

    cxx_flags = ["-O3"]
    # Unless a backend was forced, a failed compile still installs the pure-PyTorch package
    # (`import revkernels` then warns that revkernels._C is missing).
    common = dict(name="revkernels._C", include_dirs=[os.path.join(ROOT, "csrc")], optional=want_cuda is None)
    if use_cuda:
        ext = CUDAExtension(sources=cpu_sources + cuda_sources,
                            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
                            **common)
    else:
        ext = CppExtension(sources=cpu_sources, extra_compile_args={"cxx": cxx_flags}, **common)
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
