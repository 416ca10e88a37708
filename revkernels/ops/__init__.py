"""torch.library ops of revkernels, one module per op family.

Each op has a schema in `csrc/ops/<family>.cpp` (or, without the compiled library, one defined
in Python), a C++ CPU kernel, Triton and (for elementwise ops) CUDA C++ kernels, a fake (meta)
implementation, an autograd formula and a pure-PyTorch reference that the tests compare against.
How an op reaches its kernel: `_library.py`.
"""
from revkernels.ops._library import get_cuda_backend, set_cuda_backend
from revkernels.ops.coupling import coupling_add, coupling_add_reference, coupling_sub, coupling_sub_reference

__all__ = ["coupling_sub", "coupling_add", "coupling_sub_reference", "coupling_add_reference",
           "set_cuda_backend", "get_cuda_backend"]
