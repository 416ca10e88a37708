"""Loads the compiled op library `revkernels._C`, or says clearly that it is missing.

Without it every `torch.ops.revkernels.*` op still exists: `revkernels.ops` registers its
pure-PyTorch reference for the devices the library does not cover.
"""
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import warnings

import torch  # noqa: F401  (loads libtorch/libc10, which _C links against)


def _load_library_file(path):
    """Imports the op library at `path` as revkernels._C (REVKERNELS_C_LIBRARY: another build of it,
    such as scripts/sanitize.sh's). A library that will not load is an error here, not a fallback:
    the variable asks for that build. (A revkernels._C already in sys.modules, or a None placed
    there to hide it, is left alone.)"""
    if "revkernels._C" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location("revkernels._C", path)
    if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
        raise RuntimeError(f"revkernels: REVKERNELS_C_LIBRARY={path!r} is not a shared library (*.so) to import")
    try:
        module = importlib.util.module_from_spec(spec)  # runs PyInit__C: registers the ops
    except ImportError as error:
        raise RuntimeError(f"revkernels: REVKERNELS_C_LIBRARY={path!r} could not be loaded: {error}") from error
    sys.modules["revkernels._C"] = module
    spec.loader.exec_module(module)


if os.environ.get("REVKERNELS_C_LIBRARY"):
    _load_library_file(os.environ["REVKERNELS_C_LIBRARY"])

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
