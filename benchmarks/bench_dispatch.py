"""Per-call host cost of each revkernels op against the ATen op or composition it stands for, at a
tiny size where dispatch, not arithmetic, is the cost (issue 12).

For every op: the median time of one call, forward only and forward + backward (``torch.autograd.grad``
with inputs that require grad), through the public entry point ``revkernels.ops.<op>``, and of the
ATen version. The backward ops (no autograd of their own) are timed forward only, on plain tensors.

    PYTHONPATH=. python benchmarks/bench_dispatch.py [--rows 8] [--width 64] [--repeats 200] [--calls 50]

One thread; each sample is the mean over `--calls` calls, the reported value the median of
`--repeats` samples after a warm-up, revkernels' and ATen's samples taken alternately.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import revkernels as rk

ops = rk.ops
aten = torch.ops.aten


def per_call_us(fns, repeats, calls):
    """Median us per call of each of `fns`, their samples interleaved (load drift hits all alike)."""
    for fn in fns:
        for _ in range(calls * 5):
            fn()
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter_ns() - start) / calls / 1e3)
    return [statistics.median(s) for s in samples]


def cases(rows, width):
    """(name, revkernels call, ATen call, inputs that get grads or None for a forward-only op)."""
    def t(*shape, grad=True):
        return torch.randn(*shape).requires_grad_(grad)

    y, f, w, b = t(rows, width), t(rows, width), t(width), t(width)
    a, lw = t(rows, width), t(width, width)
    eps = 1e-5
    x, bw, bb = t(rows, width), t(width), t(width)
    dy = torch.randn(rows, width)
    xd = x.detach()
    # ATen's LayerNorm statistics have shape (rows, 1), revkernels' (rows,).
    _, ln_mean, ln_rstd = aten.native_layer_norm(xd, [width], w.detach(), b.detach(), eps)
    row_mean, row_rstd = ln_mean.squeeze(-1), ln_rstd.squeeze(-1)
    _, bn_mean, bn_rstd = aten.native_batch_norm(xd, bw.detach(), bb.detach(), None, None, True, 0.0, eps)
    wd, bd, bwd_, bbd = w.detach(), b.detach(), bw.detach(), bb.detach()
    return [
        ("coupling_sub", lambda: ops.coupling_sub(y, f), lambda: torch.sub(y, f), (y, f)),
        ("coupling_add", lambda: ops.coupling_add(y, f), lambda: torch.add(y, f), (y, f)),
        ("sub_layer_norm", lambda: ops.sub_layer_norm(y, f, w, b, eps)[:2],
         lambda: (lambda x_: (x_, aten.native_layer_norm(x_, [width], w, b, eps)[0]))(torch.sub(y, f)), (y, f, w, b)),
        ("layer_norm_bwd_add", lambda: ops.layer_norm_bwd_add(dy, xd, wd, row_mean, row_rstd, dy),
         lambda: (lambda r: (torch.add(dy, r[0]), r[1], r[2]))(aten.native_layer_norm_backward(
             dy, xd, [width], ln_mean, ln_rstd, wd, bd, [True, True, True])), None),
        ("bias_gelu", lambda: ops.bias_gelu(x, bb), lambda: F.gelu(torch.add(x, bb)), (x, bb)),
        ("bias_gelu_bwd", lambda: ops.bias_gelu_bwd(dy, xd, bbd),
         lambda: (lambda g: (g, g.sum(0)))(aten.gelu_backward(dy, torch.add(xd, bbd))), None),
        ("linear_sub", lambda: ops.linear_sub(y, a, lw, b), lambda: torch.sub(y, F.linear(a, lw, b)), (y, a, lw, b)),
        ("batch_norm_act", lambda: ops.batch_norm_act(x, bw, bb, eps, True)[0],
         lambda: torch.relu(aten.native_batch_norm(x, bw, bb, None, None, True, 0.0, eps)[0]), (x, bw, bb)),
        ("batch_norm_act_bwd", lambda: ops.batch_norm_act_bwd(dy, xd, bwd_, bbd, bn_mean, bn_rstd, True),
         lambda: aten.native_batch_norm_backward(aten.threshold_backward(dy, xd, 0.0), xd, bwd_, None, None, bn_mean,
                                                 bn_rstd, True, eps, [True, True, True]), None),
    ]


def with_backward(call, inputs):
    def run():
        out = call()
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs])

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, revkernels._C loaded: {rk.HAS_C_EXTENSION}, {args.rows}x{args.width} fp32, "
          f"1 thread, us per call (median)")
    print(f"{'op':<20} {'mode':<9} {'revkernels':>10} {'aten':>8} {'ratio':>6}")
    for name, rk_call, aten_call, inputs in cases(args.rows, args.width):
        modes = [("fwd", rk_call, aten_call)]
        if inputs is not None:
            modes.append(("fwd+bwd", with_backward(rk_call, inputs), with_backward(aten_call, inputs)))
        for mode, ours, theirs in modes:
            t_ours, t_aten = per_call_us([ours, theirs], args.repeats, args.calls)
            print(f"{name:<20} {mode:<9} {t_ours:>10.2f} {t_aten:>8.2f} {t_ours / t_aten:>6.2f}")


if __name__ == "__main__":
    main()
