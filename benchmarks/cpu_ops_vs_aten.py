"""Each fused CPU op against the eager ATen composition it replaces, fp32 and bf16, interleaved.

    PYTHONPATH=. python benchmarks/cpu_ops_vs_aten.py [--rows 4096] [--width 768] [--threads 2] [--reps 60]
                                                      [--clock wall|cpu]

Each repetition times every implementation once, in turn (so background load hits both alike);
the table gives the medians (and minima) and composition / fused of the medians (> 1: the fused op
is faster). --clock cpu times the process's CPU time instead of the wall clock: on a machine shared
with other work, a preempted thread then costs nothing, so with --threads 1 it measures the
kernels' own work; with more threads it also counts the time OpenMP workers spin while waiting. BatchNorm runs
on (N, C, H, W) = (rows / 64, width / 8, 8, 64): the same element count.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import revkernels  # noqa: F401  (loads the ops)


def cases(rows, width, dtype):
    ops = torch.ops.revkernels

    def rand(*shape):
        return torch.randn(*shape).to(dtype)

    y, f, hidden, dln, dres = (rand(rows, width) for _ in range(5))
    w, b = rand(width), rand(width)
    _, mean, rstd = torch.native_layer_norm(y, [width], w, b, 1e-6)
    flat_mean, flat_rstd = mean.reshape(rows), rstd.reshape(rows)
    xb = rand(rows // 64, width // 8, 8, 64)
    dout = rand(*xb.shape)
    wb, bb = rand(width // 8), rand(width // 8)
    _, bmean, brstd = ops.batch_norm_act(xb, wb, bb, 1e-5, True)
    _, save_mean, save_invstd = torch.native_batch_norm(xb, wb, bb, None, None, True, 0.0, 1e-5)

    def ln_bwd_add_eager():
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dln, y, [width], mean, rstd, w, b, [True, True, True])
        return dx + dres, dw, db

    def bias_gelu_bwd_eager():
        dx = torch.ops.aten.gelu_backward(dln, hidden + b)
        return dx, dx.float().sum(0).to(b.dtype)

    def sub_ln_eager():
        x = y - f
        return x, *torch.native_layer_norm(x, [width], w, b, 1e-6)

    def bn_eager():
        out, m, r = torch.native_batch_norm(xb, wb, bb, None, None, True, 0.0, 1e-5)
        return torch.relu_(out), m, r

    def bn_bwd_eager():
        pre = (xb.float() - bmean.view(1, -1, 1, 1)) * brstd.view(1, -1, 1, 1) * wb.float().view(1, -1, 1, 1) \
            + bb.float().view(1, -1, 1, 1)
        dy = dout.masked_fill(pre <= 0, 0)
        return torch.ops.aten.native_batch_norm_backward(dy, xb, wb, None, None, save_mean, save_invstd, True, 1e-5,
                                                         [True, True, True])

    return [
        ("coupling_sub", lambda: y - f, lambda: ops.coupling_sub(y, f)),
        ("coupling_add", lambda: y + f, lambda: ops.coupling_add(y, f)),
        ("sub_layer_norm", sub_ln_eager, lambda: ops.sub_layer_norm(y, f, w, b, 1e-6)),
        ("layer_norm_bwd_add", ln_bwd_add_eager, lambda: ops.layer_norm_bwd_add(dln, y, w, flat_mean, flat_rstd, dres)),
        ("bias_gelu", lambda: F.gelu(hidden + b), lambda: ops.bias_gelu(hidden, b, "none")),
        ("bias_gelu tanh", lambda: F.gelu(hidden + b, approximate="tanh"), lambda: ops.bias_gelu(hidden, b, "tanh")),
        ("bias_gelu_bwd", bias_gelu_bwd_eager, lambda: ops.bias_gelu_bwd(dln, hidden, b, "none")),
        ("batch_norm_act", bn_eager, lambda: ops.batch_norm_act(xb, wb, bb, 1e-5, True)),
        # The composition's ReLU mask is a pass of its own: the ATen BN backward has no ReLU.
        ("batch_norm_act_bwd", bn_bwd_eager, lambda: ops.batch_norm_act_bwd(dout, xb, wb, bb, bmean, brstd, True)),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--ops", default="", help="comma-separated subset of op names")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"torch {torch.__version__}, {args.threads} threads, {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.rows}x{args.width}, {args.reps} interleaved reps, {args.clock} clock (ms)")
    print(f"{'op':<20} {'dtype':<9} {'composition':>12} {'fused':>9} {'ratio':>7}   {'min comp':>9} {'min fused':>9}")
    wanted = set(filter(None, args.ops.split(",")))
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name, eager, fused in cases(args.rows, args.width, dtype):
            if wanted and name not in wanted:
                continue
            times = {"eager": [], "fused": []}
            for _ in range(3):
                eager(), fused()
            for _ in range(args.reps):
                for impl, fn in (("eager", eager), ("fused", fused)):
                    start = clock()
                    fn()
                    times[impl].append((clock() - start) * 1e3)
            e, f = statistics.median(times["eager"]), statistics.median(times["fused"])
            print(f"{name:<20} {dtype_name:<9} {e:>12.3f} {f:>9.3f} {e / f:>6.2f}x   {min(times['eager']):>9.3f} "
                  f"{min(times['fused']):>9.3f}", flush=True)


if __name__ == "__main__":
    main()
