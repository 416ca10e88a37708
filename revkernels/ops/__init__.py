"""torch.library ops of revkernels, one module per op family.

Each op has a schema in `csrc/registration.cpp` (or, without the compiled library, in
`_library.py`), device kernels, a fake (meta) implementation, an autograd formula and a
pure-PyTorch reference that the tests compare against.
"""
from revkernels.ops.coupling import coupling_add, coupling_add_reference, coupling_sub, coupling_sub_reference

__all__ = ["coupling_sub", "coupling_add", "coupling_sub_reference", "coupling_add_reference"]
