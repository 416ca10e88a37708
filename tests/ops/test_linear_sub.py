"""revkernels::linear_sub (the GEMM-side rebuild y - (a @ W^T + b)) against PyTorch references."""
import pytest
import torch

from revkernels.ops.linear_sub import linear_sub
from tests.helpers import rel_err


def _case(rows, k, n, dtype=torch.float32, bias=True, device="cpu"):
    y = torch.randn(rows, n, device=device).to(dtype)
    a = torch.randn(rows, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return y, a, w, b


def _exact(y, a, w, b):
    return y.double() - torch.nn.functional.linear(a.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("shape", [(1, 33, 33), (7, 64, 1000), (3, 100, 4097)])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_matches_float64(shape, bias):
    y, a, w, b = _case(*shape, bias=bias)
    out = linear_sub(y, a, w, b)
    assert out.dtype == torch.float32 and out.shape == y.shape
    assert rel_err(out, _exact(y, a, w, b)) <= 1e-5


def test_leading_dims_and_non_contiguous_input():
    y, a, w, b = torch.randn(2, 9, 24), torch.randn(2, 16, 9).transpose(1, 2), torch.randn(24, 16), torch.randn(24)
    y_before = y.clone()
    out = linear_sub(y, a, w, b)
    assert rel_err(out, _exact(y, a, w, b)) <= 1e-5
    assert torch.equal(y, y_before)  # the accumulator is never the caller's tensor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_rule(dtype):
    y, a, w, b = _case(64, 96, 80, dtype=dtype)
    exact = _exact(y, a, w, b)
    torch_err = rel_err(y - torch.nn.functional.linear(a, w, b), exact)
    assert rel_err(linear_sub(y, a, w, b), exact) <= 2 * torch_err


def test_autocast_keeps_the_fp32_stream_as_accumulator():
    y, a, w, b = _case(32, 64, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_sub(y, a, w, b)
        same_dtype = y - torch.nn.functional.linear(a, w, b)
    assert out.dtype == torch.float32
    exact = _exact(y, a, w, b)
    assert rel_err(out, exact) <= 2 * rel_err(same_dtype, exact)


def test_opcheck_and_gradcheck():
    y, a, w, b = _case(5, 7, 6)
    torch.library.opcheck(torch.ops.revkernels.linear_sub.default,
                          (y, a.requires_grad_(), w.requires_grad_(), b.requires_grad_()))
    torch.library.opcheck(torch.ops.revkernels.linear_sub.default, (y, a, w, None))
    args = [t.double().detach().requires_grad_() for t in _case(4, 5, 3)]
    assert torch.autograd.gradcheck(lambda *t: torch.ops.revkernels.linear_sub(*t), args)


@pytest.mark.parametrize("bad,match", [
    ("weight_1d", "weight must be 2-D"),
    ("a_width", "a must have last dim"),
    ("y_shape", "y must have shape"),
    ("bias_shape", r"bias must have shape \(6,\)"),
    ("int_y", "y must be a floating-point tensor"),
    ("device", r"bias must be on the device of y \(cpu\), got meta"),
])
def test_bad_input_names_the_argument(bad, match):
    y, a, w, b = _case(5, 7, 6)
    if bad == "weight_1d":
        w = w[0]
    elif bad == "a_width":
        a = a[:, :-1]
    elif bad == "y_shape":
        y = y[:, :-1]
    elif bad == "bias_shape":
        b = b[:-1]
    elif bad == "int_y":
        y = y.long()
    else:
        b = b.to("meta")
    with pytest.raises(ValueError if bad != "int_y" else TypeError, match=match):
        linear_sub(y, a, w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda(dtype):
    y, a, w, b = _case(256, 768, 768, device="cuda")
    exact = _exact(y, a, w, b)
    if dtype == torch.float32:
        assert rel_err(linear_sub(y, a, w, b), exact) <= 1e-5  # TF32 is off by default
        return
    with torch.autocast("cuda", dtype=dtype):
        out = linear_sub(y, a, w, b)
        same_dtype = y - torch.nn.functional.linear(a, w, b)
    assert out.dtype == torch.float32
    assert rel_err(out, exact) <= 2 * rel_err(same_dtype, exact)
