"""Loads the compiled op library `revkernels._C`, or says clearly that it is missing.

Without it every `torch.ops.revkernels.*` op still exists: `revkernels.ops` registers its
pure-PyTorch reference for the devices the library does not cover.
"""
import importlib
import warnings

import torch  # noqa: F401  (loads libtorch/libc10, which _C links against)

try:
    # (importing registers the C++ ops with torch; `from revkernels import _C` would blame a
    # circular import of the half-initialised package where the library is missing)
    _C = importlib.import_module("revkernels._C")
except ImportError as error:  # not built, or built against another torch
    _C = None
    HAS_C_EXTENSION = False
    C_EXTENSION_ERROR = error
    warnings.warn(
        "revkernels: the compiled op library revkernels._C could not be loaded "
        f"({error}); falling back to the pure-PyTorch ops, which are correct but slower. "
        "Rebuild with `pip install --no-build-isolation -e .` against the installed torch.",
        RuntimeWarning,
        stacklevel=2,
    )
else:
    HAS_C_EXTENSION = True
    C_EXTENSION_ERROR = None

# Which build of the C++ CPU kernels runs: "DEFAULT", "AVX2", "AVX512" or "AVX512_BF16" (the widest
# this CPU runs that ATen would use too; ATEN_CPU_CAPABILITY lowers it), None without revkernels._C.
CPU_KERNEL_BUILD = _C.cpu_kernel_build() if HAS_C_EXTENSION else None
