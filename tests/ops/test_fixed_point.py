"""revkernels::fixed_point_* (exact mode's int64 streams) against their pure-PyTorch references,
bit for bit (outputs and the overflow flag), and the references against Python-integer arithmetic.
The Triton kernel: tests/triton/test_fixed_point_triton.py."""
import fractions
import math
import os
import subprocess
import sys

import pytest
import torch

import revkernels as rk
from revkernels.ops import (fixed_point_add, fixed_point_add_reference, fixed_point_from_float,
                            fixed_point_from_float_reference, fixed_point_sub, fixed_point_sub_reference,
                            fixed_point_view, fixed_point_view_reference)
from revkernels.ops._library import has_compiled_kernel
from revkernels.ops.fixed_point import DEFAULT_BITS, quantize_reference
from tests.helpers import run_without_c_extension

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
NAMES = ["fixed_point_from_float", "fixed_point_add", "fixed_point_sub", "fixed_point_view"]
STEPS = [(fixed_point_add, fixed_point_add_reference, "x"), (fixed_point_sub, fixed_point_sub_reference, "y")]
LIMIT = 1 << 62


def _branch(shape, dtype, bits=DEFAULT_BITS):
    """Branch values over many scales (|q| < 2^59), with exact ties (k + 1/2) · 2^-bits every 5th element."""
    n = math.prod(shape)
    v = torch.randn(n, dtype=torch.float64).clamp(-4, 4) * 2.0 ** torch.randint(-40, min(12, 57 - bits), (n,))
    ties = (torch.randint(-1000, 1000, (n,)) + 0.5) * 2.0 ** -bits
    v = torch.where(torch.arange(n) % 5 == 0, ties, v)
    return v.to(dtype).reshape(shape)


def _stream(shape, scale=2 ** 60):
    return torch.randint(-scale, scale, shape, dtype=torch.int64)


def _assert_equal(got, want, what=""):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what} output {i}: {g.dtype}{tuple(g.shape)}"
        assert torch.equal(g, w), f"{what} output {i} differs at {(g != w).nonzero()[:5].tolist()}"


def test_cpu_kernels_are_compiled():
    # CI builds the C++ library; without it every test below would only test the fallback.
    assert rk.HAS_C_EXTENSION, rk._extension.C_EXTENSION_ERROR
    assert all(has_compiled_kernel(name, "CPU") for name in NAMES)
    assert has_compiled_kernel("fixed_point_add", "Autograd") and has_compiled_kernel("fixed_point_sub", "Autograd")


def test_schema_defaults_are_the_python_ones():
    for name in NAMES:
        args = {a.name: a for a in getattr(torch.ops.revkernels, name).default._schema.arguments}
        assert args["bits"].default_value == DEFAULT_BITS, name
    R, x = torch.ops.revkernels, torch.randn(9, dtype=torch.float64)
    assert R.fixed_point_add(R.fixed_point_from_float(x)[1], x)[0].dtype == torch.float32
    assert R.fixed_point_view(R.fixed_point_from_float(x)[1]).dtype == torch.float32
    x = torch.randn(9)
    _assert_equal(fixed_point_from_float(x), fixed_point_from_float_reference(x, DEFAULT_BITS))
    s = fixed_point_from_float(x)[1]
    _assert_equal(fixed_point_add(s, x), fixed_point_add_reference(s, x, DEFAULT_BITS, torch.float32))
    assert torch.equal(fixed_point_view(s), fixed_point_view_reference(s, DEFAULT_BITS, torch.float32))


# --- the references against Python-integer arithmetic -----------------------------------------------

def _q_exact(v, bits):
    """(q, bad) of one float value, with Python fractions: round(v · 2^bits) half to even."""
    if not math.isfinite(v) or not abs(fractions.Fraction(v) * 2 ** bits) < LIMIT:
        return 0, True
    return round(fractions.Fraction(v) * 2 ** bits), False  # Fraction rounds half to even


def _rounded(n, precision):
    """The integer n rounded to `precision` significant bits, half to even."""
    drop = abs(n).bit_length() - precision
    if drop <= 0:
        return n
    q, r = divmod(abs(n), 1 << drop)
    if r > 1 << (drop - 1) or (r == 1 << (drop - 1) and q & 1):
        q += 1
    return (q << drop) * (1 if n > 0 else -1)


def _view_exact(n, bits, dtype):
    """view(n) from the integer rounded once to fp32's (fp64's) 24 (53) bits, scaled exactly."""
    wide = _rounded(n, 53 if dtype == torch.float64 else 24)
    return torch.tensor(math.ldexp(wide, -bits), dtype=torch.float64).to(dtype)  # fp32-exact: rounds once


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 3, 32, 60])
def test_reference_quantize_is_round_half_even_of_the_exact_product(dtype, bits):
    edges = [2.0 ** (62 - bits), -(2.0 ** (62 - bits)), math.inf, -math.inf, math.nan, 1e300, 3e38, 65504.0]
    if dtype in (torch.float32, torch.float64):  # the largest value below 2^62 / 2^bits
        edges.append(torch.tensor(2.0 ** (62 - bits), dtype=dtype).nextafter(torch.tensor(0.0, dtype=dtype)).item())
    values = torch.cat([_branch((40,), dtype, bits),
                        (torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.0, -0.0], dtype=torch.float64)
                         * 2.0 ** -bits).to(dtype),
                        torch.tensor(edges, dtype=torch.float64).to(dtype)])
    q, bad = quantize_reference(values, bits)
    for v, qi, bi in zip(values.tolist(), q.tolist(), bad.tolist()):
        assert (qi, bi) == _q_exact(v, bits), (v, bits)


def test_reference_ties_round_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, -0.25, -0.75, -1.25, -1.75])  # x · 2 = ±(k + 1/2)
    assert fixed_point_from_float_reference(x, 1)[1].tolist() == [0, 2, 2, 4, 0, -2, -2, -4]
    assert fixed_point_from_float(x, 1)[1].tolist() == [0, 2, 2, 4, 0, -2, -2, -4]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_view_rounds_the_integer_once(dtype):
    # 2^60 + 2^36 + 1 is nearest 2^60 + 2^37 in fp32; through fp64 first (2^60 + 2^36, a tie) it
    # would become 2^60.
    n = 2 ** 60 + 2 ** 36 + 1
    x = torch.tensor([n])
    assert fixed_point_view_reference(x, 7, torch.float32).item() == math.ldexp(2 ** 60 + 2 ** 37, -7)
    assert fixed_point_view(x, 7, torch.float32).item() == math.ldexp(2 ** 60 + 2 ** 37, -7)
    assert fixed_point_view_reference(x, 7, torch.float64).item() == math.ldexp(2 ** 60 + 2 ** 36, -7)
    values = [n, -n, 2 ** 62 - 1, -(2 ** 62) + 1, 2 ** 53 + 1, 2 ** 24 + 1, 3, -1, 0, 2 ** 40 + 2 ** 16,
              *torch.randint(-2 ** 62, 2 ** 62, (20,)).tolist()]
    for bits in (1, 7, 32, 60):
        got = fixed_point_view_reference(torch.tensor(values), bits, dtype)
        want = torch.stack([_view_exact(v, bits, dtype) for v in values])
        assert torch.equal(got, want), (bits, dtype)
        assert torch.equal(fixed_point_view(torch.tensor(values), bits, dtype), want), (bits, dtype)


def test_reference_flags_exactly_at_the_limit():
    # |Y| >= 2^62 flags; 2^62 - 1 (which fp32 would round to 2^62) does not.
    for bits in (1, 32):
        one = torch.tensor([2.0 ** -bits])
        for x, op, flagged in [(LIMIT - 1, fixed_point_add_reference, True), (LIMIT - 2, fixed_point_add_reference,
                                                                                False),
                               (-LIMIT + 1, fixed_point_sub_reference, True), (-LIMIT + 2, fixed_point_sub_reference,
                                                                                 False)]:
            out = op(torch.tensor([x]), one, bits, torch.float32)
            assert out[2].item() is flagged, (x, bits)


# --- the ops against the references ----------------------------------------------------------------

@pytest.mark.parametrize("f_dtype", DTYPES)
@pytest.mark.parametrize("view_dtype", DTYPES)
@pytest.mark.parametrize("op,reference,first", STEPS)
def test_steps_match_reference(f_dtype, view_dtype, op, reference, first):
    # 0-dim, empty, vector tails
    for shape, bits in [((), 32), ((0,), 32), ((0, 5), 7), ((1,), 1), ((7,), 60), ((3, 33), 32), ((2, 501), 20)]:
        x, f = _stream(shape), _branch(shape, f_dtype, bits)
        got = op(x, f, bits, view_dtype)
        _assert_equal(got, reference(x, f, bits, view_dtype), f"{op.__name__} {shape} bits={bits}")
        assert got[0].dtype == view_dtype and got[2].shape == () and got[2].dtype == torch.bool


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,reference,first", STEPS)
def test_large_odd_calls_split_across_threads(dtype, op, reference, first):
    x, f = _stream((70001,)), _branch((70001,), dtype, 20)  # > the grain size (32768): two threads' ranges
    _assert_equal(op(x, f, 20, dtype), reference(x, f, 20, dtype), op.__name__)


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_float_and_view_match_reference(dtype):
    for shape, bits in [((), 32), ((0,), 32), ((9,), 1), ((5, 31), 60), ((70001,), 32)]:
        x = _branch(shape, dtype, bits)
        _assert_equal(fixed_point_from_float(x, bits), fixed_point_from_float_reference(x, bits), f"{shape}")
        s = _stream(shape, 2 ** 62)
        got = fixed_point_view(s, bits, dtype)
        assert torch.equal(got, fixed_point_view_reference(s, bits, dtype)) and got.dtype == dtype


def _layouts(dtype):
    """(name, stream, branch) pairs: non-contiguous, expanded and misaligned inputs."""
    s, b = _stream, lambda shape: _branch(shape, dtype)

    def misaligned(t):  # data at an odd byte offset (not a multiple of the element size)
        raw = torch.zeros(t.numel() * t.element_size() + 1, dtype=torch.uint8)
        view = torch.frombuffer(memoryview(raw.numpy()), dtype=t.dtype, offset=1, count=t.numel()).view(t.shape)
        return view.copy_(t)

    reverse = list(reversed(range(13)))
    return [
        ("transposed", s((33, 64)).t(), b((64, 33))),
        ("sliced", s((40, 90))[::3, 1::2], b((14, 90))[:, ::2]),
        ("expanded f", s((20, 31)), b((1, 31)).expand(20, 31)),
        ("expanded x", s((1, 31)).expand(20, 31), b((20, 31))),
        ("channels_last", s((2, 5, 6, 7)).to(memory_format=torch.channels_last), b((2, 5, 6, 7))),
        ("permuted", s((6, 5, 4)).permute(2, 0, 1), b((5, 4, 6)).permute(1, 2, 0)),
        ("misaligned", misaligned(s((3, 37))), misaligned(b((3, 37)))),
        ("13 unmergeable dims", s([2] * 13).permute(reverse), b([2] * 13)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_non_contiguous_expanded_and_misaligned_inputs(dtype):
    for name, x, f in _layouts(dtype):
        x_before, f_before = x.clone(), f.clone()
        for op, reference, _ in STEPS:
            got = op(x, f, 32, torch.float16)
            _assert_equal(got, reference(x, f, 32, torch.float16), f"{name} {op.__name__}")
            assert got[0].stride() == got[1].stride() == torch.empty_like(x).stride(), name  # the fake's layout
        got = fixed_point_from_float(f, 32)
        _assert_equal(got, fixed_point_from_float_reference(f, 32), f"{name} from_float")
        assert got[0].stride() == got[1].stride() == torch.empty_like(f).stride(), name
        got = fixed_point_view(x, 32, dtype)
        assert torch.equal(got, fixed_point_view_reference(x, 32, dtype)), name
        assert got.stride() == torch.empty_like(x).stride(), name
        assert torch.equal(x, x_before) and torch.equal(f, f_before), f"{name}: an input was changed"


# --- overflow -------------------------------------------------------------------------------------

def _flag_cases(dtype, bits):
    """(name, x, f, flagged): one value at the edge; `flagged` from Python-integer arithmetic."""
    step = 2 ** bits  # q(1.0)
    cases = [("fine", 12345, 0.75), ("inf", 0, math.inf), ("-inf", 0, -math.inf), ("nan", 0, math.nan),
             ("largest float", 0, torch.finfo(dtype).max), ("result 2^62", LIMIT - step, 1.0),
             ("result -2^62", -LIMIT + step, -1.0), ("result 2^62 - 1", LIMIT - 1 - step, 1.0),
             ("result -(2^62 - 1)", -LIMIT + 1 + step, -1.0), ("branch 2^62", 0, 2.0 ** (62 - bits))]
    if dtype in (torch.float32, torch.float64):
        below = torch.tensor(2.0 ** (62 - bits), dtype=dtype).nextafter(torch.tensor(0.0, dtype=dtype)).item()
        cases.append(("branch below 2^62", 0, below))
    out = []
    for name, x0, f0 in cases:
        q, bad = _q_exact(torch.tensor(f0, dtype=torch.float64).to(dtype).item(), bits)
        out.append((name, x0, f0, bad or abs(x0 + q) >= LIMIT))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 32, 60])
def test_overflow_is_flagged(dtype, bits):
    cases = _flag_cases(dtype, bits)
    assert {name for name, *_, flagged in cases if flagged} >= {"inf", "-inf", "nan", "result 2^62", "result -2^62"}
    assert {name for name, *_, flagged in cases if not flagged} >= {"fine", "result 2^62 - 1", "result -(2^62 - 1)"}
    for position in (0, 8, 36):  # first lane, a second vector, a tail
        for name, x0, f0, flagged in cases:
            x = torch.zeros(37, dtype=torch.int64)
            f = torch.full((37,), 0.5, dtype=dtype)
            x[position], f[position] = x0, f0
            what = f"{name} at {position} (bits {bits}, {dtype})"
            got = fixed_point_add(x, f, bits, torch.float32)
            _assert_equal(got, fixed_point_add_reference(x, f, bits, torch.float32), what)
            assert got[2].item() is flagged, what
            if not math.isfinite(f0):
                assert got[1][position].item() == x0  # q = 0 where flagged
            neg = fixed_point_sub(x, -f, bits, torch.float32)  # q(-f) = -q(f): the same sum
            _assert_equal(neg, fixed_point_sub_reference(x, -f, bits, torch.float32), f"sub {what}")
            assert neg[2].item() is flagged, f"sub {what}"
            if x0 == 0:
                fl = fixed_point_from_float(f, bits)
                _assert_equal(fl, fixed_point_from_float_reference(f, bits), f"from_float {what}")
                assert fl[2].item() is flagged, f"from_float {what}"


def test_flag_of_a_large_call_comes_from_every_thread():
    x = torch.zeros(100_000, dtype=torch.int64)
    f = torch.zeros(100_000)
    for position in (0, 50_000, 99_999):
        f.zero_()
        f[position] = math.nan
        assert fixed_point_add(x, f)[2].item() and fixed_point_from_float(f)[2].item(), position
    f.zero_()
    assert not fixed_point_add(x, f)[2].item()


@pytest.mark.parametrize("f_dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 32, 60])
def test_sub_inverts_add_exactly(f_dtype, bits):
    x = _stream((5, 301))
    f = _branch((5, 301), f_dtype, bits)
    view, y, overflow = fixed_point_add(x, f, bits, torch.bfloat16)
    assert not overflow.item()
    back = fixed_point_sub(y, f, bits, torch.bfloat16)
    assert torch.equal(back[1], x) and torch.equal(back[0], fixed_point_view(x, bits, torch.bfloat16))


# --- arguments, autograd, registrations -----------------------------------------------------------

def _bad_calls():
    s, f = torch.zeros(3, 4, dtype=torch.int64), torch.randn(3, 4)
    return [
        (TypeError, "x must be an int64 fixed-point stream", lambda: fixed_point_add(f, f)),
        (TypeError, "y must be an int64 fixed-point stream", lambda: fixed_point_sub(s.int(), f)),
        (TypeError, "f must be float32, float64, float16 or bfloat16", lambda: fixed_point_add(s, s)),
        (TypeError, "x must be float32, float64, float16 or bfloat16", lambda: fixed_point_from_float(s)),
        (TypeError, "x must be an int64 fixed-point stream", lambda: fixed_point_view(f)),
        (TypeError, "dtype must be float32, float64, float16 or bfloat16", lambda: fixed_point_add(s, f, 32, torch.int64)),
        (TypeError, "dtype must be float32, float64, float16 or bfloat16", lambda: fixed_point_view(s, 32, torch.int32)),
        (ValueError, "bits must be in [1, 60]", lambda: fixed_point_add(s, f, 0)),
        (ValueError, "bits must be in [1, 60]", lambda: fixed_point_sub(s, f, 61)),
        (ValueError, "bits must be in [1, 60]", lambda: fixed_point_from_float(f, -3)),
        (ValueError, "bits must be in [1, 60]", lambda: fixed_point_view(s, 64)),
        (TypeError, "bits must be an int", lambda: fixed_point_add(s, f, True)),
        (TypeError, "bits must be an int", lambda: fixed_point_from_float(f, bits=False)),
        (TypeError, "bits must be an int", lambda: fixed_point_view(s, 2.5)),
        (ValueError, "f must have the shape of x", lambda: fixed_point_add(s, f.t())),
        (ValueError, "f must have the shape of y", lambda: fixed_point_sub(s, f[0])),
        (ValueError, "f must be on the device of x", lambda: fixed_point_add(s, torch.randn(3, 4, device="meta"))),
        (ValueError, "f must be on the device of y", lambda: fixed_point_sub(s, torch.randn(3, 4, device="meta"))),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_arguments_name_the_argument(case):
    error, message, call = _bad_calls()[case]
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        call()


def test_torch_ops_check_in_cpp():
    # The registered ops called directly (no Python checks first) name the argument too.
    R, s, f = torch.ops.revkernels, torch.zeros(3, 4, dtype=torch.int64), torch.randn(3, 4)
    for error, message, call in [
            (ValueError, "f must have the shape of y", lambda: R.fixed_point_sub(s, f.t())),
            (TypeError, "x must be an int64 fixed-point stream", lambda: R.fixed_point_add(f, f)),
            (TypeError, "f must be float32", lambda: R.fixed_point_add(s, s)),
            (ValueError, r"bits must be in \[1, 60\]", lambda: R.fixed_point_view(s, 0)),
            (TypeError, "dtype must be float32", lambda: R.fixed_point_view(s, 32, torch.int64)),
            (TypeError, "x must be float32", lambda: R.fixed_point_from_float(s, 32))]:
        with pytest.raises(error, match=message):
            call()


def _opcheck_args():
    s = _stream((4, 9), 2 ** 40)
    return {
        "fixed_point_from_float": [(torch.randn(4, 9), 32), (torch.randn(9, 4).t().bfloat16(), 7)],
        "fixed_point_add": [(s, torch.randn(4, 9), 32, torch.float32),
                            (s, torch.randn(4, 9).bfloat16().requires_grad_(), 20, torch.float64)],
        "fixed_point_sub": [(s.t(), torch.randn(9, 4, dtype=torch.float64), 32, torch.float16),
                            (s, torch.randn(4, 9, requires_grad=True), 32, torch.bfloat16)],
        "fixed_point_view": [(s, 32, torch.float32), (s.t(), 60, torch.float16)],
    }


@pytest.mark.parametrize("name", NAMES)
def test_opcheck(name):
    for args in _opcheck_args()[name]:
        torch.library.opcheck(getattr(torch.ops.revkernels, name).default, args)


@pytest.mark.parametrize("op,sign", [(fixed_point_add, 1.0), (fixed_point_sub, -1.0)])
def test_straight_through_gradient(op, sign):
    x = _stream((6, 5), 2 ** 40)
    f = torch.randn(6, 5).bfloat16().requires_grad_()
    view, stream, overflow = op(x, f, 32, torch.float32)
    assert view.requires_grad and not stream.requires_grad and not overflow.requires_grad
    g = torch.randn(6, 5)
    (df,) = torch.autograd.grad(view, f, g)
    assert df.dtype == torch.bfloat16 and torch.equal(df, (sign * g).bfloat16())
    with torch.no_grad():
        assert not op(x, f, 32, torch.float32)[0].requires_grad


def test_caller_tensors_are_not_mutated():
    x, f = _stream((4, 17)), torch.randn(4, 17)
    x_before, f_before = x.clone(), f.clone()
    for call in (lambda: fixed_point_add(x, f), lambda: fixed_point_sub(x, f), lambda: fixed_point_view(x),
                 lambda: fixed_point_from_float(f)):
        call()
        assert torch.equal(x, x_before) and torch.equal(f, f_before)


def test_every_isa_build_matches_reference():
    """The tests above under the scalar builds (ATEN_CPU_CAPABILITY=default, avx2: no vector path),
    each in a subprocess; this process runs the widest (the AVX-512 kernels on an AVX-512 CPU)."""
    code = (
        "import itertools, sys, torch\n"
        "import revkernels as rk\n"
        "import tests.ops.test_fixed_point as t\n"
        "torch.manual_seed(int(sys.argv[1]))\n"
        "t.test_reference_ties_round_to_even()\n"
        "t.test_flag_of_a_large_call_comes_from_every_thread()\n"
        "for dtype in t.DTYPES:\n"
        "    t.test_reference_view_rounds_the_integer_once(dtype)\n"
        "    t.test_from_float_and_view_match_reference(dtype)\n"
        "    for bits in (1, 32, 60):\n"
        "        t.test_overflow_is_flagged(dtype, bits)\n"
        "    for (op, reference, first), view_dtype in itertools.product(t.STEPS, t.DTYPES):\n"
        "        t.test_steps_match_reference(dtype, view_dtype, op, reference, first)\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    t.test_non_contiguous_expanded_and_misaligned_inputs(dtype)\n"
        "print(rk._C.cpu_kernel_build())\n")
    seed = str(torch.randint(2 ** 31, ()).item())
    runs = {cap: subprocess.Popen([sys.executable, "-c", code, seed], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, "ATEN_CPU_CAPABILITY": cap})
            for cap in ("default", "avx2")}
    for cap, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, f"{cap}: {err[-3000:]}"
        # (the AVX2 build runs where the CPU has AVX2: here it must be the one chosen)
        avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        assert out.split()[-1] == ("AVX2" if cap == "avx2" and avx2 else "DEFAULT"), out


def test_pure_pytorch_fallback_when_library_missing():
    # Without revkernels._C: the references (in the kernels' layouts), the Python checks, the
    # Python autograd formula.
    run_without_c_extension(
        "import torch, revkernels as rk\n"
        "from revkernels.ops import fixed_point as fp\n"
        "assert not rk.HAS_C_EXTENSION\n"
        "x, f = torch.randint(-2 ** 40, 2 ** 40, (7, 5)).t(), torch.randn(5, 7).bfloat16().requires_grad_()\n"
        "got, want = fp.fixed_point_sub(x, f, 20, torch.float16), fp.fixed_point_sub_reference(x, f, 20, torch.float16)\n"
        "assert all(torch.equal(a, b) for a, b in zip(got, want))\n"
        "assert got[1].stride() == torch.empty_like(x).stride()\n"
        "(df,) = torch.autograd.grad(got[0].float().sum(), f)\n"
        "assert torch.equal(df, -torch.ones(5, 7, dtype=torch.bfloat16))\n"
        "assert torch.equal(torch.ops.revkernels.fixed_point_view(x), fp.fixed_point_view_reference(x, 32, torch.float32))\n"
        "expect_error(lambda: torch.ops.revkernels.fixed_point_add(x, f[0]), 'f must have the shape of x')\n"
        "expect_error(lambda: fp.fixed_point_add(x, f, True), 'bits must be an int')\n"
        "expect_error(lambda: fp.fixed_point_from_float(x), 'x must be float32')\n"
        "print('ok')\n"
    )


# --- CUDA (Triton and CUDA C++ kernels) -----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("f_dtype", DTYPES)
@pytest.mark.parametrize("view_dtype", DTYPES)
def test_cuda_matches_reference(backend, f_dtype, view_dtype):
    from revkernels.ops import get_cuda_backend, set_cuda_backend

    assert has_compiled_kernel("fixed_point_add", "CUDA"), "CUDA C++ kernels were not built"
    previous = get_cuda_backend()
    set_cuda_backend(backend)
    try:
        for shape, layout in [((), "contiguous"), ((0, 3), "contiguous"), ((257, 1031), "contiguous"),
                              ((1031, 257), "transposed"), ((257, 1031), "expanded")]:
            x, f = _stream(shape), _branch(shape, f_dtype, 32)
            if f.numel() > 2:
                f.view(-1)[1], f.view(-1)[2] = math.nan, math.inf
            if layout == "transposed":
                x = x.t()
            elif layout == "expanded":
                f = f[:1].expand(shape)
            x, f = x.cuda(), f.cuda()
            for op, reference, _ in STEPS:
                got = op(x, f, 32, view_dtype)
                _assert_equal(got, reference(x, f, 32, view_dtype), f"{backend} {op.__name__} {shape} {layout}")
                assert got[2].device == x.device
            _assert_equal(fixed_point_from_float(f, 20), fixed_point_from_float_reference(f, 20), backend)
            assert torch.equal(fixed_point_view(x, 60, view_dtype), fixed_point_view_reference(x, 60, view_dtype))
    finally:
        set_cuda_backend(previous)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_cuda_overflow_and_rounding_edges(backend):
    from revkernels.ops import get_cuda_backend, set_cuda_backend

    previous = get_cuda_backend()
    set_cuda_backend(backend)
    try:
        for dtype in DTYPES:
            for bits in (1, 32, 60):
                for name, x0, f0, flagged in _flag_cases(dtype, bits):
                    x = torch.zeros(5000, dtype=torch.int64)
                    f = torch.full((5000,), 0.5, dtype=dtype)
                    x[4097], f[4097] = x0, f0
                    got = fixed_point_add(x.cuda(), f.cuda(), bits, torch.float32)
                    _assert_equal([t.cpu() for t in got], fixed_point_add_reference(x, f, bits, torch.float32), name)
                    assert got[2].item() is flagged, (backend, name, dtype, bits)
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, -0.25, -0.75, -1.25, -1.75], device="cuda")
        assert fixed_point_from_float(ties, 1)[1].tolist() == [0, 2, 2, 4, 0, -2, -2, -4]
        n = torch.tensor([2 ** 60 + 2 ** 36 + 1], device="cuda")
        assert fixed_point_view(n, 7).item() == math.ldexp(2 ** 60 + 2 ** 37, -7)
    finally:
        set_cuda_backend(previous)


@pytest.mark.gpu
def test_cuda_opcheck():
    for name, cases in _opcheck_args().items():
        for args in cases:
            args = tuple(a.detach().cuda().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                         for a in args)
            torch.library.opcheck(getattr(torch.ops.revkernels, name).default, args)
