"""The `revkernels` op namespace and how each op reaches a kernel.

- Schemas come from the compiled library (`csrc/ops/<family>.cpp`); without it, `define_op`
  defines them here so `torch.ops.revkernels.<op>` exists everywhere.
- Entry points (`entry_point`): with the compiled library, `revkernels.ops.<op>` is the op
  `torch.ops.revkernels.<op>` itself; its argument checks (in the device kernels) and autograd
  formula (`csrc/ops/<family>_autograd.cpp`) are C++, so a CPU call never enters Python. Without
  it, a Python function that runs the Python checks first, and the formula registered from Python
  (`register_autograd_fallback`).
- CPU: the C++ kernel, or the pure-PyTorch reference when the library was not built
  (`fill_missing_kernel`; it refuses forward-mode AD tangents as the C++ autograd kernels do).
- CUDA: `register_cuda_kernel` registers a Python kernel that runs the Triton implementation or
  the CUDA C++ one (internal op `revkernels::cuda_<op>`, where the op has one), chosen by
  `set_cuda_backend` or the environment variable REVKERNELS_CUDA_BACKEND=auto|triton|cuda. "auto"
  (the default) takes the CUDA C++ kernel for calls below `AUTO_CUDA_CPP_BELOW` (2^24) elements of
  the call's first tensor, where a CUDA C++ call costs the host less, and Triton at and above it,
  where Triton's kernels stream faster (the measurements: benchmarks/results/overhead_ops_cuda_*.csv
  and kernels_cuda.csv). The threshold counts elements, not bytes, and lies between the sizes
  measured so far; ops without a CUDA C++ kernel take Triton under every backend.
- Kernels written in Python (fake, Triton, fallback) declare the schema's defaults: the dispatcher
  leaves out trailing arguments equal to their defaults when it calls a Python kernel.
"""
import math
import numbers
import os

import torch
from torch.autograd import forward_ad

from revkernels._extension import HAS_C_EXTENSION  # (loads the compiled schemas first, when built)

# Keeps the Python-side registrations alive for the life of the process.
_FRAGMENT = torch.library.Library("revkernels", "FRAGMENT")

CUDA_BACKENDS = ("auto", "triton", "cuda")
AUTO_CUDA_CPP_BELOW = 1 << 24  # elements of the call's first tensor (see the module docstring)
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_tensor(t, name):
    """TypeError naming `name` unless `t` is a tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"revkernels: {name} must be a torch.Tensor, got {type(t).__name__}")


def check_float_dtype(dtype, name):
    """TypeError naming `name` unless `dtype` is one of the float dtypes the kernels take."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"revkernels: {name} must be float32, float64, float16 or bfloat16, got {dtype}")


def check_float_tensor(t, name):
    """TypeError naming `name` unless `t` is a tensor of one of the float dtypes the kernels take."""
    check_tensor(t, name)
    check_float_dtype(t.dtype, name)


def check_same_shape_and_device(a, a_name, b, b_name):
    """ValueError naming `b_name` and `a_name` unless `b` has the shape and the device of `a`."""
    if a.shape != b.shape:
        raise ValueError(f"revkernels: {b_name} must have the shape of {a_name} {tuple(a.shape)}, got {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"revkernels: {b_name} must be on the device of {a_name} ({a.device}), got {b.device}")


def _backend_from_env():
    name = os.environ.get("REVKERNELS_CUDA_BACKEND", "auto")
    if name not in CUDA_BACKENDS:
        raise ValueError(f"revkernels: REVKERNELS_CUDA_BACKEND must be one of {CUDA_BACKENDS}, got {name!r}")
    return name


_cuda_backend = _backend_from_env()


def set_cuda_backend(name):
    """Selects the CUDA kernels of every op: "auto" (default: CUDA C++ for calls below
    `AUTO_CUDA_CPP_BELOW` elements, Triton above), "triton", or "cuda" (CUDA C++). An op without a
    CUDA C++ kernel runs Triton under every backend."""
    global _cuda_backend
    if name not in CUDA_BACKENDS:
        raise ValueError(f"revkernels: backend must be one of {CUDA_BACKENDS}, got {name!r}")
    _cuda_backend = name


def get_cuda_backend():
    """The CUDA kernels the ops use: "auto", "triton" or "cuda" (see `set_cuda_backend`)."""
    return _cuda_backend


def runs_cuda_cpp(numel):
    """Whether a call whose first tensor has `numel` elements runs an op's CUDA C++ kernel (where
    the op has one) under the current backend."""
    return _cuda_backend == "cuda" or (_cuda_backend == "auto" and numel < AUTO_CUDA_CPP_BELOW)


def _has_schema(qualified_name):
    try:
        torch._C._dispatch_find_schema_or_throw(qualified_name, "")
    except RuntimeError:
        return False
    return True


def define_op(name, schema):
    """Defines `revkernels::<name>` with `schema` unless the compiled library already did."""
    if not _has_schema(f"revkernels::{name}"):
        _FRAGMENT.define(f"{name}{schema}")
    return getattr(torch.ops.revkernels, name)


def has_compiled_kernel(name, key):
    """Whether `revkernels::<name>` has a compiled kernel for dispatch key `key` ("CPU", "Autograd",
    "CompositeExplicitAutograd"), or a CUDA C++ kernel (internal op `revkernels::cuda_<name>`) for
    "CUDA"."""
    if key == "CUDA":
        return _has_schema(f"revkernels::cuda_{name}")
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"revkernels::{name}", key)


def fill_missing_kernel(name, key, kernel):
    """Registers `kernel` (a pure-PyTorch reference) for `revkernels::<name>` and dispatch key `key`
    when none was compiled."""
    if not has_compiled_kernel(name, key):
        _FRAGMENT.impl(name, _refusing_tangents(kernel), key)


def _refusing_tangents(kernel):
    """`kernel`, raising where an argument carries a forward-mode AD tangent. The ops have no
    forward-mode formula; the compiled autograd kernels refuse dual tensors (csrc/ops/autograd.h),
    but torch.library's Python autograd kernel calls the op below autograd when no input requires
    grad, where the tangent would be dropped silently."""

    def refusing_tangents(*args, **kwargs):
        if forward_ad._current_level >= 0 and any(
            isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None for a in args
        ):
            raise NotImplementedError("revkernels: the ops have no forward-mode AD formula (an input is a dual "
                                      "tensor of torch.autograd.forward_ad); differentiate them in reverse mode")
        return kernel(*args, **kwargs)

    return refusing_tangents


def register_autograd_fallback(name, backward, setup_context):
    """Registers the Python autograd formula of `revkernels::<name>` when no C++ one was compiled."""
    if not has_compiled_kernel(name, "Autograd"):
        torch.library.register_autograd(f"revkernels::{name}", backward, setup_context=setup_context)


def entry_point(name, checked, check_scalars=None):
    """The public `revkernels.ops.<name>`: the op `torch.ops.revkernels.<name>` itself when the
    compiled library is loaded, else `checked` (Python checks, then the op). `check_scalars`, given
    the op's arguments, checks its Python scalars first: the schema parser converts some bad ones
    silently (``relu=None`` to False, ``eps=True`` to 1.0) before any C++ check could see them."""
    if not HAS_C_EXTENSION:
        return checked
    op = getattr(torch.ops.revkernels, name)
    if check_scalars is None:
        op.__doc__ = checked.__doc__  # help(revkernels.ops.<name>) (the op packet has none)
        return op

    def checked_scalars(*args, **kwargs):
        check_scalars(*args, **kwargs)
        return op(*args, **kwargs)

    checked_scalars.__name__ = checked_scalars.__qualname__ = name
    checked_scalars.__doc__ = checked.__doc__
    return checked_scalars


def check_eps(eps):
    """TypeError unless `eps` is a real number (a Python or NumPy float or int; a bool would reach
    the kernel as 1.0 or 0.0, and a NumPy bool is no `numbers.Real`), ValueError unless it is finite
    and non-negative."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"revkernels: eps must be a real number (a float), got {type(eps).__name__} {eps!r}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"revkernels: eps must be finite and non-negative, got {eps!r}")


def register_cuda_kernel(name, triton_impl):
    """The CUDA kernel of `revkernels::<name>`: the CUDA C++ op `revkernels::cuda_<name>` where
    `runs_cuda_cpp` says so, else `triton_impl` (always, where the op has no CUDA C++ kernel)."""
    cuda_cpp = getattr(torch.ops.revkernels, f"cuda_{name}") if has_compiled_kernel(name, "CUDA") else None

    def cuda_kernel(*args):
        if cuda_cpp is not None and runs_cuda_cpp(args[0].numel()):
            return cuda_cpp(*args)
        return triton_impl(*args)

    # (the compiled autograd kernels refuse tangents before any device kernel runs)
    _FRAGMENT.impl(name, cuda_kernel if HAS_C_EXTENSION else _refusing_tangents(cuda_kernel), "CUDA")
