"""Attention in compiled CPU graphs: SDPA's flash kernel against its math formula, by sequence length.

Each point compiles (inductor with its C++ wrapper, as the compiled engine compiles its CPU steps) one
attention step as those steps contain it, the output and its VJP (``torch.func.vjp``) of
``F.scaled_dot_product_attention`` on (batch, heads, tokens, head_dim) fp32 inputs, twice: once as is
(inductor calls the flash kernel and its backward) and once under ``sdpa_kernel(SDPBackend.MATH)``
(inductor compiles the formula). It reports the median time per call of each, their ratio, and which
one `revkernels.nn.attention.scaled_dot_product_attention` takes at that length (math up to
``MATH_MAX_KEYS`` keys). Rows: the host-bound configuration of the overhead benchmark (batch 2, 4 heads
of 16, 8 tokens), then ViT-S heads (6 of 64) at 8 to 1024 tokens with batch x tokens ~ 1024.
Writes attention_cpu.csv and attention_cpu.png (time per call and the ratio against tokens). As the
overhead part does, it first tells glibc's malloc to keep freed memory (`keep_freed_memory`).
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.func import vjp
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from revkernels.bench.overhead import keep_freed_memory, per_call_us
from revkernels.bench.report import check_out_folder, provenance, pyplot, save_figure, write_csv
from revkernels.engine.compiled import isolated
from revkernels.nn.attention import MATH_MAX_KEYS

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # the default --out
HOST_BOUND_POINT = (2, 4, 8, 16)
VIT_S_HEADS = (6, 64)
TOKENS = (8, 16, 32, 65, 128, 197, 224, 256, 320, 384, 512, 1024)
QUICK_TOKENS = (8, 65)
ROWS_PER_CALL = 1024  # batch x tokens of the ViT-S points (batch at least 1)


def points(tokens):
    """(batch, heads, tokens, head_dim) of every row: the host-bound point, then ViT-S heads at each of `tokens`."""
    heads, head_dim = VIT_S_HEADS
    return [HOST_BOUND_POINT] + [(max(1, ROWS_PER_CALL // t), heads, t, head_dim) for t in tokens]


def _flash(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def _math(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v)


def _step(attention, q, k, v, d_out):
    out, pull = vjp(attention, q, k, v)
    return out, *pull(d_out)


def compiled_step(attention):
    """The attention step compiled as the compiled engine compiles its CPU steps (a code object of its
    own per call: a fresh compile, not a recompile counted against Dynamo's limit)."""
    compiled = torch.compile(isolated(_step), fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
    return lambda *args: compiled(attention, *args)


def measure(point, reps, inner):
    """One row: the median us per call of each kind's compiled step at `point` (compiled afresh)."""
    batch, heads, tokens, head_dim = point
    steps = {"flash": compiled_step(_flash), "math": compiled_step(_math)}
    q, k, v, d_out = (torch.randn(batch, heads, tokens, head_dim) for _ in range(4))
    flash_us, math_us = per_call_us([lambda: steps["flash"](q, k, v, d_out), lambda: steps["math"](q, k, v, d_out)],
                                    "cpu", reps, inner, warmup=3)
    return {"batch": batch, "heads": heads, "tokens": tokens, "head_dim": head_dim, "dtype": "float32",
            "threads": torch.get_num_threads(), "flash_us": round(flash_us, 2), "math_us": round(math_us, 2),
            "flash_over_math": round(flash_us / math_us, 4),
            "revkernels_takes": "math" if tokens <= MATH_MAX_KEYS else "flash"}


def plot(path, rows, meta):
    """Time per call of both kinds and their ratio against tokens (ViT-S points). None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    vit = [r for r in rows if (r["heads"], r["head_dim"]) == VIT_S_HEADS]
    tokens = [r["tokens"] for r in vit]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(tokens, [r["flash_us"] for r in vit], marker="o", label="flash kernel")
    axes[0].plot(tokens, [r["math_us"] for r in vit], marker="o", label="math formula")
    axes[0].set_yscale("log")
    axes[0].set_title(f"compiled attention fwd+bwd, us per call ({VIT_S_HEADS[0]} heads of {VIT_S_HEADS[1]})")
    axes[1].plot(tokens, [r["flash_over_math"] for r in vit], marker="o", color="tab:green")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_title("flash time / math time (> 1: math faster)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("tokens (batch x tokens ~ %d)" % ROWS_PER_CALL)
        ax.axvline(MATH_MAX_KEYS, color="tab:red", ls="--", lw=0.8, label=f"MATH_MAX_KEYS = {MATH_MAX_KEYS}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{meta['device']} | torch {meta['torch']} | commit {meta['commit']}", fontsize=9)
    return save_figure(fig, path)


def parse_args(argv=None, default_out=RESULTS):
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_attention.py", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS} only, fewer repetitions")
    parser.add_argument("--tokens", type=int, nargs="+", help=f"tokens of the ViT-S points (default: {TOKENS})")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument("--reps", type=int, help="timing samples per kind and point (default 15, 3 with --quick)")
    parser.add_argument("--out", default=default_out, help=f"folder for CSV and PNG (default: {default_out})")
    args = parser.parse_args(argv)
    check_out_folder(parser, args.out)
    for name in ("threads", "reps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.tokens and min(args.tokens) < 1:
        parser.error("--tokens must be at least 1")
    return args


def run(args):
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # the scores of long sequences would land on fresh pages or not, by the run's history
    meta = provenance("cpu")
    reps = args.reps or (3 if args.quick else 15)
    rows = []
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    for point in tqdm(points(tokens), desc="attention", unit="point", file=sys.stderr, leave=False):
        rows.append(measure(point, reps, inner=max(1, 2000 // (point[2] * point[0]))))
    print(f"compiled attention step (fwd + VJP), fp32, {args.threads} threads, {meta['device']}, "
          f"torch {meta['torch']}, commit {meta['commit']}")
    print(f"{'batch':>5} {'heads':>5} {'tokens':>6} {'head_dim':>8} {'flash us':>10} {'math us':>10} "
          f"{'flash/math':>10}  revkernels takes")
    for r in rows:
        print(f"{r['batch']:>5} {r['heads']:>5} {r['tokens']:>6} {r['head_dim']:>8} {r['flash_us']:>10.1f} "
              f"{r['math_us']:>10.1f} {r['flash_over_math']:>10.2f}  {r['revkernels_takes']}")
    os.makedirs(args.out, exist_ok=True)
    written = [write_csv(os.path.join(args.out, "attention_cpu.csv"), rows, meta)]
    png = plot(os.path.join(args.out, "attention_cpu.png"), rows, meta)
    if png:
        written.append(png)
    print("wrote " + ", ".join(written), flush=True)
    return rows


def main(argv=None, default_out=RESULTS):
    run(parse_args(argv, default_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
