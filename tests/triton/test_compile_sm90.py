"""Ahead-of-time compile of every Triton kernel for sm_90 (H200) with the real compiler, no GPU needed.

The other Triton tests run under TRITON_INTERPRET=1 (tests/conftest.py sets it when there is no
CUDA device), and the interpreter accepts code that the compiler rejects. Here the kernel modules
are imported in a child process without TRITON_INTERPRET, and each kernel is compiled (TTIR ->
PTX -> cubin through ptxas) for every dtype combination and constexpr configuration the entry
points launch: the block sizes and warp counts come from the modules' own launch helpers and
constants for representative widths (1, 33, 1000, 4096, 4097, 8192 and the chunked paths above
MAX_FUSED_N_BWD / MAX_FUSED_N). Register use and spills (cuobjdump resource usage: LOCAL/STACK > 0) are printed as
non-fatal notes.

CI compiles a cover of the cases (`_cover`: every kernel's every constexpr configuration with its
warp count, and every combination of its argument dtypes, each at least once: 201 of the 280
compiles); the test marked `slow` compiles them all (`pytest -m slow tests/triton/test_compile_sm90.py`).

One child process per CPU core (at most 4) compiles its share of the cases (a fresh Triton cache, so
nothing is a cache hit). Run it against another Triton by pointing REVKERNELS_TRITON_PYTHON at that
environment's python. The file also runs standalone as the child: `python
tests/triton/test_compile_sm90.py SHARD COUNT [all|cover]` compiles cases SHARD, SHARD + COUNT, ...
"""
import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = ("revkernels.triton.coupling", "revkernels.triton.layer_norm", "revkernels.triton.bias_gelu",
           "revkernels.triton.batch_norm", "revkernels.triton.fixed_point")
ARCH = 90
FLOAT_DTYPES = ("fp32", "bf16", "fp16", "fp64")
WIDTHS = (1, 33, 1000, 4096, 4097, 8192)  # LayerNorm widths: fused forward; fused backward up to MAX_FUSED_N_BWD
CHUNKED_WIDTH = 10000  # the forward's chunked kernel (the backward's chunked kernels take 4097 and 8192 too)


# ---------------------------------------------------------------------------------------------
# Child process: enumerate the launch configurations and compile them.
# ---------------------------------------------------------------------------------------------

def _acc(*dtypes):
    return "fp64" if "fp64" in dtypes else "fp32"


def _cases():
    """(kernel name, module name, pointer dtypes by arg name, constexprs, num_warps, i64 int args) per
    launch config. Other ints are i32 (sizes and strides), float scalars fp32 (Python floats)."""
    import triton

    from revkernels.triton import batch_norm, bias_gelu, coupling, fixed_point, layer_norm

    cases = []

    def add(module, kernel, ptrs, constexprs, num_warps=4, i64=()):
        cases.append((kernel, module.__name__, ptrs, constexprs, num_warps, list(i64)))

    # coupling_axpy(a, b): out in a's dtype; b any float dtype (a bf16 F output against an fp32 stream).
    pairs = [(d, d) for d in FLOAT_DTYPES] + [("fp32", "bf16"), ("fp32", "fp16"), ("bf16", "fp32"),
                                              ("fp16", "fp32"), ("fp32", "fp64"), ("bf16", "fp64")]
    for a, b in pairs:
        add(coupling, "_coupling_axpy_kernel", dict(out_ptr=a, a_ptr=a, b_ptr=b),
            dict(ACC_FP64=_acc(a, b) == "fp64", BLOCK=coupling.BLOCK))
    for a, b in (("bf16", "bf16"), ("fp32", "bf16")):  # numel >= 2**31 is passed as i64
        add(coupling, "_coupling_axpy_kernel", dict(out_ptr=a, a_ptr=a, b_ptr=b),
            dict(ACC_FP64=False, BLOCK=coupling.BLOCK), i64=["numel"])

    # sub_layer_norm(y, g, weight, bias): x, ln in y's dtype; mean, rstd in the accumulate dtype.
    same = [(d, d, d, d) for d in FLOAT_DTYPES]
    mixed = [("fp32", "bf16", "fp32", "fp32"), ("bf16", "bf16", "fp32", "fp32"), ("bf16", "fp32", "bf16", "bf16"),
             ("fp16", "fp16", "fp32", "fp32"), ("fp32", "fp64", "fp32", "fp32"), ("bf16", "fp32", "fp32", "bf16")]
    fused_blocks = sorted({triton.next_power_of_2(n) for n in WIDTHS})
    assert all(b <= layer_norm.MAX_FUSED_N for b in fused_blocks)
    assert triton.next_power_of_2(CHUNKED_WIDTH) > layer_norm.MAX_FUSED_N
    bwd_fused_blocks = [b for b in fused_blocks if b <= layer_norm.MAX_FUSED_N_BWD]
    assert layer_norm.MAX_FUSED_N_BWD in bwd_fused_blocks and len(bwd_fused_blocks) < len(fused_blocks)
    # The chunk width of every chunked kernel (forward above MAX_FUSED_N, backward above MAX_FUSED_N_BWD).
    chunk = min(layer_norm.CHUNK_N, triton.next_power_of_2(CHUNKED_WIDTH))
    assert all(min(layer_norm.CHUNK_N, triton.next_power_of_2(n)) == chunk
               for n in WIDTHS if triton.next_power_of_2(n) > layer_norm.MAX_FUSED_N_BWD)
    for combos, blocks in ((same, fused_blocks), (mixed, [triton.next_power_of_2(1000)])):
        for y, g, w, b in combos:
            acc = _acc(y, g)
            ptrs = dict(x_ptr=y, ln_ptr=y, mean_ptr=acc, rstd_ptr=acc, y_ptr=y, g_ptr=g, w_ptr=w, b_ptr=b)
            for block in blocks:
                add(layer_norm, "_sub_layer_norm_fwd_kernel", ptrs, dict(ACC_FP64=acc == "fp64", BLOCK_N=block),
                    layer_norm._num_warps(block))
    for y, g, w, b in same + mixed:
        acc = _acc(y, g)
        add(layer_norm, "_sub_layer_norm_fwd_chunked_kernel",
            dict(x_ptr=y, ln_ptr=y, mean_ptr=acc, rstd_ptr=acc, y_ptr=y, g_ptr=g, w_ptr=w, b_ptr=b),
            dict(ACC_FP64=acc == "fp64", BLOCK_N=chunk), layer_norm._num_warps(chunk))

    # layer_norm_bwd_add(dln, x, weight, mean, rstd, dres): dln in x's dtype, dx in dres's dtype,
    # mean/rstd from the forward (accumulate dtype of y, g), partials in the accumulate dtype of x, dres.
    same = [(d, d, d, _acc(d)) for d in FLOAT_DTYPES]  # (x, dres, weight, mean)
    mixed = [("bf16", "fp32", "fp32", "fp32"), ("fp32", "bf16", "fp32", "fp32"), ("bf16", "bf16", "fp32", "fp32"),
             ("fp32", "fp64", "fp32", "fp64"), ("fp16", "fp32", "fp16", "fp32"), ("fp32", "fp32", "fp32", "fp64")]
    for combos, blocks in ((same, bwd_fused_blocks), (mixed, [triton.next_power_of_2(1000)])):
        for x, dres, w, m in combos:
            acc = _acc(x, dres)
            for block in blocks:
                add(layer_norm, "_layer_norm_bwd_add_kernel",
                    dict(dx_ptr=dres, dw_partial_ptr=acc, db_partial_ptr=acc, dln_ptr=x, x_ptr=x, w_ptr=w,
                         mean_ptr=m, rstd_ptr=m, dres_ptr=dres),
                    dict(ACC_FP64=acc == "fp64", BLOCK_N=block), layer_norm._bwd_num_warps(block))
    for x, dres, w, m in same + mixed:
        acc = _acc(x, dres)
        cx = dict(ACC_FP64=acc == "fp64", BLOCK_N=chunk)
        add(layer_norm, "_layer_norm_bwd_row_stats_kernel",
            dict(stats_ptr=acc, dln_ptr=x, x_ptr=x, w_ptr=w, mean_ptr=m, rstd_ptr=m), cx,
            layer_norm._bwd_num_warps(chunk))
        add(layer_norm, "_layer_norm_bwd_add_chunked_kernel",
            dict(dx_ptr=dres, dw_partial_ptr=acc, db_partial_ptr=acc, stats_ptr=acc, dln_ptr=x, x_ptr=x, w_ptr=w,
                 mean_ptr=m, rstd_ptr=m, dres_ptr=dres), cx, layer_norm._bwd_num_warps(chunk))
    for acc, w in (("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "fp16"), ("fp64", "fp64"), ("fp64", "fp32")):
        add(layer_norm, "_sum_partials_kernel", dict(dw_ptr=w, db_ptr=w, partial_ptr=acc),
            dict(BLOCK_P=layer_norm.PARTIAL_BLOCK_P, BLOCK_N=layer_norm.PARTIAL_BLOCK_N))

    # bias_gelu(x, bias) / bias_gelu_bwd(dy, x, bias): out, dx in x's dtype; bias any float dtype.
    # The forward and backward have their own tile shapes (_fwd_blocks, _bwd_blocks), both NUM_WARPS.
    shapes = [(1, 33), (7, 1000), (4096, 33), (4096, 1000), (4096, 8), (64, 8192)]  # (rows, n)
    few_shapes = [(1, 33), (4096, 1000)]
    same = [(d, d) for d in FLOAT_DTYPES]
    mixed = [("bf16", "fp32"), ("fp16", "fp32"), ("fp32", "fp64"), ("fp32", "bf16")]
    # Every block shape for the erf form; the tanh form and mixed dtypes (which change only the
    # math and the load/store conversions) on fewer shapes, to keep the whole file near a minute.
    plan = [(same, False, shapes), (same, True, few_shapes), (mixed, False, few_shapes[1:]),
            (mixed, True, few_shapes[1:])]
    for combos, tanh, plan_shapes in plan:
        for x, b in combos:
            acc = _acc(x, b)
            for kernel, blocks, ptrs in (
                    ("_bias_gelu_kernel", bias_gelu._fwd_blocks, dict(out_ptr=x, x_ptr=x, bias_ptr=b)),
                    ("_bias_gelu_bwd_kernel", bias_gelu._bwd_blocks,
                     dict(dx_ptr=x, partial_ptr=acc, dy_ptr=x, x_ptr=x, bias_ptr=b))):
                for block_m, block_n in sorted({blocks(r, n) for r, n in plan_shapes}):
                    cx = dict(TANH=tanh, ACC_FP64=acc == "fp64", BLOCK_M=block_m, BLOCK_N=block_n)
                    add(bias_gelu, kernel, ptrs, cx, bias_gelu.NUM_WARPS)
    for b, acc in (("fp32", "fp32"), ("bf16", "fp32"), ("fp16", "fp32"), ("fp64", "fp64"), ("fp32", "fp64")):
        add(bias_gelu, "_reduce_partials_kernel", dict(dbias_ptr=b, partial_ptr=acc),
            dict(ACC_FP64=acc == "fp64", BLOCK=bias_gelu.REDUCE_BLOCK))

    # batch_norm_act(x, w, b) / _bwd: out, dx in x's dtype, statistics in acc; tiles as _launch_config
    # makes them: one channel x TILE positions (NCHW) and MAX_BLOCK_C channels (channels_last); the
    # launches use the default 4 warps. ReLU off only for fp32 (it changes one where()).
    tiles = [(1, batch_norm.TILE), (batch_norm.MAX_BLOCK_C, batch_norm.TILE // batch_norm.MAX_BLOCK_C)]
    for x, w in [(d, d) for d in FLOAT_DTYPES] + [("bf16", "fp32"), ("fp16", "fp32")]:
        acc = _acc(x)
        stats = dict(mean_ptr=acc, rstd_ptr=acc)
        for block_c, block_m in tiles:
            cx = dict(ACC_FP64=acc == "fp64", BLOCK_C=block_c, BLOCK_M=block_m)
            add(batch_norm, "_bn_fwd_stats_kernel", dict(partial_ptr=acc, x_ptr=x), cx)
            for relu in (True, False) if (x, w) == ("fp32", "fp32") else (True,):
                add(batch_norm, "_bn_fwd_apply_kernel", dict(out_ptr=x, x_ptr=x, w_ptr=w, b_ptr=w, **stats),
                    dict(cx, RELU=relu))
                add(batch_norm, "_bn_bwd_sums_kernel", dict(partial_ptr=acc, d_ptr=x, x_ptr=x, w_ptr=w, b_ptr=w, **stats),
                    dict(cx, RELU=relu))
                add(batch_norm, "_bn_bwd_apply_kernel",
                    dict(dx_ptr=x, sums_ptr=acc, d_ptr=x, x_ptr=x, w_ptr=w, b_ptr=w, **stats), dict(cx, RELU=relu))
        finalize = dict(BLOCK_C=batch_norm.FINALIZE_BLOCK_C, BLOCK_P=batch_norm.PARTIAL_BLOCK_P)
        add(batch_norm, "_bn_fwd_finalize_kernel", dict(partial_ptr=acc, x_ptr=x, **stats),
            dict(finalize, ACC_FP64=acc == "fp64"))
        add(batch_norm, "_bn_bwd_finalize_kernel", dict(sums_ptr=acc, dw_ptr=w, db_ptr=w, partial_ptr=acc), finalize)

    # fixed_point(op, x, f): int64 streams and overflow flag, the view in any float dtype, the branch
    # output f in any float dtype; the pointers an op does not use get the view (never read).
    fp = fixed_point
    for op in (fp.FROM_FLOAT, fp.ADD, fp.SUB, fp.VIEW):
        if op in (fp.ADD, fp.SUB):
            pairs = [(f, v) for f in FLOAT_DTYPES for v in FLOAT_DTYPES]  # (f, view)
        else:  # FROM_FLOAT: the view in f's dtype; VIEW: no f
            pairs = [(v, v) for v in FLOAT_DTYPES]
        for f, v in pairs:
            ptrs = dict(out_ptr=v if op == fp.VIEW else "i64", view_ptr=v, x_ptr=v if op == fp.FROM_FLOAT else "i64",
                        f_ptr=v if op == fp.VIEW else f, flag_ptr=v if op == fp.VIEW else "i1")
            cx = dict(OP=op, F_FP64=op != fp.VIEW and f == "fp64", VIEW_FP64=v == "fp64", BLOCK=fp.BLOCK)
            add(fixed_point, "_fixed_point_kernel", ptrs, cx)
            if (f, v) == ("bf16", "fp32"):  # numel >= 2**31 is passed as i64
                add(fixed_point, "_fixed_point_kernel", ptrs, cx, i64=["numel"])
    return cases


def _cover(cases):
    """A subset of cases with every (kernel, constexprs, num_warps) and every (kernel, argument dtypes,
    constexprs other than block sizes) of `cases` in it: greedily, the case that adds the most."""
    def keys(case):
        kernel, _, ptrs, constexprs, num_warps, i64 = case
        dtypes = {k: v for k, v in constexprs.items() if not k.startswith("BLOCK")}
        return {("config", kernel, json.dumps(constexprs, sort_keys=True), num_warps),
                ("dtypes", kernel, json.dumps(ptrs, sort_keys=True), json.dumps(i64), json.dumps(dtypes, sort_keys=True))}

    case_keys = [keys(case) for case in cases]
    missing = set().union(*case_keys)
    chosen = []
    while missing:
        best = max(range(len(cases)), key=lambda i: len(case_keys[i] & missing))  # the first of equals
        chosen.append(cases[best])
        missing -= case_keys[best]
    return chosen


def _jit_kernels():
    """Names of the top-level @triton.jit kernels (not the jitted helpers they call) per module."""
    import triton

    found = {}
    for name in MODULES:
        module = importlib.import_module(name)
        found[name] = sorted(k for k, v in vars(module).items()
                             if isinstance(v, triton.runtime.JITFunction) and k.endswith("_kernel"))
    return found


def _resource_usage(cuobjdump, cubin, workdir):
    """{'REG': .., 'STACK': .., 'LOCAL': ..} from cuobjdump --dump-resource-usage, or {} if unavailable."""
    if not cuobjdump or not os.path.exists(cuobjdump):
        return {}
    path = os.path.join(workdir, "k.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    try:
        text = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    usage = {}
    for token in text.split():
        key, _, value = token.partition(":")
        if key in ("REG", "STACK", "LOCAL") and value.isdigit():
            usage[key] = int(value)
    return usage


def _child(shard=0, count=1, which="all"):
    import tempfile

    assert not os.environ.get("TRITON_INTERPRET"), "the compile check must not run under the interpreter"
    import triton
    import triton.backends.nvidia as nvidia
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = _jit_kernels()
    cases = (_cases() if which == "all" else _cover(_cases()))[shard::count]
    target = GPUTarget("cuda", ARCH, 32)
    cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for kernel_name, module_name, ptrs, constexprs, num_warps, i64 in cases:
            fn = getattr(importlib.import_module(module_name), kernel_name)
            assert isinstance(fn, triton.runtime.JITFunction), type(fn)  # not an interpreted function
            signature, attrs = {}, {}
            for i, arg in enumerate(fn.arg_names):
                if arg in constexprs:
                    signature[arg] = "constexpr"
                elif arg in ptrs:
                    signature[arg] = "*" + ptrs[arg]
                    attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
                elif arg in ("alpha", "eps", "up", "down"):
                    signature[arg] = "fp32"  # Python floats
                else:
                    signature[arg] = "i64" if arg in i64 else "i32"  # sizes and strides
            missing = set(fn.arg_names) - set(signature)
            assert not missing, (kernel_name, missing)
            case = dict(kernel=kernel_name, ptrs=ptrs, constexprs=constexprs, num_warps=num_warps, i64=i64)
            start = time.perf_counter()
            try:
                compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                          target=target, options=dict(num_warps=num_warps))
                case.update(ok=True, usage=_resource_usage(cuobjdump, compiled.asm["cubin"], workdir))
            except Exception as e:  # report every failing configuration, not only the first
                case.update(ok=False, error=f"{type(e).__name__}: {e}"[-4000:])
            case["seconds"] = round(time.perf_counter() - start, 3)
            results.append(case)
    print("RESULT " + json.dumps(dict(triton=triton.__version__, kernels=kernels, cases=results)))


# ---------------------------------------------------------------------------------------------
# pytest side: run the child once per session and check its report.
# ---------------------------------------------------------------------------------------------

def _python():
    return os.environ.get("REVKERNELS_TRITON_PYTHON", sys.executable)


def _run_children(tmp_dir, which):
    """The children's reports merged: one child per core (at most 4), each with its own fresh cache."""
    count = max(1, min(4, len(os.sched_getaffinity(0))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default; silences Triton 3.9's notice
    procs = []
    for shard in range(count):
        cache = os.path.join(str(tmp_dir), f"shard{shard}")  # fresh: every case really compiles
        procs.append(subprocess.Popen([_python(), os.path.abspath(__file__), str(shard), str(count), which], cwd=REPO,
                                      env=dict(env, TRITON_CACHE_DIR=cache), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    reports = []
    for proc, (stdout, stderr) in [(proc, proc.communicate(timeout=900)) for proc in procs]:
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, (
            f"compile child failed (rc {proc.returncode})\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-8000:]}")
        reports.append(json.loads(lines[-1][len("RESULT "):]))
    return dict(reports[0], cases=[case for report in reports for case in report["cases"]])


if __name__ == "__main__":
    _child(*(int(arg) for arg in sys.argv[1:3]), *sys.argv[3:4])
else:
    import pytest

    def _triton_importable():
        if "REVKERNELS_TRITON_PYTHON" not in os.environ:
            return importlib.util.find_spec("triton") is not None
        return subprocess.run([_python(), "-c", "import triton"], capture_output=True).returncode == 0

    pytestmark = pytest.mark.skipif(not _triton_importable(), reason="triton cannot be imported")

    EXPECTED_KERNELS = {
        "revkernels.triton.coupling": ["_coupling_axpy_kernel"],
        "revkernels.triton.layer_norm": ["_layer_norm_bwd_add_chunked_kernel", "_layer_norm_bwd_add_kernel",
                                         "_layer_norm_bwd_row_stats_kernel", "_sub_layer_norm_fwd_chunked_kernel",
                                         "_sub_layer_norm_fwd_kernel", "_sum_partials_kernel"],
        "revkernels.triton.bias_gelu": ["_bias_gelu_bwd_kernel", "_bias_gelu_kernel", "_reduce_partials_kernel"],
        "revkernels.triton.batch_norm": ["_bn_bwd_apply_kernel", "_bn_bwd_finalize_kernel", "_bn_bwd_sums_kernel",
                                         "_bn_fwd_apply_kernel", "_bn_fwd_finalize_kernel", "_bn_fwd_stats_kernel"],
        "revkernels.triton.fixed_point": ["_fixed_point_kernel"],
    }

    def _describe(case):
        ptrs = ",".join(f"{k[:-4] if k.endswith('_ptr') else k}={v}" for k, v in case["ptrs"].items())
        extra = f" i64={case['i64']}" if case["i64"] else ""
        return f"{case['kernel']}({ptrs}) {case['constexprs']} num_warps={case['num_warps']}{extra}"

    def _compile(tmp_dir, which):
        """The children's report, its register use and spills printed."""
        start = time.perf_counter()
        result = _run_children(tmp_dir, which)
        cases = result["cases"]
        print(f"\ntriton {result['triton']}: {len(cases)} sm_{ARCH} compiles in {time.perf_counter() - start:.1f} s")
        for name in sorted({c["kernel"] for c in cases}):
            regs = [c["usage"].get("REG", 0) for c in cases if c["kernel"] == name and c.get("ok") and c["usage"]]
            if regs:
                print(f"  {name}: registers {min(regs)}..{max(regs)}")
        spills = []
        for c in cases:
            u = c.get("usage") or {}
            if u.get("LOCAL", 0) or u.get("STACK", 0):  # non-fatal: spills cost speed, not correctness
                spills.append(f"{_describe(c)} REG={u.get('REG')} STACK={u.get('STACK')} LOCAL={u.get('LOCAL')}")
        for line in spills:
            print("  WARNING register spill: " + line)
        if spills:  # shown in pytest's warnings summary without -s; never a failure
            warnings.warn(f"{len(spills)} sm_{ARCH} configurations spill registers on triton {result['triton']} "
                          f"(STACK/LOCAL > 0), e.g. {spills[0]}", stacklevel=1)
        return result

    def _failures(cases):
        failures = [f"{_describe(c)}:\n{c['error']}" for c in cases if not c["ok"]]
        return f"{len(failures)}/{len(cases)} configurations fail to compile:\n" + "\n\n".join(failures[:5])

    @pytest.fixture(scope="module")
    def report(tmp_path_factory):
        return _compile(tmp_path_factory.mktemp("triton_cache"), "cover")

    def test_the_cover_has_every_configuration_and_dtype_combination():
        cases = _cases()
        cover = _cover(cases)
        assert len(cover) < len(cases) and all(case in cases for case in cover)
        for name, key in (("configuration", lambda c: (c[0], json.dumps(c[3], sort_keys=True), c[4])),
                          ("dtypes", lambda c: (c[0], json.dumps(c[2], sort_keys=True), json.dumps(c[5]),
                                                json.dumps({k: v for k, v in c[3].items() if "BLOCK" not in k},
                                                           sort_keys=True)))):
            assert {key(c) for c in cover} == {key(c) for c in cases}, name

    @pytest.mark.slow
    def test_every_case_compiles_for_sm90(tmp_path):
        result = _compile(tmp_path, "all")
        assert all(c["ok"] for c in result["cases"]), f"triton {result['triton']}: " + _failures(result["cases"])

    def test_every_kernel_is_covered(report):
        """Each @triton.jit kernel of the modules has compile cases (a new kernel needs cases added)."""
        assert report["kernels"] == EXPECTED_KERNELS
        compiled = {c["kernel"] for c in report["cases"]}
        assert compiled == {k for names in EXPECTED_KERNELS.values() for k in names}

    @pytest.mark.parametrize("kernel", sorted(k for names in EXPECTED_KERNELS.values() for k in names))
    def test_compiles_for_sm90(report, kernel):
        cases = [c for c in report["cases"] if c["kernel"] == kernel]
        assert cases
        assert all(c["ok"] for c in cases), f"{kernel} for sm_{ARCH} on triton {report['triton']}: " + _failures(cases)
