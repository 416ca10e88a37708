"""The `revkernels` op namespace, with or without the compiled library.

`define_op` gives an op its schema when `_C` did not define it, and `fill_missing_kernels` registers
a pure-PyTorch implementation for each device that has no compiled kernel, so
`torch.ops.revkernels.<op>` works everywhere and dispatches to the fastest kernel available.
"""
import torch

import revkernels._extension  # noqa: F401  (loads the compiled schemas first, when built)

# Keeps the Python-side registrations alive for the life of the process.
_FRAGMENT = torch.library.Library("revkernels", "FRAGMENT")

DEVICES = ("CPU", "CUDA")


def define_op(name, schema):
    """Defines `revkernels::<name>` with `schema` unless the compiled library already did."""
    if not _has_schema(name):
        _FRAGMENT.define(f"{name}{schema}")
    return getattr(torch.ops.revkernels, name)


def _has_schema(name):
    try:
        torch._C._dispatch_find_schema_or_throw(f"revkernels::{name}", "")
    except RuntimeError:
        return False
    return True


def has_compiled_kernel(name, device):
    """Whether `revkernels::<name>` has a C++/CUDA kernel for `device` ("CPU" or "CUDA")."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"revkernels::{name}", device)


def fill_missing_kernels(name, fallback):
    """Registers `fallback` for every device without a compiled kernel of `revkernels::<name>`."""
    for device in DEVICES:
        if not has_compiled_kernel(name, device):
            _FRAGMENT.impl(name, fallback, device)
