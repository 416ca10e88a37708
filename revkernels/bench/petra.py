"""PETRA distributed-runtime throughput against single-process reversible backprop, in one run.

    python -m revkernels.bench.petra                 # RevNet-18 (CIFAR stem), 16x16, batch 32, 2 CPU ranks
    python -m revkernels.bench.petra --quick         # a smoke run of the same code (8x8, batch 4, few steps)
    python benchmarks/bench_petra.py ...             # the same, from a checkout (results in benchmarks/results)
    python -m revkernels.bench --parts petra         # as a part of the benchmark suite

Variants (same model, same seed, random images and labels, fp32 on CPU):
    revbackprop_<T>thread   `Trainer(method="revbackprop")` in this process with T torch threads, for
                            T = 1 and T = --nproc (the same cores the distributed run uses)
    petra_distributed       `revkernels.petra.distributed` with --nproc processes (one torch thread each),
                            the model's stages split into --nproc contiguous groups (--groups to choose)
Time per training batch: the median over the steps after --warmup (for PETRA the median tick time on
the last rank, the pipeline's steady state: every rank runs one forward and one backward per tick).
The ratio printed is the fastest reversible-backprop variant's time per batch over PETRA's (the
speed-up; the CSV also has it against each baseline); the issue's target is >= 1.6x with 2 processes
on a machine with 2+ free cores. On a shared machine the numbers are noisy (a 2-thread baseline on 2
busy cores can be much slower than 1 thread): the CSV records the load average with the commit and
versions.
Results: ``petra_<device>.csv`` under --out.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from tqdm import tqdm

from revkernels.bench.report import DEFAULT_OUT, provenance, write_csv
from revkernels.petra import Trainer
from revkernels.petra.distributed import PipelineRank, init, launch


def _model(cfg):
    from revkernels import models

    torch.manual_seed(0)
    return getattr(models, cfg["model"])(num_classes=10, stem=cfg["stem"])


def _data(cfg, n):
    g = torch.Generator().manual_seed(1)
    s, b = cfg["image_size"], cfg["batch"]
    return [(torch.randn(b, 3, s, s, generator=g), torch.randint(0, 10, (b,), generator=g)) for _ in range(n)]


def _bench_rank(cfg):
    """One rank: ticks timed from the end of one to the end of the next."""
    model = _model(cfg)
    init(timeout=60.0)
    pr = PipelineRank(model, groups=cfg["groups"], timeout=60.0, accum_k=cfg["accum"], base_lr=0.05)
    data = _data(cfg, cfg["warmup"] + cfg["steps"])
    times, last = [], time.perf_counter()
    for x, y in data:
        pr.train_step(x, y)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    pr.flush()
    groups = pr.trainer.groups
    pr.close()
    return {"tick_s": times[cfg["warmup"]:], "groups": groups}


def _bench_revbackprop(cfg, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainer = Trainer(_model(cfg), "revbackprop", accum_k=cfg["accum"], base_lr=0.05)
        times = []
        for x, y in _data(cfg, cfg["warmup"] + cfg["steps"]):
            t0 = time.perf_counter()
            trainer.train_step(x, y)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return times[cfg["warmup"]:]


def parse_args(argv=None, default_out=DEFAULT_OUT):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes and few steps (smoke run)")
    p.add_argument("--model", default="revnet18", choices=["revnet18", "revnet34", "revnet50"])
    p.add_argument("--stem", default="cifar", choices=["cifar", "imagenet"])
    p.add_argument("--image-size", type=int, default=None, help="default 16 (quick: 8)")
    p.add_argument("--batch", type=int, default=None, help="default 32 (quick: 4)")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2, help="distributed ranks (processes)")
    p.add_argument("--groups", type=int, nargs="*", default=None,
                   help="stage-group sizes, one per rank (default: an even split)")
    p.add_argument("--warmup", type=int, default=None, help="steps not timed (default 2*nproc + 2; quick: same)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; quick: 4)")
    p.add_argument("--out", default=default_out, help=f"folder for the CSV (default: {default_out})")
    return p.parse_args(argv)


def run(args):
    """Measures, prints the speed-ups, writes petra_cpu.csv under args.out; returns the rows."""
    cfg = {"model": args.model, "stem": args.stem, "accum": args.accum,
           "image_size": args.image_size or (8 if args.quick else 16), "batch": args.batch or (4 if args.quick else 32),
           "warmup": args.warmup if args.warmup is not None else 2 * args.nproc + 2,
           "steps": args.steps or (4 if args.quick else 20),
           "groups": args.groups if args.groups else args.nproc}

    meta = provenance("cpu")
    meta.update(model=cfg["model"], stem=cfg["stem"], image_size=cfg["image_size"], batch=cfg["batch"],
                accum=cfg["accum"], warmup=cfg["warmup"], steps=cfg["steps"],
                loadavg=" ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "")
    rows, times = [], {}
    progress = tqdm(total=len({1, args.nproc}) + 1, desc="petra", unit="variant", file=sys.stderr, leave=False)
    for threads in sorted({1, args.nproc}):
        name = f"revbackprop_{threads}thread"
        times[name] = statistics.median(_bench_revbackprop(cfg, threads))
        rows.append({"variant": name, "processes": 1, "threads": threads, "groups": ""})
        print(f"{name:24s} {times[name] * 1e3:9.1f} ms/batch  {cfg['batch'] / times[name]:8.1f} images/s", flush=True)
        progress.update()
    with tempfile.TemporaryDirectory() as tmp:
        results = launch(_bench_rank, args.nproc, (cfg,), log_dir=tmp, threads=1, timeout=1800)
    progress.update()
    progress.close()
    times["petra_distributed"] = statistics.median(results[-1]["tick_s"])
    groups = results[-1]["groups"]
    rows.append({"variant": "petra_distributed", "processes": args.nproc, "threads": 1,
                 "groups": " ".join(f"{g[0]}-{g[-1]}" for g in groups)})
    print(f"{'petra_distributed':24s} {times['petra_distributed'] * 1e3:9.1f} ms/batch  "
          f"{cfg['batch'] / times['petra_distributed']:8.1f} images/s  ({args.nproc} processes, stage groups "
          f"{[f'{g[0]}-{g[-1]}' for g in groups]})", flush=True)
    base = f"revbackprop_{args.nproc}thread"
    for row in rows:
        t = times[row["variant"]]
        row.update(step_ms=round(t * 1e3, 3), images_per_s=round(cfg["batch"] / t, 2),
                   speedup_vs_revbackprop_1thread=round(times["revbackprop_1thread"] / t, 3),
                   speedup_vs_revbackprop_same_cores=round(times[base] / t, 3),
                   speedup_vs_revbackprop_best=round(min(times[k] for k in times if k.startswith("revbackprop")) / t, 3))
    path = write_csv(os.path.join(args.out, "petra_cpu.csv"), rows, meta)
    best = min((k for k in times if k.startswith("revbackprop")), key=times.get)
    ratio = times[best] / times["petra_distributed"]
    print(f"speed-up of PETRA ({args.nproc} processes) over reversible backprop: {ratio:.2f}x (over the fastest, "
          f"{best}; {times[base] / times['petra_distributed']:.2f}x over {base}); target >= 1.6x; wrote {path}",
          flush=True)
    return rows


def main(argv=None, default_out=DEFAULT_OUT):
    run(parse_args(argv, default_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
