"""revkernels::linear_sub (the GEMM-side rebuild y - (a @ W^T + b)) against PyTorch references."""
import pathlib

import pytest
import torch

from revkernels.ops.linear_sub import linear_sub
from tests.helpers import assert_low_precision_rule, rel_err, run_without_c_extension

ROOT = str(pathlib.Path(__file__).resolve().parents[2])  # the checkout, for the subprocess checks


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
    ("int_y", "y must be float32, float64, float16 or bfloat16"),
    ("float8_a", "a must be float32, float64, float16 or bfloat16"),
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
    elif bad == "float8_a":
        a = a.to(torch.float8_e4m3fn)
    else:
        b = b.to("meta")
    with pytest.raises(TypeError if bad in ("int_y", "float8_a") else ValueError, match=match):
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


# --- fixes, each checked on the compiled op and on the Python fallback (the last test) ------------

NARROW_Y = [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float64)]


def _check_narrow_y_accumulates_in_the_gemm_dtype(y_dtype, ab_dtype, bias):
    # y nearly cancels a @ W^T + b: a product rounded to y's dtype before the subtraction (bias or not)
    # shows as an error of the product's size.
    y, a, w, b = (t if t is None else t.to(ab_dtype) for t in _case(64, 48, 40, bias=bias))
    product = torch.nn.functional.linear(a.double(), w.double(), None if b is None else b.double())
    y = (product + 1e-3 * torch.randn(64, 40, dtype=torch.float64)).to(y_dtype)
    exact = _exact(y, a, w, b)
    out = linear_sub(y, a, w, b)
    assert out.dtype == y_dtype
    if y_dtype == torch.float32:
        assert rel_err(out, exact) <= 1e-5
    else:
        assert rel_err(out, exact) <= 2 * rel_err((y - torch.nn.functional.linear(a, w, b)).to(y_dtype), exact)


NARROW_Y_AND_BIAS = [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float64)]


def _check_narrow_bias_is_not_rounded_with_y(y_dtype, ab_dtype):
    # y and b in the narrow dtype, a and W in the wider one; y ~ 100 (a constant column of a times
    # a column of 100 in W) cancels a @ W^T + b down to ~0.3: rounding y - b to y's dtype before the
    # wider GEMM adds to it costs up to half an ulp of y, against one rounding of the small result.
    _, a, w, _ = _case(64, 48, 40)
    a[:, 0], w[:, 0] = 1.0, 100.0
    a, w = a.to(ab_dtype), w.to(ab_dtype)
    b = (0.3 * torch.randn(40)).to(y_dtype)
    product = torch.nn.functional.linear(a.double(), w.double(), b.double())
    y = (product + 0.3 * torch.randn(64, 40, dtype=torch.float64)).to(y_dtype)
    exact = _exact(y, a, w, b)
    best = (y.to(ab_dtype) - torch.nn.functional.linear(a, w, b.to(ab_dtype))).to(y_dtype)  # one rounding
    out = linear_sub(y, a, w, b)
    assert out.dtype == y_dtype
    assert rel_err(out, exact) <= 2 * rel_err(best, exact)


def _check_autocast_leaves_a_float64_gemm_alone():
    y, a, w, b = (t.double() for t in _case(16, 24, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_sub(y, a, w, b)
        composition = y - torch.nn.functional.linear(a, w, b)
    assert out.dtype == torch.float64
    assert rel_err(out, _exact(y, a, w, b)) <= 1e-12
    assert rel_err(composition, _exact(y, a, w, b)) <= 1e-12  # autocast leaves float64 alone


def _check_result_contiguous_as_the_fake(y_dtype, bias):
    # Dense y with permuted strides, 2-d and 3-d: the result is contiguous, as the fake kernel's.
    for y, a in [(torch.randn(6, 5).t(), torch.randn(5, 7)),
                 (torch.randn(2, 6, 3).transpose(1, 2), torch.randn(2, 3, 7))]:
        y = y.to(y_dtype)  # keeps the strides
        w, b = torch.randn(6, 7), torch.randn(6) if bias else None
        out = linear_sub(y, a, w, b)
        assert out.is_contiguous()
        exact = _exact(y, a, w, b)
        composition = (y - torch.nn.functional.linear(a, w, b)).to(y_dtype)
        assert rel_err(out, exact) <= (1e-5 if y_dtype == torch.float32 else 2 * rel_err(composition, exact))
        torch.library.opcheck(torch.ops.revkernels.linear_sub.default, (y, a, w, b))


def _check_zero_width(k, n, bias):
    # in_features or out_features 0, as F.linear takes them: values and grads of the composition.
    y = torch.randn(2, 3, n)
    a, w = torch.randn(2, 3, k, requires_grad=True), torch.randn(n, k, requires_grad=True)
    b = torch.randn(n, requires_grad=True) if bias else None
    out = linear_sub(y, a, w, b)
    want = y - torch.nn.functional.linear(a, w, b)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    g = torch.randn(2, 3, n)
    leaves = [a, w] + ([b] if bias else [])
    for got, expected in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(want, leaves, g)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


MIXED_A_W = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
             (torch.float64, torch.bfloat16)]


def _check_mixed_a_and_weight_grads_in_the_gemm_dtype(a_dtype, w_dtype):
    """With a and W of different dtypes the backward GEMMs run in their promoted dtype, as the
    forward's (they ran in W's and a's own: an fp32 a with a bf16 W got a da of bf16 accuracy, 2.5e-3):
    da and dW within twice the error of the composition that upcasts the narrow operand, against float64."""
    y, a, w, b = _case(64, 256, 128)
    y, a, w = y.to(a_dtype), a.to(a_dtype), w.to(w_dtype)
    v = torch.randn(64, 128, dtype=torch.float64)
    wide = torch.promote_types(a_dtype, w_dtype)
    grads = []
    for fn, dtype in ((linear_sub, None), (lambda y, a, w, b: y - torch.nn.functional.linear(a.to(wide), w.to(wide), b.to(wide)).to(y.dtype), None),
                      (lambda y, a, w, b: y - torch.nn.functional.linear(a, w, b), torch.float64)):
        leaves = [t.to(dtype or t.dtype).requires_grad_() for t in (y, a, w, b)]
        out = fn(*leaves)
        grads.append(torch.autograd.grad((out * v.to(out.dtype)).sum(), leaves[1:3]))
    for name, ours, composition, exact in zip(("a", "weight"), *grads):
        assert ours.dtype == composition.dtype
        assert_low_precision_rule(ours, composition, exact, what=f"grad of {name} ({a_dtype} a, {w_dtype} W)")


@pytest.mark.parametrize("a_dtype,w_dtype", MIXED_A_W)
def test_mixed_a_and_weight_grads_in_the_gemm_dtype(a_dtype, w_dtype):
    _check_mixed_a_and_weight_grads_in_the_gemm_dtype(a_dtype, w_dtype)


@pytest.mark.parametrize("y_dtype,ab_dtype", NARROW_Y)
@pytest.mark.parametrize("bias", [False, True])
def test_narrow_y_accumulates_in_the_gemm_dtype(y_dtype, ab_dtype, bias):
    _check_narrow_y_accumulates_in_the_gemm_dtype(y_dtype, ab_dtype, bias)


@pytest.mark.parametrize("y_dtype,ab_dtype", NARROW_Y_AND_BIAS)
def test_narrow_bias_is_not_rounded_with_y(y_dtype, ab_dtype):
    _check_narrow_bias_is_not_rounded_with_y(y_dtype, ab_dtype)


def test_autocast_leaves_a_float64_gemm_alone():
    _check_autocast_leaves_a_float64_gemm_alone()


@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_result_contiguous_as_the_fake(y_dtype, bias):
    _check_result_contiguous_as_the_fake(y_dtype, bias)


@pytest.mark.parametrize("k,n", [(0, 5), (4, 0), (0, 0)])
@pytest.mark.parametrize("bias", [False, True])
def test_zero_width(k, n, bias):
    _check_zero_width(k, n, bias)


def test_fixes_in_the_python_fallback():
    run_without_c_extension(
        "warnings.simplefilter('ignore')\n"
        "import torch\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from tests.ops import test_linear_sub as T\n"
        "for bias in (False, True):\n"
        "    for y_dtype, ab_dtype in T.NARROW_Y:\n"
        "        T._check_narrow_y_accumulates_in_the_gemm_dtype(y_dtype, ab_dtype, bias)\n"
        "    for y_dtype in (torch.float32, torch.bfloat16):\n"
        "        T._check_result_contiguous_as_the_fake(y_dtype, bias)\n"
        "    for k, n in ((0, 5), (4, 0), (0, 0)):\n"
        "        T._check_zero_width(k, n, bias)\n"
        "for y_dtype, ab_dtype in T.NARROW_Y_AND_BIAS:\n"
        "    T._check_narrow_bias_is_not_rounded_with_y(y_dtype, ab_dtype)\n"
        "T._check_autocast_leaves_a_float64_gemm_alone()\n"
        "for a_dtype, w_dtype in T.MIXED_A_W:\n"
        "    T._check_mixed_a_and_weight_grads_in_the_gemm_dtype(a_dtype, w_dtype)\n"
        "print('ok')\n"
    )
