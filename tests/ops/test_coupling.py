"""revkernels::coupling_sub / coupling_add against their pure-PyTorch references."""
import os

import pytest
import torch

import revkernels as rk
from revkernels.ops import coupling_add, coupling_add_reference, coupling_sub, coupling_sub_reference
from revkernels.ops._library import has_compiled_kernel
from tests.helpers import run_without_c_extension

OPS = [
    ("coupling_sub", coupling_sub, coupling_sub_reference, torch.sub),
    ("coupling_add", coupling_add, coupling_add_reference, torch.add),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random(shape, dtype):
    return (torch.randn(shape) * 3 + 0.5).to(dtype)


def test_cpu_kernels_are_compiled():
    # CI builds the C++ library; without it every test below would only test the fallback.
    assert rk.HAS_C_EXTENSION, rk._extension.C_EXTENSION_ERROR
    assert has_compiled_kernel("coupling_sub", "CPU") and has_compiled_kernel("coupling_add", "CPU")


@pytest.mark.parametrize("name,op,reference,torch_op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (1, 33), (33, 1000), (2, 3, 4097)])
def test_matches_reference(name, op, reference, torch_op, dtype, shape):
    a, b = _random(shape, dtype), _random(shape, dtype)
    out = op(a, b)
    assert out.dtype == dtype and out.shape == a.shape
    torch.testing.assert_close(out, reference(a, b), rtol=0, atol=0)  # formed in fp32, rounded once: exact
    # The low-precision rule: error against fp32 at most 2x that of the same-dtype PyTorch op.
    exact = torch_op(a.float(), b.float())
    err = (out.float() - exact).abs().max()
    torch_err = (torch_op(a, b).float() - exact).abs().max()
    assert err <= 2 * torch_err + (0.0 if dtype != torch.float32 else 1e-6 * exact.abs().max())


@pytest.mark.parametrize("name,op,reference,torch_op", OPS)
@pytest.mark.parametrize("a_dtype,b_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                             (torch.bfloat16, torch.float32), (torch.float64, torch.float32),
                                             (torch.float16, torch.float64)])
def test_mixed_dtypes_round_once(name, op, reference, torch_op, a_dtype, b_dtype):
    a, b = _random((5, 300), a_dtype), _random((5, 300), b_dtype)
    out = op(a, b)
    assert out.dtype == a_dtype
    torch.testing.assert_close(out, reference(a, b), rtol=0, atol=0)


@pytest.mark.parametrize("name,op,reference,torch_op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded", "channels_last", "permuted_3d"])
def test_non_contiguous_inputs(name, op, reference, torch_op, dtype, layout):
    if layout == "transposed":
        a, b = _random((64, 33), dtype).t(), _random((33, 64), dtype)
    elif layout == "sliced":
        a, b = _random((40, 90), dtype)[::3, 1::2], _random((14, 90), dtype)[:, ::2]
    elif layout == "expanded":
        a, b = _random((20, 31), dtype), _random((1, 31), dtype).expand(20, 31)
    elif layout == "channels_last":
        a = _random((2, 5, 6, 7), dtype).to(memory_format=torch.channels_last)
        b = _random((2, 5, 6, 7), dtype)
    else:
        a, b = _random((6, 5, 4), dtype).permute(2, 0, 1), _random((5, 4, 6), dtype).permute(1, 2, 0)
    a_before, b_before = a.clone(), b.clone()
    out = op(a, b)
    torch.testing.assert_close(out, reference(a, b), rtol=0, atol=0)
    assert out.stride() == torch.empty_like(a).stride()  # the layout of the first argument
    torch.testing.assert_close(a, a_before, rtol=0, atol=0)  # inputs untouched
    torch.testing.assert_close(b, b_before, rtol=0, atol=0)


@pytest.mark.parametrize("name,op,reference,torch_op", OPS)
def test_many_unmergeable_dims_keep_the_first_arguments_layout(name, op, reference, torch_op):
    # 13 dims that do not merge, more than the kernels' layout takes: the inputs are copied first, and
    # the result still has the first argument's layout (the fake kernel's).
    reverse = list(reversed(range(13)))
    for a, b in [(_random([2] * 13, torch.float32).permute(reverse), _random([2] * 13, torch.bfloat16)),
                 (_random([2] * 13, torch.float32), _random([2] * 13, torch.float32).permute(reverse))]:
        out = op(a, b)
        torch.testing.assert_close(out, reference(a, b), rtol=0, atol=0)
        assert out.stride() == torch.empty_like(a).stride()
        torch.library.opcheck(getattr(torch.ops.revkernels, name).default, (a, b))


def test_empty():
    a = torch.randn(0, 5)
    assert coupling_sub(a, a).shape == (0, 5)


@pytest.mark.parametrize("name", ["coupling_sub", "coupling_add"])
def test_opcheck(name):
    op = getattr(torch.ops.revkernels, name).default
    for a, b in [(torch.randn(3, 17), torch.randn(3, 17)),
                 (torch.randn(8, 6).t(), torch.randn(6, 8)),
                 (torch.randn(4, 9, requires_grad=True), torch.randn(4, 9).bfloat16().requires_grad_())]:
        torch.library.opcheck(op, (a, b))


def test_autograd_formula():
    y = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    f = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, f: torch.ops.revkernels.coupling_sub(y, f), (y, f))
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.revkernels.coupling_add(a, b), (y, f))


@pytest.mark.parametrize("op,first,second", [(coupling_sub, "y", "f"), (coupling_add, "a", "b")])
def test_bad_input_names_the_argument(op, first, second):
    with pytest.raises(ValueError, match=f"{second} must have the shape of {first}"):
        op(torch.randn(3, 4), torch.randn(4, 3))
    with pytest.raises(TypeError, match=f"{first} must be float32"):
        op(torch.ones(3, dtype=torch.int64), torch.randn(3))
    # The entry point is the op: PyTorch's schema parser rejects a non-tensor, naming the argument
    # (the Python entry points of the fallback raise TypeError: tests/ops/test_dispatch.py).
    with pytest.raises(RuntimeError, match=f"for argument '{second}'"):
        op(torch.randn(3), 1.0)
    with pytest.raises(ValueError, match=f"{second} must be on the device of {first}"):
        op(torch.randn(3), torch.randn(3, device="meta"))


def test_torch_op_checks_in_cpp():
    # Calling the registered op directly (bypassing the Python wrapper) still names the argument.
    with pytest.raises(ValueError, match="f must have the shape of y"):
        torch.ops.revkernels.coupling_sub(torch.randn(3, 4), torch.randn(4, 3))


def test_pure_pytorch_fallback_when_library_missing():
    # Without revkernels._C: a clear warning, and the ops still work through the reference.
    run_without_c_extension(
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import revkernels as rk\n"
        "import torch\n"
        "assert not rk.HAS_C_EXTENSION\n"
        "assert any('could not be loaded' in str(w.message) for w in caught), caught\n"
        "y, f = torch.randn(5, 7), torch.randn(5, 7).bfloat16()\n"
        "assert torch.equal(torch.ops.revkernels.coupling_sub(y, f), rk.ops.coupling_sub_reference(y, f))\n"
        # the ops called directly run the C++ kernels' checks (no broadcasting, float dtypes)
        "expect_error(lambda: torch.ops.revkernels.coupling_sub(y, f[0]), 'f must have the shape of y')\n"
        "expect_error(lambda: torch.ops.revkernels.coupling_add(y.long(), y), 'a must be float32')\n"
        "print('ok')\n"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("name,op,reference,torch_op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded"])
def test_cuda_matches_reference(name, op, reference, torch_op, dtype, layout):
    assert has_compiled_kernel(name, "CUDA"), "CUDA C++ kernels were not built"
    a, b = _random((257, 1031), dtype).cuda(), _random((257, 1031), dtype).cuda()
    if layout == "transposed":
        a = _random((1031, 257), dtype).cuda().t()
    elif layout == "expanded":
        b = _random((1, 1031), dtype).cuda().expand(257, 1031)
    out = op(a, b)
    torch.testing.assert_close(out, reference(a, b), rtol=0, atol=0)
    exact = torch_op(a.float(), b.float())
    assert (out.float() - exact).abs().max() <= 2 * (torch_op(a, b).float() - exact).abs().max() + 1e-6 * exact.abs().max()


@pytest.mark.gpu
def test_cuda_opcheck():
    for name in ("coupling_sub", "coupling_add"):
        torch.library.opcheck(getattr(torch.ops.revkernels, name).default,
                              (torch.randn(16, 33, device="cuda"), torch.randn(16, 33, device="cuda").half()))


# --- Triton kernels (under TRITON_INTERPRET=1 on CPU; no bf16 arithmetic there) ------------------

TRITON_CASES = [
    ("contiguous", lambda: (_random((33, 1000), torch.float32), _random((33, 1000), torch.float32))),
    ("one row", lambda: (_random((1, 4097), torch.float32), _random((1, 4097), torch.float32))),
    ("mixed fp64", lambda: (_random((7, 33), torch.float32), _random((7, 33), torch.float64))),
    ("transposed a", lambda: (_random((40, 33), torch.float32).t(), _random((33, 40), torch.float32))),
    ("expanded b", lambda: (_random((9, 33), torch.float32), _random((1, 33), torch.float32).expand(9, 33))),
    ("sliced a", lambda: (_random((30, 70), torch.float32)[::2, 3:], _random((15, 67), torch.float32))),
    # not dense, its empty_like channels_last: copied into that layout, not a contiguous one
    ("sliced channels_last a", lambda: (_random((2, 3, 8, 8), torch.float32).to(
        memory_format=torch.channels_last)[:, :, ::2], _random((2, 3, 4, 8), torch.float32))),
]


@pytest.mark.parametrize("case", [c[0] for c in TRITON_CASES])
@pytest.mark.parametrize("alpha,reference", [(-1.0, coupling_sub_reference), (1.0, coupling_add_reference)])
def test_triton_kernel_matches_reference(case, alpha, reference):
    from revkernels.triton.coupling import coupling_axpy

    a, b = dict(TRITON_CASES)[case]()
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = a.to(device), b.to(device)
    out = coupling_axpy(a, b, alpha)
    assert out.dtype == a.dtype and out.shape == a.shape
    assert out.stride() == torch.empty_like(a).stride()  # the layout of the first argument
    torch.testing.assert_close(out, reference(a, b), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton", "cuda"])
def test_cuda_backends_are_selectable(backend):
    from revkernels.ops import get_cuda_backend, set_cuda_backend

    previous = get_cuda_backend()
    set_cuda_backend(backend)
    try:
        y, f = torch.randn(64, 4097, device="cuda").bfloat16(), torch.randn(64, 4097, device="cuda")
        torch.testing.assert_close(torch.ops.revkernels.coupling_sub(y, f), coupling_sub_reference(y, f), rtol=0, atol=0)
    finally:
        set_cuda_backend(previous)


def test_cuda_backend_name_is_checked():
    from revkernels.ops import set_cuda_backend

    with pytest.raises(ValueError, match="backend must be one of"):
        set_cuda_backend("opencl")
