"""Memory benchmark (the suite's `memory` part): a train step of a stack of reversible MLP blocks with
the `autograd` engine (stores activations) against the `sequential` engine (rebuilds them), at
several depths: median step time, activation memory saved for backward, and peak memory.

The step's peak holds the parameters' grads as well as the activations: the saving shows in the peak
where activations outweigh the parameters, as in training with batch x tokens far above the width.
The CPU defaults (width 256, 1024 rows, depths 4 8 16) and the quick run's (width 64, 2048 rows,
depths 4 8) are such problems; on CUDA, width 768 and 32 x 197 rows (ViT-B at batch 32).

    python -m revkernels.bench.memory [--quick] [--device cpu|cuda] [--depths ...] [--out DIR]
    python -m revkernels.bench --parts memory      # as a part of the benchmark suite

Results: train_step_<device>.csv/.png under --out (the README's memory table comes from this CSV).
"""
import argparse
import os
import sys

import torch
from tqdm import tqdm

from revkernels.bench.helptext import description
from revkernels.bench.report import (DEFAULT_OUT, check_device, check_out_folder, plot_train_step, provenance,
                                     write_csv)
from revkernels.bench.train_step import TrainStepConfig, median_step_ms, peak_bytes, saved_bytes

ENGINES = ("autograd", "sequential")


def parse_args(argv=None, default_out=DEFAULT_OUT):
    parser = argparse.ArgumentParser(prog="python -m revkernels.bench.memory", description=description(__doc__))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to run on (default: cuda if available, else cpu)")
    parser.add_argument("--quick", action="store_true", help="a smaller problem, fewer depths and steps (on CPU: width "
                        "64, 2048 rows, depths 4 8; about 20 s on a 2-core CPU)")
    parser.add_argument("--depths", type=int, nargs="+", help="stack depths (default: 4 8 16 on CPU, 12 24 48 on CUDA)")
    parser.add_argument("--width", type=int, help="model width (default: 256 on CPU, 768 on CUDA)")
    parser.add_argument("--rows", type=int, help="batch x tokens per step (default: 1024 on CPU, 32*197 on CUDA)")
    parser.add_argument("--steps", type=int, help="timed steps per point (median reported; default 10, 3 with --quick)")
    parser.add_argument("--out", default=default_out, help=f"folder for CSV and PNG (default: ./{default_out})")
    args = parser.parse_args(argv)
    check_out_folder(parser, args.out)
    cuda = check_device(parser, args.device).type == "cuda"
    args.depths = args.depths or ([12, 24] if args.quick else [12, 24, 48]) if cuda else args.depths or ([4, 8] if args.quick else [4, 8, 16])
    args.width = args.width or (768 if cuda else (64 if args.quick else 256))
    args.rows = args.rows or (32 * 197 if cuda else (2048 if args.quick else 1024))
    args.steps = args.steps or (3 if args.quick else 10)
    for name in ("width", "rows", "steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    if any(d <= 0 for d in args.depths):
        parser.error("--depths must be positive")
    return args


def run(args):
    """Measures, prints the table, writes train_step_<device>.csv/.png under args.out; returns the rows."""
    cuda = torch.device(args.device).type == "cuda"
    meta = provenance(args.device)
    print(f"revkernels train-step benchmark on {meta['device']} (torch {meta['torch']}, commit {meta['commit']})")
    print(f"stack of reversible MLP blocks (LayerNorm, Linear {args.width}->{4 * args.width}, GELU, Linear): "
          f"{args.rows} rows x width {args.width}, {'bf16 autocast' if cuda else 'fp32'}, SGD step")
    rows = []
    points = [(depth, engine) for depth in args.depths for engine in ENGINES]
    for depth, engine in tqdm(points, desc="memory", unit="config", file=sys.stderr, leave=False):
        config = TrainStepConfig(engine=engine, depth=depth, width=args.width, rows=args.rows, device=args.device,
                                 autocast_dtype="bfloat16" if cuda else None, steps=args.steps,
                                 warmup=1 if args.quick else 3)
        rows.append({"engine": engine, "depth": depth, "width": args.width, "rows": args.rows,
                     "dtype": config.autocast_dtype or "float32",
                     "step_ms": round(median_step_ms(config), 3),
                     "saved_mib": round(saved_bytes(config) / 2**20, 3),
                     "peak_mib": round(peak_bytes(config) / 2**20, 3)})

    print()
    print(f"{'depth':>5}  {'engine':<11} {'step ms':>9} {'saved MiB':>10} {'peak MiB':>9}   {'time vs autograd':>16} {'saved vs autograd':>17}")
    for depth in args.depths:
        base = next(r for r in rows if r["depth"] == depth and r["engine"] == "autograd")
        for r in (r for r in rows if r["depth"] == depth):
            time_ratio = r["step_ms"] / base["step_ms"]
            saved_ratio = base["saved_mib"] / r["saved_mib"] if r["saved_mib"] else float("inf")
            print(f"{depth:>5}  {r['engine']:<11} {r['step_ms']:>9.1f} {r['saved_mib']:>10.1f} {r['peak_mib']:>9.1f}"
                  f"   {time_ratio:>15.2f}x {saved_ratio:>15.1f}x less")
    os.makedirs(args.out, exist_ok=True)
    csv_path = write_csv(os.path.join(args.out, f"train_step_{'cuda' if cuda else 'cpu'}.csv"), rows, meta)
    png_path = plot_train_step(os.path.join(args.out, f"train_step_{'cuda' if cuda else 'cpu'}.png"), rows, meta)
    print(f"\nwrote {csv_path}" + (f" and {png_path}" if png_path else " (install matplotlib for the plot)"))
    return rows


def main(argv=None, default_out=DEFAULT_OUT):
    run(parse_args(argv, default_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
