"""The C++ CPU kernels under each instruction set they are built for (csrc/cpu/vec_kernels.cpp:
DEFAULT, AVX2, AVX512, picked at run time like ATen's kernels, so ATEN_CPU_CAPABILITY forces one;
"avx512" runs the AVX512_BF16 build on a CPU with avx512_bf16, which `revkernels.CPU_KERNEL_BUILD`
must report; a library built without the ISA builds (clang, not x86-64) runs DEFAULT under every
capability. csrc/tests/test_cpu_vec_ops.cpp calls all four builds directly).

Each ISA runs in a subprocess with ATEN_CPU_CAPABILITY set and checks every CPU op against an fp64
pure-PyTorch reference: widths that leave vector tails, row-sliced, broadcast and transposed inputs,
each dtype, and 1 against 3 threads (results must be bitwise equal: the reductions' order does not
depend on the thread count). Tolerances follow docs/design.md: fp32/fp64 relative error 1e-5 / 1e-12;
for fp16/bf16 at most 2x the error of the same computation rounded once from fp32 (the module's
reference), plus one unit in the last place of the output's scale. The subprocesses stream outputs
above 4 MiB (REVKERNELS_STREAM_ABOVE_BYTES) rather than above the last-level cache, which can be
hundreds of MiB: the streamed checks then take a few MiB rather than GiBs of fp64 references.
"""
import os
import platform
import subprocess
import sys
import sysconfig

import pytest
import torch
import torch.nn.functional as F

import revkernels as rk
from revkernels._extension import _C
from revkernels.ops.batch_norm import batch_norm_act_bwd_reference, batch_norm_act_reference
from revkernels.ops.bias_gelu import bias_gelu_bwd_reference, bias_gelu_reference
from revkernels.ops.coupling import coupling_add_reference, coupling_sub_reference
from revkernels.ops.layer_norm import layer_norm_bwd_add_reference, sub_layer_norm_reference
from tests.helpers import run_without_c_extension

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WIDTHS = (1, 17, 100, 769)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
STREAM_ABOVE_BYTES = 4 << 20


def _err(got, exact):
    exact = exact.double()
    return ((got.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30)).item()


def _check(got, exact, rounded_once, what):
    """got against exact (fp64); 16-bit outputs against 2x the error of rounded_once."""
    err = _err(got, exact)
    if got.dtype in TOL:
        assert err <= TOL[got.dtype], f"{what}: relative error {err:.3e}"
    else:
        bound = 2 * _err(rounded_once, exact) + torch.finfo(got.dtype).eps
        assert err <= bound, f"{what}: relative error {err:.3e} > {bound:.3e}"


def _inputs(rows, n, dtype, layout, gen):
    """(rows, n) tensors of dtype in a layout: contiguous, row-sliced from a wider buffer,
    transposed (no unit-stride view: the op copies) or a broadcast row."""
    def make(scale=1.0, shift=0.0):
        if layout == "sliced":
            t = torch.randn(rows, n + 7, generator=gen, dtype=torch.float64)[:, 3:n + 3]
        elif layout == "transposed":
            t = torch.randn(n, rows, generator=gen, dtype=torch.float64).t()
        elif layout == "broadcast":
            t = torch.randn(1, n, generator=gen, dtype=torch.float64).expand(rows, n)
        else:
            t = torch.randn(rows, n, generator=gen, dtype=torch.float64)
        return (t * scale + shift).to(dtype)
    return make


def _run_threads(fn):
    """fn() with 1 and with 3 threads; asserts the results are bitwise equal; returns them."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn()
        torch.set_num_threads(3)
        three = fn()
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(one, three):
        assert torch.equal(a, b), "results depend on the thread count"
    return one


def check_all():
    """Every CPU op against fp64 references under the current ISA (run by the subprocesses)."""
    ops = torch.ops.revkernels
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for n in WIDTHS:
            rows = 37
            for layout in ("contiguous", "sliced", "transposed", "broadcast"):
                make = _inputs(rows, n, dtype, layout, gen)
                y, g, dln, dres = make(3.0, 0.5), make(), make(), make()
                w, b = torch.randn(n, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
                what = f"{dtype} n={n} {layout}"

                (x,) = _run_threads(lambda: (ops.coupling_sub(y, g),))
                _check(x, y.double() - g.double(), coupling_sub_reference(y, g), f"coupling_sub {what}")
                (s,) = _run_threads(lambda: (ops.coupling_add(y, g),))
                _check(s, y.double() + g.double(), coupling_add_reference(y, g), f"coupling_add {what}")

                x, ln, mean, rstd = _run_threads(lambda: ops.sub_layer_norm(y, g, w, b, 1e-5))
                ref = sub_layer_norm_reference
                exact = ref(x.double(), torch.zeros((), dtype=torch.float64).expand(x.shape), w.double(), b.double(), 1e-5)
                _check(ln, exact[1], ref(x, torch.zeros_like(x), w, b, 1e-5)[1], f"sub_layer_norm ln {what}")
                _check(mean, exact[2], exact[2], f"sub_layer_norm mean {what}")
                _check(rstd, exact[3], exact[3], f"sub_layer_norm rstd {what}")

                got = _run_threads(lambda: ops.layer_norm_bwd_add(dln, x, w, mean, rstd, dres))
                ref = layer_norm_bwd_add_reference
                exact = ref(dln.double(), x.double(), w.double(), mean.double(), rstd.double(), dres.double())
                once = ref(dln, x, w, mean, rstd, dres)
                for t, e, o, name in zip(got, exact, once, ("dx", "dweight", "dbias")):
                    _check(t, e, o, f"layer_norm_bwd_add {name} {what}")

                for approx in ("none", "tanh"):
                    (out,) = _run_threads(lambda: (ops.bias_gelu(y, b, approx),))
                    _check(out, F.gelu(y.double() + b.double(), approximate=approx),
                           bias_gelu_reference(y, b, approx), f"bias_gelu {approx} {what}")
                    got = _run_threads(lambda: ops.bias_gelu_bwd(dln, y, b, approx))
                    ref = bias_gelu_bwd_reference
                    exact, once = ref(dln.double(), y.double(), b.double(), approx), ref(dln, y, b, approx)
                    for t, e, o, name in zip(got, exact, once, ("dx", "dbias")):
                        _check(t, e, o, f"bias_gelu_bwd {approx} {name} {what}")
        if dtype in (torch.float32, torch.bfloat16):
            _check_streamed(dtype, gen)
        if dtype == torch.float32:
            _check_wide_row(gen)
        # BatchNorm + ReLU: NCHW, channels_last, (N, C) and a permuted (copied) input.
        for shape, fmt in (((4, 19, 5, 7), "nchw"), ((4, 19, 5, 7), "channels_last"), ((33, 19), "nc"),
                           ((4, 5, 7, 19), "permuted")):
            xb = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 1).to(dtype)
            if fmt == "channels_last":
                xb = xb.contiguous(memory_format=torch.channels_last)
            elif fmt == "permuted":
                xb = xb.permute(0, 3, 1, 2)
            c = xb.shape[1]
            dout = torch.randn(xb.shape, generator=gen).to(dtype)
            w, b = torch.randn(c, generator=gen).to(dtype), torch.randn(c, generator=gen).to(dtype)
            what = f"{dtype} {fmt}"
            out, mean, rstd = _run_threads(lambda: ops.batch_norm_act(xb, w, b, 1e-5, True))
            ref = batch_norm_act_reference
            exact = ref(xb.double(), w.double(), b.double(), 1e-5, True)
            _check(out, exact[0], ref(xb, w, b, 1e-5, True)[0], f"batch_norm_act {what}")
            _check(mean, exact[1], exact[1], f"batch_norm_act mean {what}")
            _check(rstd, exact[2], exact[2], f"batch_norm_act rstd {what}")
            got = _run_threads(lambda: ops.batch_norm_act_bwd(dout, xb, w, b, mean, rstd, True))
            ref = batch_norm_act_bwd_reference
            exact = ref(dout.double(), xb.double(), w.double(), b.double(), mean.double(), rstd.double(), True)
            once = ref(dout, xb, w, b, mean, rstd, True)
            for t, e, o, name in zip(got, exact, once, ("dx", "dweight", "dbias")):
                _check(t, e, o, f"batch_norm_act_bwd {name} {what}")
    print("checked", torch.backends.cpu.get_cpu_capability(), "with the", rk.CPU_KERNEL_BUILD, "kernels")


def _check_streamed(dtype, gen):
    """coupling_sub and sub_layer_norm on data larger than the streaming threshold, which they write
    with streaming stores (rows of an odd width: the rows start at every alignment)."""
    ops = torch.ops.revkernels
    n = 769
    assert _C.stream_above_bytes() == STREAM_ABOVE_BYTES, "the subprocess streams above its own threshold"
    rows = STREAM_ABOVE_BYTES // (6 * n) + 1  # streamed even for 16-bit coupling (3 x 2 bytes an element)
    y = (torch.randn(rows, n, generator=gen) * 3 + 0.5).to(dtype)
    g, w, b = torch.randn(rows, n, generator=gen).to(dtype), torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    what = f"{dtype} {rows}x{n} (streamed)"
    # y - g is one fp32 subtraction rounded once to the dtype, so the values must be the reference's
    # bits (stricter than the fp64 bound, and without fp64 copies of tensors larger than the cache).
    want = coupling_sub_reference(y, g)
    (x,) = _run_threads(lambda: (ops.coupling_sub(y, g),))
    assert torch.equal(x, want), f"coupling_sub {what}"
    x, ln, mean, rstd = _run_threads(lambda: ops.sub_layer_norm(y, g, w, b, 1e-5))
    assert torch.equal(x, want), f"sub_layer_norm x {what}"
    exact = sub_layer_norm_reference(x.double(), torch.zeros((), dtype=torch.float64).expand(x.shape), w.double(),
                                     b.double(), 1e-5)
    once = sub_layer_norm_reference(x, torch.zeros_like(x), w, b, 1e-5)
    _check(ln, exact[1], once[1], f"sub_layer_norm ln {what}")
    _check(mean, exact[2], exact[2], f"sub_layer_norm mean {what}")
    _check(rstd, exact[3], exact[3], f"sub_layer_norm rstd {what}")


def _check_wide_row(gen):
    """sub_layer_norm and layer_norm_bwd_add on one fp32 row of 2^22 values away from zero: the row
    sums must not lose accuracy with the width (each of 16 fp32 lanes summed 2^18 terms: 3.4e-5)."""
    ops = torch.ops.revkernels
    n = 1 << 22
    y, g = torch.randn(1, n, generator=gen) + 10, torch.randn(1, n, generator=gen)
    w, b = 1 + 0.5 * torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    dln, dres = torch.randn(1, n, generator=gen), torch.randn(1, n, generator=gen)
    x, ln, mean, rstd = ops.sub_layer_norm(y, g, w, b, 1e-5)
    exact = sub_layer_norm_reference(x.double(), torch.zeros((), dtype=torch.float64).expand(x.shape), w.double(),
                                     b.double(), 1e-5)
    for got, e, name in zip((ln, mean, rstd), exact[1:], ("ln", "mean", "rstd")):
        _check(got, e, e, f"sub_layer_norm {name} float32 1x{n}")
    exact = layer_norm_bwd_add_reference(dln.double(), x.double(), w.double(), exact[2], exact[3], dres.double())
    got = ops.layer_norm_bwd_add(dln, x, w, mean, rstd, dres)
    for t, e, name in zip(got, exact, ("dx", "dweight", "dbias")):
        _check(t, e, e, f"layer_norm_bwd_add {name} float32 1x{n}")


def test_last_level_cache_bytes():
    """The cache size the streaming decision uses: sysfs's largest data/unified cache of CPU 0."""
    if not rk.HAS_C_EXTENSION:
        pytest.skip("revkernels._C is not built")
    caches = []
    root = "/sys/devices/system/cpu/cpu0/cache"
    for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, entry)
        if not entry.startswith("index"):
            continue
        with open(os.path.join(path, "type")) as t, open(os.path.join(path, "level")) as l, open(os.path.join(path, "size")) as z:
            kind, level, size = t.read().strip(), int(l.read()), z.read().strip()
        if kind != "Instruction":
            caches.append((level, int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]]))
    assert _C.last_level_cache_bytes() == (max(caches)[1] if caches else 0)


def _stream_above_bytes_with(value):
    """(stream_above_bytes() or the error's text, whether a coupling op raised) in a subprocess
    with REVKERNELS_STREAM_ABOVE_BYTES=value."""
    code = ("import torch, revkernels\nfrom revkernels._extension import _C\n"
            "try:\n    print(_C.stream_above_bytes())\nexcept ValueError as e:\n    print(e)\n"
            "try:\n    torch.ops.revkernels.coupling_sub(torch.randn(4), torch.randn(4))\n    print('ran')\n"
            "except ValueError as e:\n    print('raised', e)\n")
    env = dict(os.environ, REVKERNELS_STREAM_ABOVE_BYTES=value,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_stream_above_bytes_is_the_cache_or_the_variable():
    if not rk.HAS_C_EXTENSION:
        pytest.skip("revkernels._C is not built")
    if "REVKERNELS_STREAM_ABOVE_BYTES" not in os.environ:
        assert _C.stream_above_bytes() == _C.last_level_cache_bytes()
    assert _stream_above_bytes_with("123456") == ["123456", "ran"]
    assert _stream_above_bytes_with("0") == ["0", "ran"]
    for bad in ("-1", "4MiB"):
        lines = _stream_above_bytes_with(bad)
        assert len(lines) == 2 and lines[1].startswith("raised"), lines
        for line in lines:
            assert "REVKERNELS_STREAM_ABOVE_BYTES must be a non-negative integer" in line and f"'{bad}'" in line


@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
def test_cpu_kernels_under_each_isa(isa):
    if not rk.HAS_C_EXTENSION:
        pytest.skip("revkernels._C is not built")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=isa, REVKERNELS_STREAM_ABOVE_BYTES=str(STREAM_ABOVE_BYTES),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, check=True)
    if probe.stdout.strip().lower() != isa:
        pytest.skip(f"this CPU does not run {isa} (ATen picks {probe.stdout.strip()})")
    result = subprocess.run([sys.executable, "-c", "import tests.ops.test_cpu_isa as t; t.check_all()"],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"checked {isa.upper()} with the {_expected_build(isa)} kernels" in result.stdout


def _expected_build(isa):
    """Our kernel build under ATen capability `isa`: the widest build compiled into the library that
    `isa` allows (AVX-512 with the bf16 conversion instructions where the CPU has them), else the
    portable one."""
    wanted = {"default": [], "avx2": ["AVX2"], "avx512": ["AVX512", "AVX2"]}[isa]
    if isa == "avx512":
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
        wanted = ["AVX512_BF16"] * ("avx512_bf16" in flags) + wanted
    compiled = _C.cpu_kernel_builds()
    return next((build for build in wanted if build in compiled), "DEFAULT")


def test_cpu_kernel_builds():
    """Every library has the portable build; setup.py adds the ISA builds on x86-64 unless the
    compiler is clang (their flags are GCC's)."""
    if not rk.HAS_C_EXTENSION:
        pytest.skip("revkernels._C is not built")
    builds = _C.cpu_kernel_builds()
    assert builds[0] == "DEFAULT" and rk.CPU_KERNEL_BUILD in builds
    compiler = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or ""
    if platform.machine() in ("x86_64", "AMD64") and "clang" not in compiler:
        assert builds == ("DEFAULT", "AVX2", "AVX512", "AVX512_BF16")


def test_cpu_kernel_build_is_none_without_the_c_extension():
    run_without_c_extension("import revkernels as rk\nassert rk.CPU_KERNEL_BUILD is None\nprint('ok')")
