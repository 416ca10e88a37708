"""PETRA's accuracy and gradient quality against backprop and delayed gradients, on real data (digits).

    python benchmarks/bench_petra_accuracy.py            # RevNet-18 (CIFAR stem), digits 8x8, 3 seeds x 3 methods
    python benchmarks/bench_petra_accuracy.py --quick    # smoke run of the same code (< 30 s)

Every (method, seed) is one run of the trainer CLI (`python -m revkernels.petra.train`, simulate runtime,
one torch thread, ``--jobs`` runs at a time) with the same recipe: SGD + Nesterov 0.9, weight decay 5e-4
off norm layers and biases, batch --batch-size with --accum accumulation, base lr --lr (peak
lr * batch * accum / 256), --warmup-epochs of linear warm-up, then x0.1 at --milestones (epochs). The
seed fixes the model's initialisation and the batch order (the train/test split is fixed). Methods:
backprop (end to end), petra (10 stages, one per stage) and delayed (the same pipeline with input and
parameter buffers: stale parameters in the backward). The gradient analysis (``--analyze-every``
optimizer steps) compares, per stage, the gradient each method applies with the end-to-end gradient
of the same batches at the current parameters (cosine similarity, norm ratio).

Printed: per method, test accuracy mean +- std over the seeds, the gap to backprop, and the mean
cosine similarity (over every stage and analysis step; the head's is near 1, the stem's the lowest).
Results: ``petra_digits_<device>.csv`` under --out (one row per run, with provenance).

Why the recipe (the CLI's defaults on digits; ``revkernels/petra/train.py``'s docstring has the
details): digits is tiny (1,437 training images: 44 batches of 32 per epoch) while RevNet-18's 10-stage
pipeline makes the stem's gradient 18 ticks stale, 40% of an epoch, during which the network changes
fast. The analysis shows the early stages' gradients nearly orthogonal to the end-to-end ones early in
training (PETRA and delayed alike), so a peak lr that backprop tolerates (0.025, the paper's base 0.1)
makes PETRA diverge; a longer warm-up (the paper's 5 epochs) only postpones it. The drift of the stale
stages' parameters during the delay, ~ peak lr / k per tick, is what to keep small: base lr 0.01 with
batch 32 and k = 4 (peak 0.005), 1 warm-up epoch and x0.1 at 50% and 75% of training. (Base 0.02 with
k = 2, the same peak with twice the drift per tick, gave PETRA 97.68 +- 0.80 % vs backprop 99.44 +-
0.28 % over 3 seeds, mean cosine 0.661 vs delayed's 0.672.)
With this recipe (benchmarks/results/petra_digits_cpu.csv, 2 busy CPU cores, 579 s): backprop 99.16 +-
0.48 %, PETRA 98.24 +- 0.43 % (-0.93 points), delayed 98.61 +- 0.28 % (-0.56); mean cosine PETRA 0.819 >
delayed 0.806 (per seed: 0.803/0.852/0.802 vs 0.798/0.814/0.806); the stem's is the lowest, the head's
the highest. Three seeds on 360 test images (one image = 0.28 points): the accuracy differences between
PETRA and delayed are within the noise.
"""
import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time

from revkernels.bench.helptext import description
from revkernels.bench.report import provenance, write_csv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("backprop", "petra", "delayed")


def _argv(cfg, method, seed, out):
    argv = ["--model", "revnet18", "--stem", "cifar", "--dataset", "digits", "--image-size", str(cfg["image_size"]),
            "--method", method, "--seed", str(seed), "--epochs", str(cfg["epochs"]), "--batch-size",
            str(cfg["batch_size"]), "--accum", str(cfg["accum"]), "--lr", str(cfg["lr"]), "--warmup-epochs",
            str(cfg["warmup_epochs"]), "--analyze-every", str(cfg["analyze_every"]), "--threads", "1",
            "--no-progress", "--out", out]
    if cfg["milestones"]:
        argv += ["--milestones", *map(str, cfg["milestones"])]
    if cfg["max_steps"]:
        argv += ["--max-steps", str(cfg["max_steps"])]
    return argv


def _run(job):
    """One training run in this (worker) process; returns its CSV row."""
    import torch

    from revkernels.petra.train import main

    cfg, method, seed = job
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        summary = main(_argv(cfg, method, seed, out))
        elapsed = time.perf_counter() - t0
        records = [json.loads(line) for line in open(os.path.join(out, "analysis.jsonl"))]
        config = json.load(open(os.path.join(out, "config.json")))
    stages = sorted({r["stage"] for r in records})
    per_stage = [statistics.fmean(r["cosine"] for r in records if r["stage"] == s) for s in stages]
    return {"method": method, "seed": seed, "model": "revnet18", "stem": "cifar", "dataset": "digits",
            "image_size": cfg["image_size"], "epochs": summary["epoch"], "steps": summary["step"],
            "batch_size": cfg["batch_size"], "accum": cfg["accum"], "base_lr": cfg["lr"],
            "peak_lr": config["peak_lr"], "warmup_epochs": cfg["warmup_epochs"],
            "milestones": " ".join(map(str, cfg["milestones"])), "test_acc": summary["final_test_acc"],
            "train_loss_last_epoch": summary["train_loss"],
            "mean_cosine": summary["analysis_mean_cosine"], "mean_norm_ratio": summary["analysis_mean_norm_ratio"],
            "stage_mean_cosine": " ".join(f"{c:.4f}" for c in per_stage), "analysis_records": len(records),
            "peak_buffer_bytes_total": sum(summary["peak_buffer_bytes"]), "wall_s": round(elapsed, 2)}


def make_parser():
    p = argparse.ArgumentParser(description=description(__doc__))
    p.add_argument("--quick", action="store_true", help="smoke run: 4x4 images, a few steps, one seed")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--image-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01, help="base lr for a batch of 256")
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--milestones", type=float, nargs="*", default=None,
                   help="epochs of the x0.1 steps (default: 50%% and 75%% of --epochs)")
    p.add_argument("--analyze-every", type=int, default=11, help="optimizer steps between gradient analyses")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    return p


def main(argv=None):
    args = make_parser().parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.image_size, args.batch_size, args.analyze_every = args.seeds[:1], 1, 4, 16, 1
        args.jobs = 1  # in this process: no worker start-up
    milestones = args.milestones if args.milestones is not None else [args.epochs * 0.5, args.epochs * 0.75]
    cfg = {"epochs": args.epochs, "image_size": args.image_size, "batch_size": args.batch_size, "accum": args.accum,
           "lr": args.lr, "warmup_epochs": args.warmup_epochs, "milestones": [round(m, 3) for m in milestones],
           "analyze_every": args.analyze_every, "max_steps": 4 if args.quick else None}
    jobs = [(cfg, m, s) for s in args.seeds for m in args.methods]
    t0 = time.perf_counter()
    if args.jobs > 1 and len(jobs) > 1:
        with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(jobs))) as pool:
            rows = pool.map(_run, jobs, chunksize=1)
    else:
        rows = [_run(job) for job in jobs]
    import torch

    torch.set_num_threads(1)  # what each run used, for the provenance's thread count
    meta = dict(provenance("cpu"), load_avg_1min=round(os.getloadavg()[0], 2),
                total_wall_s=round(time.perf_counter() - t0, 1))
    path = write_csv(os.path.join(args.out, "petra_digits_cpu.csv"), rows, meta)

    print(f"RevNet-18 (CIFAR stem) on digits {args.image_size}x{args.image_size}, {args.epochs} epochs, batch "
          f"{args.batch_size} x accum {args.accum}, base lr {args.lr} (peak {rows[0]['peak_lr']:.4g}), warm-up "
          f"{args.warmup_epochs} epochs, x0.1 at epochs {cfg['milestones']}; seeds {args.seeds}")
    acc = {m: [r["test_acc"] * 100 for r in rows if r["method"] == m] for m in args.methods}
    def mean_of(key, m):
        values = [r[key] for r in rows if r["method"] == m and r[key] is not None]
        return statistics.fmean(values) if values else float("nan")

    cos = {m: mean_of("mean_cosine", m) for m in args.methods}
    ratio = {m: mean_of("mean_norm_ratio", m) for m in args.methods}
    for m in args.methods:
        sd = statistics.stdev(acc[m]) if len(acc[m]) > 1 else 0.0
        gap = f"  gap to backprop {statistics.fmean(acc[m]) - statistics.fmean(acc['backprop']):+.2f} points" \
            if "backprop" in acc and m != "backprop" else ""
        print(f"{m:9s} test accuracy {statistics.fmean(acc[m]):6.2f} +- {sd:4.2f} %   mean cosine {cos[m]:.4f}   "
              f"mean norm ratio {ratio[m]:.4f}{gap}")
    if {"petra", "delayed"} <= set(args.methods):
        print(f"PETRA's gradient closer to end-to-end than delayed's (mean cosine): "
              f"{'yes' if cos['petra'] > cos['delayed'] else 'no'} ({cos['petra']:.4f} vs {cos['delayed']:.4f})")
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
