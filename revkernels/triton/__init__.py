"""Triton GPU kernels, one module per op family (entry points take and return torch tensors).

They also run on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set before the
first import of these modules), which is how CI tests them. `revkernels.ops` imports them lazily,
on the first CUDA call, so `import revkernels` needs no Triton.
"""
