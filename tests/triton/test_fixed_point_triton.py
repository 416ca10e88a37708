"""The Triton kernel of the fixed-point ops (revkernels/triton/fixed_point.py) against the
references, bit for bit, under TRITON_INTERPRET=1 on CPU (tests/conftest.py; no bf16 arithmetic
there, so bf16 runs only on CUDA: tests/ops/test_fixed_point.py) or on CUDA."""
import math

import pytest
import torch

from revkernels.ops.fixed_point import (fixed_point_add_reference, fixed_point_from_float_reference,
                                        fixed_point_sub_reference, fixed_point_view_reference)
from tests.helpers import triton_device
from tests.ops.test_fixed_point import _branch, _flag_cases, _stream

DTYPES = [torch.float32, torch.float64, torch.float16]  # (no bf16 under the interpreter)
# The interpreter's numpy warns where a branch value times 2^bits or an fp16 view overflows to inf:
# the semantics (flagged; the view's inf), not a failure.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _kernel():
    from revkernels.triton import fixed_point

    return fixed_point


def _equal(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what} output {i}"
        assert torch.equal(g.cpu(), w.cpu()), f"{what} output {i} differs at {(g.cpu() != w.cpu()).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("f_dtype", DTYPES)
@pytest.mark.parametrize("view_dtype", DTYPES)
def test_steps_match_reference(f_dtype, view_dtype):
    k, device = _kernel(), triton_device()
    for shape, bits in [((), 32), ((0, 3), 32), ((7,), 1), ((3, 1001), 60), ((2100,), 32)]:  # 2100: two programs
        x, f = _stream(shape).to(device), _branch(shape, f_dtype, bits).to(device)
        if f.numel() > 4:
            f.view(-1)[3] = math.nan
        for op, reference in ((k.ADD, fixed_point_add_reference), (k.SUB, fixed_point_sub_reference)):
            got = k.fixed_point(op, x, f, bits, view_dtype)
            _equal(got, reference(x, f, bits, view_dtype), f"op {op} {shape} bits={bits}")
            assert got[1].stride() == torch.empty_like(x).stride()


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_float_and_view_match_reference(dtype):
    k, device = _kernel(), triton_device()
    for shape, bits in [((), 32), ((9,), 1), ((5, 31), 60)]:
        f = _branch(shape, dtype, bits).to(device)
        _equal(k.fixed_point(k.FROM_FLOAT, None, f, bits, None), fixed_point_from_float_reference(f, bits), "from")
        x = _stream(shape, 2 ** 62).to(device)
        view, out, flag = k.fixed_point(k.VIEW, x, None, bits, dtype)
        assert out is None and flag is None
        assert torch.equal(view.cpu(), fixed_point_view_reference(x, bits, dtype).cpu())


def test_ties_and_the_double_rounding_of_the_view():
    k, device = _kernel(), triton_device()
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, -0.25, -0.75, -1.25, -1.75], device=device)
    for dtype in DTYPES:
        got = k.fixed_point(k.FROM_FLOAT, None, ties.to(dtype), 1, None)[1]
        assert got.tolist() == [0, 2, 2, 4, 0, -2, -2, -4], dtype
    n = torch.tensor([2 ** 60 + 2 ** 36 + 1, -(2 ** 60 + 2 ** 36 + 1)], device=device)
    view = k.fixed_point(k.VIEW, n, None, 7, torch.float32)[0]
    assert view.tolist() == [math.ldexp(2 ** 60 + 2 ** 37, -7), -math.ldexp(2 ** 60 + 2 ** 37, -7)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 32, 60])
def test_overflow_is_flagged(dtype, bits):
    k, device = _kernel(), triton_device()
    for name, x0, f0, flagged in _flag_cases(dtype, bits):
        x = torch.zeros(2100, dtype=torch.int64)
        f = torch.full((2100,), 0.5, dtype=dtype)
        x[2050], f[2050] = x0, f0  # in the second program
        got = k.fixed_point(k.ADD, x.to(device), f.to(device), bits, torch.float32)
        _equal(got, fixed_point_add_reference(x, f, bits, torch.float32), name)
        assert got[2].item() is flagged, (name, dtype, bits)
        got = k.fixed_point(k.SUB, x.to(device), (-f).to(device), bits, torch.float32)
        assert got[2].item() is flagged, (name, dtype, bits)


def test_layouts_are_copied_into_the_outputs_layout():
    k, device = _kernel(), triton_device()
    cases = [
        (_stream((40, 33)).t(), _branch((33, 40), torch.float32)),
        (_stream((30, 70))[::2, 3:], _branch((15, 67), torch.float32)),
        (_stream((9, 33)), _branch((1, 33), torch.float64).expand(9, 33)),
        (_stream((2, 3, 8, 8)).to(memory_format=torch.channels_last)[:, :, ::2], _branch((2, 3, 4, 8), torch.float16)),
    ]
    for x, f in cases:
        x, f = x.to(device), f.to(device)
        x_before, f_before = x.clone(), f.clone()
        got = k.fixed_point(k.SUB, x, f, 32, torch.float32)
        _equal(got, fixed_point_sub_reference(x, f, 32, torch.float32), "layout")
        assert got[0].stride() == got[1].stride() == torch.empty_like(x).stride()
        assert torch.equal(x, x_before) and torch.equal(f, f_before)
