"""revkernels::bias_gelu / bias_gelu_bwd against float64 truth, PyTorch's composition and their references."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import revkernels as rk
from revkernels.ops._library import has_compiled_kernel
from revkernels.ops.bias_gelu import (bias_gelu, bias_gelu_bwd, bias_gelu_bwd_reference,
                                      bias_gelu_reference)
from tests.helpers import assert_close_rel, assert_low_precision_rule, run_without_c_extension

APPROX = ["none", "tanh"]
# x shapes: widths 33, 1000, 4097; one row; enough rows for several chunks of the CPU dbias reduction.
SHAPES = [(1, 33), (1, 4097), (5, 33), (7, 1000), (3, 4097), (2, 3, 1000), (2500, 33), (300, 1000)]


def _random(shape, dtype=torch.float32, scale=2.0):
    # Centred off zero and wide enough to reach GELU's tails on both sides; never all zeros.
    return (torch.randn(shape, dtype=torch.float64) * scale + 0.25).to(dtype)


def _inputs(shape, dtype=torch.float32, bias_dtype=None):
    x = _random(shape, dtype)
    bias = _random(shape[-1], bias_dtype or dtype, scale=1.0)
    dy = _random(shape, dtype, scale=1.0)
    return dy, x, bias


# --- float64 truth, written from the formulas in revkernels/ops/bias_gelu.py's docstring ----------

def _truth(dy, x, bias, approximate):
    """(y, dx, dbias) in float64 from the docstring formulas, independent of torch's GELU."""
    z = x.double() + bias.double()
    if approximate == "tanh":
        beta, kappa = math.sqrt(2 / math.pi), 0.044715
        t = torch.tanh(beta * (z + kappa * z**3))
        y = 0.5 * z * (1 + t)
        grad = 0.5 * (1 + t) + 0.5 * z * (1 - t**2) * beta * (1 + 3 * kappa * z**2)
    else:
        cdf = 0.5 * (1 + torch.special.erf(z / math.sqrt(2)))
        y = z * cdf
        grad = cdf + z * torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    dx = dy.double() * grad
    return y, dx, dx.reshape(-1, x.shape[-1]).sum(0)


def _check_low_precision_rule(y, dx, dbias, dy, x, bias, approximate):
    """Error against an fp32 reference at most 2x that of the same-dtype PyTorch composition
    (F.gelu(x + b) in x's dtype, and its autograd grads)."""
    x32, b32 = x.float().requires_grad_(), bias.float().requires_grad_()
    y32 = F.gelu(x32 + b32, approximate=approximate)
    y32.backward(dy.float())
    x16, b16 = x.clone().requires_grad_(), bias.clone().requires_grad_()
    y16 = F.gelu(x16 + b16, approximate=approximate)
    y16.backward(dy)
    for what, got, exact, composed in (("y", y, y32, y16), ("dx", dx, x32.grad, x16.grad),
                                       ("dbias", dbias, b32.grad, b16.grad)):
        err = (got.float() - exact).abs().max().item()
        torch_err = (composed.float() - exact).abs().max().item()
        assert err <= 2 * torch_err, f"{what}: error {err:.3e} > 2 x PyTorch's {torch_err:.3e}"


def test_cpu_kernels_are_compiled():
    # CI builds the C++ library; without it every CPU test below would only test the reference.
    assert rk.HAS_C_EXTENSION, rk._extension.C_EXTENSION_ERROR
    assert has_compiled_kernel("bias_gelu", "CPU") and has_compiled_kernel("bias_gelu_bwd", "CPU")


@pytest.mark.parametrize("approximate", APPROX)
def test_reference_matches_the_formulas(approximate):
    dy, x, bias = _inputs((6, 77), torch.float64)
    y, dx, dbias = _truth(dy, x, bias, approximate)
    assert_close_rel(bias_gelu_reference(x, bias, approximate), y, tol=1e-13, what="reference y")
    ref_dx, ref_dbias = bias_gelu_bwd_reference(dy, x, bias, approximate)
    assert_close_rel(ref_dx, dx, tol=1e-13, what="reference dx")
    assert_close_rel(ref_dbias, dbias, tol=1e-13, what="reference dbias")


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_float64(approximate, shape):
    dy, x, bias = _inputs(shape)
    y_true, dx_true, dbias_true = _truth(dy, x, bias, approximate)
    y = bias_gelu(x, bias, approximate)
    assert y.dtype == torch.float32 and y.shape == x.shape and y.is_contiguous()
    assert_close_rel(y, y_true, tol=1e-5, what="y")
    dx, dbias = bias_gelu_bwd(dy, x, bias, approximate)
    assert dx.dtype == torch.float32 and dx.shape == x.shape and dx.is_contiguous()
    assert dbias.dtype == torch.float32 and dbias.shape == bias.shape
    assert_close_rel(dx, dx_true, tol=1e-5, what="dx")
    assert_close_rel(dbias, dbias_true, tol=1e-5, what="dbias")


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 33), (7, 1000), (3, 4097), (300, 1000)])
def test_low_precision_rule(approximate, dtype, shape):
    dy, x, bias = _inputs(shape, dtype)
    y = bias_gelu(x, bias, approximate)
    dx, dbias = bias_gelu_bwd(dy, x, bias, approximate)
    assert y.dtype == dx.dtype == dbias.dtype == dtype
    _check_low_precision_rule(y, dx, dbias, dy, x, bias, approximate)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("x_dtype,bias_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                (torch.float32, torch.bfloat16), (torch.float32, torch.float64),
                                                (torch.float64, torch.float64)])
def test_bias_dtype_may_differ(approximate, x_dtype, bias_dtype):
    dy, x, bias = _inputs((9, 130), x_dtype, bias_dtype)
    y = bias_gelu(x, bias, approximate)
    dx, dbias = bias_gelu_bwd(dy, x, bias, approximate)
    assert y.dtype == dx.dtype == x_dtype and dbias.dtype == bias_dtype
    # Exact: float64. Same-dtype PyTorch: the composition in the promoted compute dtype (fp32 or
    # fp64), rounded to each output's dtype. fp32/fp64 outputs: the fp32 rule (1e-5; 1e-12 in fp64);
    # 16-bit outputs: at most 2x PyTorch's error (the low-precision rule of docs/design.md).
    ref_y = bias_gelu_reference(x.double(), bias.double(), approximate)
    ref_dx, ref_dbias = bias_gelu_bwd_reference(dy.double(), x.double(), bias.double(), approximate)
    compute = torch.promote_types(torch.promote_types(x_dtype, bias_dtype), torch.float32)
    xt, bt = x.to(compute).requires_grad_(), bias.to(compute).requires_grad_()
    yt = F.gelu(xt + bt, approximate=approximate)
    yt.backward(dy.to(compute))
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}
    for got, exact, composed, what in ((y, ref_y, yt.detach(), "y"), (dx, ref_dx, xt.grad, "dx"),
                                       (dbias, ref_dbias, bt.grad, "dbias")):
        if got.dtype in (torch.bfloat16, torch.float16):
            assert_low_precision_rule(got, composed.to(got.dtype), exact, what)
        else:
            assert_close_rel(got, exact, tol=tol[got.dtype], what=what)


def _layouts(dtype):
    """Non-contiguous x / dy (and a strided bias) of the same logical shapes, with their names."""
    wide_x, wide_dy = _random((11, 70), dtype), _random((11, 70), dtype, scale=1.0)
    return {
        "transposed": (_random((1000, 6), dtype, 1.0).t(), _random((1000, 6), dtype).t(), _random(1000, dtype, 1.0)),
        "row-sliced": (wide_dy[:, 3:36], wide_x[:, 3:36], _random(33, dtype, 1.0)),
        "every other row": (wide_dy[::2, :33], wide_x[::2, :33], _random(66, dtype, 1.0)[::2]),
        "column-strided": (wide_dy[:, ::2], wide_x[:, ::2], _random(35, dtype, 1.0)),
        "permuted 3-d": (_random((33, 4, 5), dtype, 1.0).permute(1, 2, 0), _random((5, 33, 4), dtype).permute(2, 0, 1),
                         _random(33, dtype, 1.0)),
        "expanded rows": (_random((1, 33), dtype, 1.0).expand(8, 33), _random((1, 33), dtype).expand(8, 33),
                          _random(33, dtype, 1.0)),
    }


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(_layouts(torch.float32)))
def test_non_contiguous_inputs(approximate, dtype, layout):
    dy, x, bias = _layouts(dtype)[layout]
    assert not x.is_contiguous()
    before = [t.clone() for t in (dy, x, bias)]
    y = bias_gelu(x, bias, approximate)
    dx, dbias = bias_gelu_bwd(dy, x, bias, approximate)
    assert y.is_contiguous() and dx.is_contiguous() and y.shape == dx.shape == x.shape
    # The same as on contiguous copies, bit for bit (same kernels, same chunking).
    c_dy, c_x, c_bias = (t.contiguous() for t in (dy, x, bias))
    torch.testing.assert_close(y, bias_gelu(c_x, c_bias, approximate), rtol=0, atol=0)
    c_dx, c_dbias = bias_gelu_bwd(c_dy, c_x, c_bias, approximate)
    torch.testing.assert_close(dx, c_dx, rtol=0, atol=0)
    torch.testing.assert_close(dbias, c_dbias, rtol=0, atol=0)
    if dtype == torch.float32:
        y_true, dx_true, dbias_true = _truth(dy, x, bias, approximate)
        assert_close_rel(y, y_true, tol=1e-5, what="y")
        assert_close_rel(dx, dx_true, tol=1e-5, what="dx")
        assert_close_rel(dbias, dbias_true, tol=1e-5, what="dbias")
    for t, t_before in zip((dy, x, bias), before):
        torch.testing.assert_close(t, t_before, rtol=0, atol=0)  # inputs untouched


def test_dbias_does_not_depend_on_the_thread_count():
    dy, x, bias = _inputs((3000, 257))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bias_gelu_bwd(dy, x, bias)
        torch.set_num_threads(max(2, threads))
        many = bias_gelu_bwd(dy, x, bias)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, many, rtol=0, atol=0)


def test_empty():
    x, bias = torch.randn(0, 5), torch.randn(5)
    assert bias_gelu(x, bias).shape == (0, 5)
    dx, dbias = bias_gelu_bwd(torch.randn(0, 5), x, bias)
    assert dx.shape == (0, 5)
    torch.testing.assert_close(dbias, torch.zeros(5), rtol=0, atol=0)  # a sum over no rows
    dx, dbias = bias_gelu_bwd(torch.randn(4, 0), torch.randn(4, 0), torch.randn(0))
    assert dx.shape == (4, 0) and dbias.shape == (0,)


@pytest.mark.parametrize("approximate", APPROX)
def test_opcheck_bias_gelu(approximate):
    op = torch.ops.revkernels.bias_gelu.default
    for x, bias in [(_random((3, 17)), _random(17)),
                    (_random((8, 6)).t(), _random(8)),
                    (_random((2, 3, 33)).requires_grad_(), _random(33).requires_grad_()),
                    (_random((4, 9)).bfloat16().requires_grad_(), _random(9).requires_grad_())]:
        torch.library.opcheck(op, (x, bias, approximate))
    torch.library.opcheck(op, (_random((3, 17)), _random(17)))  # the default approximation


@pytest.mark.parametrize("approximate", APPROX)
def test_opcheck_bias_gelu_bwd(approximate):
    op = torch.ops.revkernels.bias_gelu_bwd.default
    for dy, x, bias in [_inputs((3, 17)), _inputs((2, 3, 33), torch.bfloat16),
                        _inputs((5, 40), torch.float16, torch.float32)]:
        torch.library.opcheck(op, (dy, x, bias, approximate))
    torch.library.opcheck(op, (_random((6, 8)).t(), _random((6, 8)).t(), _random(6)))


@pytest.mark.parametrize("approximate", APPROX)
def test_gradcheck(approximate):
    x = _random((4, 7), torch.float64).requires_grad_()
    bias = _random(7, torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, b: torch.ops.revkernels.bias_gelu(x, b, approximate), (x, bias))


@pytest.mark.parametrize("approximate", APPROX)
def test_double_backward(approximate):
    """A backward with create_graph=True differentiates bias_gelu twice (autograd's fallback for the
    backward op warned and returned no second-order grads): against finite differences in float64,
    and a gradient penalty in fp32 against eager GELU in float64."""
    x = _random((4, 7), torch.float64).requires_grad_()
    bias = _random(7, torch.float64).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x, b: torch.ops.revkernels.bias_gelu(x, b, approximate), (x, bias))
    dy, x, bias = _inputs((3, 2, 33))
    grads = []
    for fn, dtype in ((lambda a, b: bias_gelu(a, b, approximate), torch.float32),
                      (lambda a, b: F.gelu(a + b, approximate=approximate), torch.float64)):
        a, b = x.to(dtype).requires_grad_(), bias.to(dtype).requires_grad_()
        da, db = torch.autograd.grad(fn(a, b), (a, b), dy.to(dtype), create_graph=True)
        grads.append(torch.autograd.grad((da ** 2).sum() + (db ** 3).sum(), (a, b)))
    for name, actual, expected in zip(("x", "bias"), *grads):
        assert_close_rel(actual, expected, tol=1e-5, what=f"second-order grad of {name}")


@pytest.mark.parametrize("approximate", APPROX)
def test_autograd_matches_pytorch(approximate):
    dy, x, bias = _inputs((2, 5, 1000))
    x1, b1 = x.clone().requires_grad_(), bias.clone().requires_grad_()
    bias_gelu(x1, b1, approximate).backward(dy)
    x2, b2 = x.double().requires_grad_(), bias.double().requires_grad_()
    F.gelu(x2 + b2, approximate=approximate).backward(dy.double())
    assert_close_rel(x1.grad, x2.grad, tol=1e-5, what="x.grad")
    assert_close_rel(b1.grad, b2.grad, tol=1e-5, what="bias.grad")
    # Only x needs a gradient: the backward still runs (dbias is dropped).
    x3 = x.clone().requires_grad_()
    bias_gelu(x3, bias, approximate).backward(dy)
    torch.testing.assert_close(x3.grad, x1.grad, rtol=0, atol=0)


@pytest.mark.parametrize("entry", ["python", "torch.ops"])
def test_bad_input_names_the_argument(entry):
    if entry == "python":
        fwd, bwd = bias_gelu, bias_gelu_bwd
    else:  # the C++ glue's checks (or the Python-registered kernels' ones), without the entry points
        fwd, bwd = torch.ops.revkernels.bias_gelu, torch.ops.revkernels.bias_gelu_bwd
    x, bias = torch.randn(3, 4), torch.randn(4)
    with pytest.raises(ValueError, match=r"bias must have shape \(N,\) = \(4,\)"):
        fwd(x, torch.randn(5))
    with pytest.raises(ValueError, match="bias must have shape"):
        fwd(x, torch.randn(1, 4))
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh', got 'erf'"):
        fwd(x, bias, "erf")
    with pytest.raises(TypeError, match="x must be float32"):
        fwd(torch.ones(3, 4, dtype=torch.int64), bias)
    with pytest.raises(TypeError, match="bias must be float32"):
        fwd(x, torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must have shape"):
        fwd(torch.tensor(1.0), torch.randn(1))
    with pytest.raises(ValueError, match="bias must have shape"):
        bwd(torch.randn(3, 4), x, torch.randn(3))
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        bwd(torch.randn(3, 4), x, bias, "Tanh")
    with pytest.raises(TypeError, match="dy must be float32"):
        bwd(torch.ones(3, 4, dtype=torch.int64), x, bias)
    with pytest.raises(TypeError, match="dy must have the dtype of x"):
        bwd(torch.randn(3, 4).double(), x, bias)
    with pytest.raises(ValueError, match="dy must have the shape of x"):
        bwd(torch.randn(4, 3), x, bias)
    with pytest.raises(ValueError, match="bias must be on the device of x"):
        fwd(x, torch.randn(4, device="meta"))


def test_argument_types():
    # The entry point is the op: PyTorch's schema parser rejects a wrong Python type, naming the
    # argument (the Python entry points of the fallback raise TypeError).
    with pytest.raises(RuntimeError, match="for argument 'bias'"):
        bias_gelu(torch.randn(3, 4), [0.0] * 4)
    with pytest.raises(RuntimeError, match="for argument 'approximate'"):
        bias_gelu(torch.randn(3, 4), torch.randn(4), None)


def test_pure_pytorch_fallback_when_library_missing():
    # Without revkernels._C: the schemas defined in Python, the references as CPU kernels, autograd.
    run_without_c_extension(
        "warnings.simplefilter('ignore')\n"
        "import torch, revkernels as rk\n"
        "from revkernels.ops.bias_gelu import bias_gelu, bias_gelu_bwd_reference, bias_gelu_reference\n"
        "assert not rk.HAS_C_EXTENSION\n"
        "x, b, dy = torch.randn(5, 7), torch.randn(7), torch.randn(5, 7)\n"
        "assert torch.equal(torch.ops.revkernels.bias_gelu(x, b, 'tanh'), bias_gelu_reference(x, b, 'tanh'))\n"
        "dx, db = torch.ops.revkernels.bias_gelu_bwd(dy, x, b)\n"
        "rdx, rdb = bias_gelu_bwd_reference(dy, x, b)\n"
        "assert torch.equal(dx, rdx) and torch.equal(db, rdb)\n"
        "xg, bg = x.clone().requires_grad_(), b.clone().requires_grad_()\n"
        "bias_gelu(xg, bg).backward(dy)\n"
        "assert torch.equal(xg.grad, rdx) and torch.equal(bg.grad, rdb)\n"
        "xd, bd = x.double().requires_grad_(), b.double().requires_grad_()\n"
        "assert torch.autograd.gradgradcheck(lambda a, c: bias_gelu(a, c, 'tanh'), (xd, bd))\n"
        "expect_error(lambda: torch.ops.revkernels.bias_gelu(x, torch.randn(6)), 'bias must have shape')\n"
        "print('ok')\n"
    )


def test_reference_fallback_is_checked():
    # The kernels registered from Python (CPU fallback, CUDA) run the same checks as the C++ glue.
    from revkernels.ops.bias_gelu import _bias_gelu_bwd_checked_reference, _bias_gelu_checked_reference

    with pytest.raises(ValueError, match="bias must have shape"):
        _bias_gelu_checked_reference(torch.randn(3, 4), torch.randn(5))
    with pytest.raises(TypeError, match="dy must have the dtype of x"):
        _bias_gelu_bwd_checked_reference(torch.randn(3, 4).half(), torch.randn(3, 4), torch.randn(4))


# --- Triton kernels (under TRITON_INTERPRET=1 on CPU: fp32 only, small row counts) ----------------

TRITON_SHAPES = [(1, 33), (5, 1000), (3, 4097), (70, 33), (2, 3, 130)]


def _device():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
        return "cpu"
    return "cuda"


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("shape", TRITON_SHAPES)
def test_triton_kernels_match_float64(approximate, shape):
    from revkernels.triton import bias_gelu as triton_bias_gelu

    dy, x, bias = (t.to(_device()) for t in _inputs(shape))
    y_true, dx_true, dbias_true = _truth(dy, x, bias, approximate)
    y = triton_bias_gelu.bias_gelu(x, bias, approximate)
    dx, dbias = triton_bias_gelu.bias_gelu_bwd(dy, x, bias, approximate)
    assert y.dtype == dx.dtype == dbias.dtype == torch.float32
    assert y.shape == dx.shape == x.shape and dbias.shape == bias.shape and y.is_contiguous() and dx.is_contiguous()
    assert_close_rel(y, y_true, tol=1e-5, what="y")
    assert_close_rel(dx, dx_true, tol=1e-5, what="dx")
    assert_close_rel(dbias, dbias_true, tol=1e-5, what="dbias")


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("layout", ["transposed", "row-sliced", "every other row", "expanded rows"])
def test_triton_non_contiguous(approximate, layout):
    from revkernels.triton import bias_gelu as triton_bias_gelu

    dy, x, bias = (t.to(_device()) for t in _layouts(torch.float32)[layout])
    y_true, dx_true, dbias_true = _truth(dy, x, bias, approximate)
    assert_close_rel(triton_bias_gelu.bias_gelu(x, bias, approximate), y_true, tol=1e-5, what="y")
    dx, dbias = triton_bias_gelu.bias_gelu_bwd(dy, x, bias, approximate)
    assert_close_rel(dx, dx_true, tol=1e-5, what="dx")
    assert_close_rel(dbias, dbias_true, tol=1e-5, what="dbias")


@pytest.mark.parametrize("approximate", APPROX)
def test_triton_row_loop_and_fp64_accumulation(approximate, monkeypatch):
    # Few row programs, so each loops over several row tiles; and an fp64 bias (fp64 math).
    from revkernels.triton import bias_gelu as triton_bias_gelu

    monkeypatch.setattr(triton_bias_gelu, "MAX_ROW_PROGRAMS", 3)
    dy, x, bias = (t.to(_device()) for t in _inputs((150, 40), torch.float32))
    _, dx_true, dbias_true = _truth(dy, x, bias, approximate)
    dx, dbias = triton_bias_gelu.bias_gelu_bwd(dy, x, bias, approximate)
    assert_close_rel(dx, dx_true, tol=1e-5, what="dx")
    assert_close_rel(dbias, dbias_true, tol=1e-5, what="dbias")
    bias64 = bias.double()
    dx, dbias = triton_bias_gelu.bias_gelu_bwd(dy, x, bias64, approximate)
    assert dbias.dtype == torch.float64
    assert_close_rel(dbias, dbias_true, tol=1e-10, what="dbias (fp64)")
    assert_close_rel(triton_bias_gelu.bias_gelu(x, bias64, approximate),
                     _truth(dy, x, bias64, approximate)[0], tol=1e-7, what="y (fp64 bias)")


def test_triton_tile_shapes():
    """The H200-tuned tiles: forward 4096 elements up to 256 columns, backward 4096 up to 128
    columns, both 4 warps; narrow widths and few rows shrink the tile, never past the data."""
    from revkernels.triton import bias_gelu as B

    assert (B.FWD_TILE, B.FWD_MAX_BLOCK_N, B.BWD_TILE, B.BWD_MAX_BLOCK_N) == (4096, 256, 4096, 128)
    assert B.NUM_WARPS == 4 and B.MAX_ROW_PROGRAMS == 256
    assert B._fwd_blocks(32768, 4096) == (16, 256) and B._bwd_blocks(32768, 4096) == (32, 128)
    assert B._fwd_blocks(12608, 3072) == (16, 256) and B._bwd_blocks(12608, 3072) == (32, 128)
    assert B._fwd_blocks(4096, 33) == (64, 64) and B._bwd_blocks(4096, 33) == (64, 64)
    assert B._fwd_blocks(4096, 8) == (256, 16)  # at least 16 columns
    assert B._fwd_blocks(1, 1000) == (1, 256) and B._bwd_blocks(7, 1000) == (8, 128)


@pytest.mark.parametrize("approximate", APPROX)
def test_triton_launch_configs(approximate, monkeypatch):
    """The wrappers launch the forward with _fwd_blocks and the backward with _bwd_blocks, NUM_WARPS each."""
    from revkernels.triton import bias_gelu as B

    log = []

    class Log:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                log.append((self.name, grid, kwargs.get("BLOCK_M"), kwargs.get("BLOCK_N"), kwargs.get("num_warps")))
                return launch(*args, **kwargs)
            return run

    monkeypatch.setattr(B, "_bias_gelu_kernel", Log(B._bias_gelu_kernel, "fwd"))
    monkeypatch.setattr(B, "_bias_gelu_bwd_kernel", Log(B._bias_gelu_bwd_kernel, "bwd"))
    rows, n = 40, 300
    dy, x, bias = (t.to(_device()) for t in _inputs((rows, n), torch.float32))
    y_true, dx_true, dbias_true = _truth(dy, x, bias, approximate)
    assert_close_rel(B.bias_gelu(x, bias, approximate), y_true, tol=1e-5, what="y")
    dx, dbias = B.bias_gelu_bwd(dy, x, bias, approximate)
    assert_close_rel(dx, dx_true, tol=1e-5, what="dx")
    assert_close_rel(dbias, dbias_true, tol=1e-5, what="dbias")
    assert log == [("fwd", (3, 2), 16, 256, 4), ("bwd", (2, 3), 32, 128, 4)]


def test_triton_empty():
    from revkernels.triton import bias_gelu as triton_bias_gelu

    x, bias = torch.randn(0, 5, device=_device()), torch.randn(5, device=_device())
    assert triton_bias_gelu.bias_gelu(x, bias).shape == (0, 5)
    dx, dbias = triton_bias_gelu.bias_gelu_bwd(x.clone(), x, bias)
    assert dx.shape == (0, 5) and torch.equal(dbias.cpu(), torch.zeros(5))


# --- GPU: both CUDA backends through torch.ops ----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 33), (257, 1000), (64, 4097), (4, 2048, 768)])
def test_cuda_backends(backend, approximate, dtype, shape):
    from revkernels.ops import _library

    assert has_compiled_kernel("bias_gelu", "CUDA") and has_compiled_kernel("bias_gelu_bwd", "CUDA")
    dy, x, bias = (t.cuda() for t in _inputs(shape, dtype))
    previous = _library.get_cuda_backend()
    _library.set_cuda_backend(backend)
    try:
        y = torch.ops.revkernels.bias_gelu(x, bias, approximate)
        dx, dbias = torch.ops.revkernels.bias_gelu_bwd(dy, x, bias, approximate)
        x_t, dy_t, bias_t = x[..., 1:], dy[..., 1:], bias[1:]  # row-strided views
        y_t = torch.ops.revkernels.bias_gelu(x_t, bias_t, approximate)
        dx_t, dbias_t = torch.ops.revkernels.bias_gelu_bwd(dy_t, x_t, bias_t, approximate)
    finally:
        _library.set_cuda_backend(previous)
    assert y.dtype == dx.dtype == dbias.dtype == dtype and y.is_contiguous() and dx.is_contiguous()
    for (got_y, got_dx, got_dbias), args in (((y, dx, dbias), (dy, x, bias)),
                                              ((y_t, dx_t, dbias_t), (dy_t, x_t, bias_t))):
        if dtype != torch.float32:
            _check_low_precision_rule(got_y, got_dx, got_dbias, *args, approximate)
            continue
        y_true, dx_true, dbias_true = _truth(*args, approximate)
        assert_close_rel(got_y, y_true, tol=1e-5, what="y")
        assert_close_rel(got_dx, dx_true, tol=1e-5, what="dx")
        assert_close_rel(got_dbias, dbias_true, tol=1e-5, what="dbias")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_cuda_opcheck_and_autograd(backend):
    from revkernels.ops import _library

    previous = _library.get_cuda_backend()
    _library.set_cuda_backend(backend)
    try:
        x = _random((16, 33)).cuda().requires_grad_()
        bias = _random(33).cuda().requires_grad_()
        torch.library.opcheck(torch.ops.revkernels.bias_gelu.default, (x, bias, "tanh"))
        torch.library.opcheck(torch.ops.revkernels.bias_gelu_bwd.default,
                              (torch.randn(16, 33, device="cuda"), x.detach(), bias.detach(), "none"))
        xd = _random((4, 7), torch.float64).cuda().requires_grad_()
        bd = _random(7, torch.float64).cuda().requires_grad_()
        assert torch.autograd.gradcheck(lambda a, b: torch.ops.revkernels.bias_gelu(a, b), (xd, bd))
        dy, x0, b0 = (t.cuda() for t in _inputs((4096, 1000)))  # dbias reproducible run to run
        first = torch.ops.revkernels.bias_gelu_bwd(dy, x0, b0)
        torch.testing.assert_close(torch.ops.revkernels.bias_gelu_bwd(dy, x0, b0), first, rtol=0, atol=0)
    finally:
        _library.set_cuda_backend(previous)
