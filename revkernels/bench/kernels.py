"""Kernel benchmark: every fused op against the eager composition it replaces (and that composition
under torch.compile), Triton and CUDA C++ backends side by side, with the device's copy bandwidth
measured in the same run.

    python -m revkernels.bench.kernels                 # CUDA: bf16, three sizes
    python -m revkernels.bench.kernels --device cpu --quick     # a smoke run of the same code
    python benchmarks/bench_kernels.py ...             # the same, from a checkout (results in benchmarks/results)
    python -m revkernels.bench --parts kernels         # as a part of the benchmark suite

Time on CUDA, two figures per implementation (eager, torch.compile, triton, cuda alike):
  ms       GPU time, the median of CUDA-graph replays (triton.testing.do_bench_cudagraph): many
           calls captured in one graph, so the Python dispatch, argument checks and launches
           are not in it. The L2 cache is not flushed between the
           replayed calls. If capture fails (a torch.compile'd function may not be capturable),
           the row falls back to the per-call time; the CSV column `timing` says which
           ("cudagraph" or "events").
  call_ms  per-call time, host overhead included: the median of triton.testing.do_bench (CUDA
           events around each call, L2 cleared between calls), which is what a single eager
           call costs.
GB/s, TFLOP/s and the speed-up ratios use ms. The copy bandwidth (one big copy kernel) is timed
with do_bench. On CPU both figures are one perf_counter median (timing "perf_counter") of the calls
made in the same time budget as do_bench's (30 ms with --quick, 100 ms otherwise, after a 25 ms
warm-up; at least 5 calls, at most 10000).
GB/s counts the bytes each op must move at least once (inputs read, outputs written); GEMM rows
report TFLOP/s instead. The summary ends with the best fused GB/s at the largest size as a share
of the copy bandwidth (what one read and one write of the same bytes reach). Results:
CSV with device, versions and commit beside every row, and a bar chart, under --out.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tqdm import tqdm

from revkernels.bench.helptext import description
from revkernels.bench.report import (DEFAULT_OUT, check_device, check_out_folder, provenance, pyplot, save_figure,
                                     write_csv)
from revkernels.ops import get_cuda_backend, set_cuda_backend

SIZES_CUDA = [(12608, 768), (25216, 1024), (32768, 4096)]
SIZES_CPU = [(256, 768), (512, 1024)]
OPS = ("coupling_sub", "sub_layer_norm", "layer_norm_bwd_add", "bias_gelu", "bias_gelu_bwd", "linear_sub")  # as in _cases


CPU_MIN_CALLS, CPU_MAX_CALLS = 5, 10_000


def _call_ms(fn, device, reps):
    """Median time of one call, host overhead included (do_bench on CUDA, perf_counter on CPU)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=reps, return_mode="median")
    # CPU: as do_bench on CUDA, `reps` is a time budget in ms after a 25 ms warm-up; at least
    # CPU_MIN_CALLS calls (a few calls of a ~10 us op were dominated by its first calls' fresh pages).
    warm_until = time.perf_counter() + 0.025
    fn()
    while time.perf_counter() < warm_until:
        fn()
    times = []
    until = time.perf_counter() + reps / 1e3
    while len(times) < CPU_MIN_CALLS or (time.perf_counter() < until and len(times) < CPU_MAX_CALLS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _time(fn, device, reps):
    """(ms, call_ms, timing): GPU time from CUDA-graph replay and the per-call time (see the module
    docstring); ms falls back to call_ms, timing "events", when fn cannot be captured."""
    call_ms = _call_ms(fn, device, reps)
    if device.type != "cuda":
        return call_ms, call_ms, "perf_counter"
    from triton.testing import do_bench_cudagraph

    try:
        # fn, rep and return_mode only: the arguments Triton 3.6 and 3.9 share.
        return do_bench_cudagraph(fn, rep=reps, return_mode="median"), call_ms, "cudagraph"
    except Exception as error:  # noqa: BLE001 - any capture failure: report the per-call time instead
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        print(f"  (CUDA-graph capture failed, per-call time used: {type(error).__name__}: "
              f"{str(error).splitlines()[0][:120] if str(error) else ''})")
        return call_ms, call_ms, "events"


def _cases(rows, width, dtype, device):
    """(op name, {impl: fn}, bytes moved or None, flops or None) for one size."""
    def rand(*shape, dt=dtype):
        return torch.randn(*shape, device=device).to(dt)

    ops = torch.ops.revkernels
    y, f = rand(rows, width), rand(rows, width)
    w, b = rand(width), rand(width)
    hidden = rand(rows, width)
    _, mean, rstd = torch.native_layer_norm(y, [width], w, b, 1e-6)
    dln, dres = rand(rows, width), rand(rows, width)
    a, weight = rand(rows, width), rand(width, width) / width**0.5
    element = torch.tensor([], dtype=dtype).element_size()
    act = rows * width * element
    stats = rows * 4 * 2

    def coupling_eager():
        return y - f

    def sub_ln_eager():
        x = y - f
        return x, *torch.native_layer_norm(x, [width], w, b, 1e-6)

    def ln_bwd_add_eager():
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dln, y, [width], mean, rstd, w, b, [True, True, True])
        return dx + dres, dw, db

    def bias_gelu_eager():
        return F.gelu(hidden + b)

    def bias_gelu_bwd_eager():
        dx = torch.ops.aten.gelu_backward(dln, hidden + b)
        return dx, dx.float().sum(0).to(b.dtype)

    def linear_sub_eager():
        return y - F.linear(a, weight, b)

    flat_mean, flat_rstd = mean.reshape(rows), rstd.reshape(rows)
    cases = [
        ("coupling_sub", coupling_eager, lambda: ops.coupling_sub(y, f), 3 * act, None),
        ("sub_layer_norm", sub_ln_eager, lambda: ops.sub_layer_norm(y, f, w, b, 1e-6), 4 * act + stats, None),
        ("layer_norm_bwd_add", ln_bwd_add_eager,
         lambda: ops.layer_norm_bwd_add(dln, y, w, flat_mean, flat_rstd, dres), 4 * act + stats, None),
        ("bias_gelu", bias_gelu_eager, lambda: ops.bias_gelu(hidden, b, "none"), 2 * act, None),
        ("bias_gelu_bwd", bias_gelu_bwd_eager, lambda: ops.bias_gelu_bwd(dln, hidden, b, "none"), 3 * act, None),
        ("linear_sub", linear_sub_eager, lambda: ops.linear_sub(y, a, weight, b), None, 2 * rows * width * width),
    ]
    return cases


def _copy_bandwidth(device, dtype, reps):
    src = torch.randn(32768, 4096, device=device).to(dtype) if device.type == "cuda" else torch.randn(2048, 4096)
    dst = torch.empty_like(src)
    ms = _call_ms(lambda: dst.copy_(src), device, reps)  # one big kernel: the host overhead is negligible
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def parse_args(argv=None, default_out=DEFAULT_OUT):
    parser = argparse.ArgumentParser(prog="python -m revkernels.bench.kernels", description=description(__doc__))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--out", default=default_out, help=f"folder for CSV and PNG (default: {default_out})")
    args = parser.parse_args(argv)
    check_out_folder(parser, args.out)
    check_device(parser, args.device)
    return args


def run(args):
    """Measures, prints the tables, writes kernels_<device>.csv/.png under args.out; returns the rows."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = SIZES_CUDA if cuda else SIZES_CPU[:1] if args.quick else SIZES_CPU
    reps = 30 if args.quick else 100
    meta = provenance(args.device)
    copy_gbs = _copy_bandwidth(device, dtype, reps)
    print(f"kernel benchmark on {meta['device']} ({dtype}), torch {meta['torch']}, triton {meta['triton']}, "
          f"commit {meta['commit']}; copy bandwidth {copy_gbs:.0f} GB/s", flush=True)

    backends = ["triton", "cuda"] if cuda else ["cpp"]
    use_compile = cuda and not args.no_compile
    rows_out = []
    previous = get_cuda_backend()
    try:
        progress = tqdm(total=len(sizes) * len(OPS), desc="kernels", unit="op", file=sys.stderr, leave=False)
        for rows, width in sizes:
            for name, eager, fused, nbytes, flops in _cases(rows, width, dtype, device):
                progress.set_postfix_str(f"{name} {rows}x{width}")
                impls = {"eager": eager}
                if use_compile:
                    impls["compile"] = torch.compile(eager, dynamic=False)
                for backend in backends:
                    impls[backend] = fused
                for impl, fn in impls.items():
                    if impl in ("triton", "cuda"):
                        set_cuda_backend(impl)
                    ms, call_ms, timing = _time(fn, device, reps)
                    gbs = nbytes / (ms * 1e-3) / 1e9 if nbytes else None
                    rows_out.append({
                        "op": name, "rows": rows, "width": width, "dtype": str(dtype).replace("torch.", ""),
                        "impl": impl, "ms": round(ms, 5), "call_ms": round(call_ms, 5), "timing": timing,
                        "gb_per_s": round(gbs, 1) if gbs is not None else "",
                        "call_gb_per_s": round(nbytes / (call_ms * 1e-3) / 1e9, 1) if nbytes else "",
                        "tflop_per_s": round(flops / (ms * 1e-3) / 1e12, 2) if flops else "",
                        "pct_of_copy": round(100 * gbs / copy_gbs, 1) if gbs is not None else "",
                        "copy_gb_per_s": round(copy_gbs, 1),
                    })
                progress.update()
        progress.close()
    finally:
        set_cuda_backend(previous)

    impl_names = ["eager"] + (["compile"] if use_compile else []) + backends
    _print_summary(rows_out, sizes, impl_names, backends, use_compile, copy_gbs, cuda)

    os.makedirs(args.out, exist_ok=True)
    tag = "cuda" if cuda else "cpu"
    path = write_csv(os.path.join(args.out, f"kernels_{tag}.csv"), rows_out, meta)
    png = _plot(os.path.join(args.out, f"kernels_{tag}.png"), rows_out, meta, copy_gbs)
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    return rows_out


def main(argv=None, default_out=DEFAULT_OUT):
    run(parse_args(argv, default_out))
    return 0


def _print_summary(rows_out, sizes, impl_names, backends, use_compile, copy_gbs, cuda):
    ops = list(dict.fromkeys(r["op"] for r in rows_out))

    def find(name, rows, width):
        return {r["impl"]: r for r in rows_out if r["op"] == name and r["rows"] == rows and r["width"] == width}

    what = "GPU time (CUDA-graph replay; * = not capturable, per-call time)" if cuda else "time (perf_counter)"
    print(f"\n{what}, and the rate it gives:")
    print(f"{'op':<20} {'rows x width':>12}  " + "".join(f"{i:>23}" for i in impl_names)
          + "   best fused vs eager" + (" / compile" if use_compile else ""))
    for rows, width in sizes:
        for name in ops:
            mine = find(name, rows, width)
            cells = []
            for impl in impl_names:
                r = mine[impl]
                rate = f"{r['gb_per_s']:.0f} GB/s" if r["gb_per_s"] != "" else f"{r['tflop_per_s']:.1f} TF/s"
                mark = "*" if r["timing"] == "events" else " "
                cells.append(f"{r['ms']:.4f} ms{mark}({rate})".rjust(23))
            best = min(mine[b]["ms"] for b in backends)
            speed = f"{mine['eager']['ms'] / best:.2f}x"
            if use_compile:
                speed += f" / {mine['compile']['ms'] / best:.2f}x"
            print(f"{name:<20} {f'{rows}x{width}':>12}  " + "".join(cells) + f"   {speed}")

    if cuda:
        print("\nper-call time (do_bench: host dispatch and launch included, L2 cleared between calls):")
        print(f"{'op':<20} {'rows x width':>12}  " + "".join(f"{i:>12}" for i in impl_names))
        for rows, width in sizes:
            for name in ops:
                mine = find(name, rows, width)
                print(f"{name:<20} {f'{rows}x{width}':>12}  "
                      + "".join(f"{mine[impl]['call_ms']:.4f} ms".rjust(12) for impl in impl_names))

    rows, width = sizes[-1]
    print(f"\nbest fused ({'/'.join(backends)}) at {rows}x{width} against the copy bandwidth {copy_gbs:.0f} GB/s:")
    for name in ops:
        mine = find(name, rows, width)
        best_impl = min(backends, key=lambda b: mine[b]["ms"])
        r = mine[best_impl]
        if r["gb_per_s"] == "":
            print(f"  {name:<20} {r['tflop_per_s']:.1f} TFLOP/s ({best_impl}; a GEMM: compute-bound)")
            continue
        print(f"  {name:<20} {r['gb_per_s']:.0f} GB/s = {r['gb_per_s'] / copy_gbs:.1%} of copy ({best_impl})")


def _plot(path, rows, meta, copy_gbs):
    plt = pyplot()
    if plt is None:
        return None
    bandwidth_rows = [r for r in rows if r["gb_per_s"] != ""]
    largest = max(r["rows"] * r["width"] for r in bandwidth_rows)
    at_largest = [r for r in bandwidth_rows if r["rows"] * r["width"] == largest]
    ops = list(dict.fromkeys(r["op"] for r in at_largest))
    impls = list(dict.fromkeys(r["impl"] for r in at_largest))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        values = [next((r["gb_per_s"] for r in at_largest if r["op"] == op and r["impl"] == impl), 0) for op in ops]
        ax.bar([i + k * width for i in range(len(ops))], values, width, label=impl)
    ax.axhline(copy_gbs, color="black", linestyle="--", linewidth=1, label=f"copy {copy_gbs:.0f} GB/s")
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(ops))], ops)
    ax.set_ylabel("GB/s (bytes each op must move)")
    sample = at_largest[0]
    ax.set_title(f"{sample['rows']}x{sample['width']} {sample['dtype']} | {meta['device']} | torch {meta['torch']} "
                 f"| commit {meta['commit']}", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
