"""PETRA distributed-runtime throughput against single-process reversible backprop, in one run.

    python -m revkernels.bench.petra                 # RevNet-18 (CIFAR stem), 16x16, batch 32, 2 CPU ranks
    python -m revkernels.bench.petra --quick         # a smoke run of the same code (8x8, batch 4, few steps)
    python benchmarks/bench_petra.py ...             # the same, from a checkout (results in benchmarks/results)
    python -m revkernels.bench --parts petra         # as a part of the benchmark suite

Variants (same model, same seed, random images and labels, fp32 on CPU):
    revbackprop_<T>thread   `Trainer(method="revbackprop")` in this process with T torch threads, for
                            T = 1 and T = --nproc (the same cores the distributed run uses)
    petra_distributed       `revkernels.petra.distributed` with --nproc processes (one torch thread each),
                            the model's stages split into --nproc contiguous groups: ``--balance time``
                            (default) minimises the largest group's profiled tick, ``--balance count``
                            splits by stage count, --groups gives the sizes
Time per training batch: the median over the steps after --warmup (for PETRA the median tick of its
busiest rank, the one whose compute per tick is the longest: in the pipeline's steady state every rank
runs one tick, one forward and one backward, per batch). The ratio printed is the fastest
reversible-backprop variant's time per batch over PETRA's (the speed-up; the CSV also has it against
each baseline). PETRA pays off where a stage group's compute outweighs the messages between the
processes: the --quick shapes are a smoke test, too small for that.

Groups. Before the runs, `revkernels.petra.stage_costs` times every stage's tick (forward + rebuild +
VJP, and 1 / --accum of its optimizer step) in this process on one thread; ``--balance time`` splits the
stages by these times (a group's tick is the sum of its stages'; CSV column ``stage_ms``).

Bound. Each rank times its compute in every tick (the worker's step: forward, rebuild, VJP and
optimizer steps, without the waits for and the posting of messages). ``max_group_ms`` is the busiest
rank's median compute per tick, ``bound`` = revbackprop_1thread / max_group_ms (the speed-up PETRA
would reach if a tick were only the busiest rank's compute) and ``efficiency`` = speed-up over
revbackprop_1thread / bound = the busiest rank's compute / its tick (medians), at most 1: the share
of the tick spent computing (CSV columns of PETRA's row). On a shared machine the numbers are noisy (a
2-thread baseline on 2 busy cores can be much slower than 1 thread): the CSV records the load average
with the commit and versions.
Results: ``petra_<device>.csv`` under --out.

Projected speed-up (``--project``; ``--quick`` for a CPU smoke run of the same code):

    python -m revkernels.bench.petra --project [--link-gb-s 25] [--link-latency-us 10] [--device cuda]

projects PETRA's step time on J devices from per-stage times measured on *one* device, for RevNet-18
and RevNet-34 (``--project-models``): on CUDA the CIFAR stem at 32x32 and the ImageNet stem at 224x224
(batch 64, ``--batch``); on CPU the CIFAR stem at 16x16 (batch 16; quick: 8x8, batch 2) - CPU numbers
only smoke-test the code and are no GPU figures. fp32, train mode, random data.

Measured, per stage of the model's own stage list (`revkernels.petra.partition`; medians over
``--steps`` repetitions after ``--warmup``, the device synchronised around each timed call):
    forward_ms   the no-grad forward PETRA runs (`Stage.forward`); for the head, forward + loss under
                 autograd;
    rebuild_ms   reversible stages: the inverse alone (`ReversibleBlock.inverse`, no grad); else 0;
    vjp_ms       `Stage.backward` (what PETRA runs: the fused rebuild + VJP for reversible stages, the
                 recomputed forward + VJP from the FIFO's input for the others) minus rebuild_ms; for the
                 head, its loss.backward();
    petra_ms     forward_ms + rebuild_ms + vjp_ms: the stage's work per tick;
    fwd_send_bytes / bwd_send_bytes: its output, and its rebuilt input plus that input's grad (0 for
                 the stem);
and ``backprop_ms``: one standard-backprop step of the whole model (forward + loss + backward under
ordinary autograd; no optimizer step anywhere).

Model (steady state: pipeline fill/drain, optimizer steps and the host are ignored; each worker on its
own device at the measured single-device speed, no contention):
    reversible backprop on one device:  T_rev = sum over stages of petra_ms
    a worker running stages a..b:       C = sum of their petra_ms;
                                        X = max(bytes it sends, bytes it receives) / link
                                            + latency x (messages it sends: 1 or 2)
                                        (a full-duplex link of --link-gb-s GB/s per worker and direction,
                                        shared by its two neighbours' messages)
    PETRA tick, overlap:                max over workers of max(C, X)   (transfer hidden behind compute
                                        when it is shorter: needs sends posted as soon as a message is
                                        ready and double-buffered receives)
    PETRA tick, serial:                 max over workers of C + X       (transfer after compute: what the
                                        runtime here does, sending at the end of its tick)
    speed-up(J) = T_rev / tick; also backprop_ms / tick (``speedup_vs_backprop_*``).
J = 1, 2, 4, ..., and the number of stages (one stage per device); for each J the contiguous grouping
of the stages with the smallest tick (exact dynamic programming, per transfer model). The paper
(Rivaud et al., ICLR 2025) reports 3.0x at J = 10 for RevNet-18.
Results: ``petra_projection_<device>.csv`` (one row per model, stem and J, with provenance),
``petra_projection_stages_<device>.csv`` (the per-stage measurements, to re-project with another link
model) and ``petra_projection_<device>.png`` (speed-up against J).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from tqdm import tqdm

from revkernels.bench.helptext import description
from revkernels.bench.report import (DEFAULT_OUT, check_device, check_out_folder, plotted, provenance, synchronize,
                                     write_csv, write_results)
from revkernels.petra import Trainer, balanced_sizes, stage_costs
from revkernels.petra.distributed import PipelineRank, init, launch
from revkernels.petra.partition import BALANCES, count_sizes


def _model(cfg):
    from revkernels import models

    torch.manual_seed(0)
    return getattr(models, cfg["model"])(num_classes=10, stem=cfg["stem"])


def _data(cfg, n):
    g = torch.Generator().manual_seed(1)
    s, b = cfg["image_size"], cfg["batch"]
    return [(torch.randn(b, 3, s, s, generator=g), torch.randint(0, 10, (b,), generator=g)) for _ in range(n)]


def _bench_rank(cfg):
    """One rank: ticks timed from the end of one to the end of the next, and the compute in each (the
    worker's step, what the rank runs between receiving and sending)."""
    model = _model(cfg)
    init(timeout=60.0)
    pr = PipelineRank(model, groups=cfg["groups"], timeout=60.0, accum_k=cfg["accum"], base_lr=0.05)
    compute, step = [], pr.worker.step

    def timed_step(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            compute.append(time.perf_counter() - t0)

    pr.worker.step = timed_step
    data = _data(cfg, cfg["warmup"] + cfg["steps"])
    times, computes, last = [], [], time.perf_counter()
    for x, y in data:
        done = len(compute)
        pr.train_step(x, y)
        now = time.perf_counter()
        times.append(now - last)
        computes.append(sum(compute[done:]))
        last = now
    pr.flush()
    groups = pr.trainer.groups
    pr.close()
    return {"tick_s": times[cfg["warmup"]:], "compute_s": computes[cfg["warmup"]:], "groups": groups}


def busiest(results):
    """(median tick s, median compute s) of the rank whose median compute per tick is the longest,
    from `_bench_rank`'s results (one per rank)."""
    rank = max(results, key=lambda r: statistics.median(r["compute_s"]))
    return statistics.median(rank["tick_s"]), statistics.median(rank["compute_s"])


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
    p = argparse.ArgumentParser(prog="python -m revkernels.bench.petra", description=description(__doc__))
    p.add_argument("--quick", action="store_true", help="tiny shapes and few steps (smoke run)")
    p.add_argument("--model", default="revnet18", choices=["revnet18", "revnet34", "revnet50"])
    p.add_argument("--stem", default="cifar", choices=["cifar", "imagenet"])
    p.add_argument("--image-size", type=int, default=None, help="default 16 (quick: 8)")
    p.add_argument("--batch", type=int, default=None, help="default 32 (quick: 4)")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2, help="distributed ranks (processes)")
    p.add_argument("--balance", default="time", choices=BALANCES,
                   help="stage groups: time (the largest group's profiled tick minimised; default) or count")
    p.add_argument("--groups", type=int, nargs="*", default=None,
                   help="stage-group sizes, one per rank (overrides --balance)")
    p.add_argument("--warmup", type=int, default=None, help="steps not timed (default 2*nproc + 2; quick: same)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; quick: 4)")
    p.add_argument("--out", default=default_out, help=f"folder for the CSV (default: {default_out})")
    p.add_argument("--project", action="store_true",
                   help="projected J-stage speed-up from per-stage times measured on this device (module docstring)")
    p.add_argument("--project-models", nargs="+", default=["revnet18", "revnet34"],
                   choices=["revnet18", "revnet34", "revnet50"], help="--project: the models (default revnet18 revnet34)")
    p.add_argument("--device", default=None, help="--project: where to measure (default cuda if available, else cpu)")
    p.add_argument("--link-gb-s", type=float, default=25.0,
                   help="--project: link bandwidth per worker and direction, GB/s (default 25)")
    p.add_argument("--link-latency-us", type=float, default=10.0, help="--project: latency per message, us (default 10)")
    args = p.parse_args(argv)
    check_out_folder(p, args.out)
    if args.link_gb_s <= 0 or args.link_latency_us < 0:
        p.error("--link-gb-s must be > 0 and --link-latency-us >= 0")
    for name in ("image_size", "batch", "accum", "nproc", "steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.groups is not None and (not args.groups or len(args.groups) != args.nproc or min(args.groups) < 1):
        p.error(f"--groups must be {args.nproc} positive sizes (one per rank, --nproc), got {args.groups}")
    if args.device is not None:
        check_device(p, args.device)
    return args


QUICK_NOTE = "--quick: a smoke test, shapes too small for the processes' messages to pay off"


def run(args):
    """Measures, prints the speed-ups, writes petra_cpu.csv under args.out; returns the rows. With
    ``args.project``: `run_projection` instead."""
    if getattr(args, "project", False):
        return run_projection(args)
    cfg = {"model": args.model, "stem": args.stem, "accum": args.accum,
           "image_size": args.image_size or (8 if args.quick else 16), "batch": args.batch or (4 if args.quick else 32),
           "warmup": args.warmup if args.warmup is not None else 2 * args.nproc + 2,
           "steps": args.steps or (4 if args.quick else 20)}
    num_stages = len(_model(cfg).stages)  # (checked before the profiling)
    if args.nproc > num_stages:
        raise ValueError(f"revkernels: --nproc must be at most {num_stages} (the stages of {args.model}), got {args.nproc}")
    if args.groups and sum(args.groups) != num_stages:
        raise ValueError(f"revkernels: --groups must be {args.nproc} sizes summing to {num_stages} (the stages of "
                         f"{args.model}), got {args.groups}")
    costs = _profile(cfg)
    if args.groups:
        cfg["groups"] = list(args.groups)
    elif args.balance == "time":
        cfg["groups"] = balanced_sizes(costs, args.nproc)
    else:
        cfg["groups"] = count_sizes(len(costs), args.nproc)
    group_ms, start = [], 0
    for n in cfg["groups"]:
        group_ms.append(sum(costs[start:start + n]) * 1e3)
        start += n
    print(f"profiled stage ticks (ms, 1 thread): {' '.join(f'{c * 1e3:.1f}' for c in costs)}; group ticks (ms): "
          f"{' '.join(f'{g:.1f}' for g in group_ms)}", flush=True)

    meta = provenance("cpu")
    meta.update(model=cfg["model"], stem=cfg["stem"], image_size=cfg["image_size"], batch=cfg["batch"],
                accum=cfg["accum"], warmup=cfg["warmup"], steps=cfg["steps"], balance="given" if args.groups else
                args.balance, stage_ms=" ".join(f"{c * 1e3:.2f}" for c in costs),
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
    times["petra_distributed"], compute_s = busiest(results)
    groups = results[-1]["groups"]
    rows.append({"variant": "petra_distributed", "processes": args.nproc, "threads": 1,
                 "groups": " ".join(f"{g[0]}-{g[-1]}" for g in groups)})
    print(f"{'petra_distributed':24s} {times['petra_distributed'] * 1e3:9.1f} ms/batch  "
          f"{cfg['batch'] / times['petra_distributed']:8.1f} images/s  ({args.nproc} processes, stage groups "
          f"{[f'{g[0]}-{g[-1]}' for g in groups]})", flush=True)
    base = f"revbackprop_{args.nproc}thread"
    bound = times["revbackprop_1thread"] / compute_s
    speedup = times["revbackprop_1thread"] / times["petra_distributed"]
    for row in rows:
        t = times[row["variant"]]
        petra = row["variant"] == "petra_distributed"
        row.update(quick=bool(args.quick), step_ms=round(t * 1e3, 3), images_per_s=round(cfg["batch"] / t, 2),
                   speedup_vs_revbackprop_1thread=round(times["revbackprop_1thread"] / t, 3),
                   speedup_vs_revbackprop_same_cores=round(times[base] / t, 3),
                   speedup_vs_revbackprop_best=round(min(times[k] for k in times if k.startswith("revbackprop")) / t, 3),
                   max_group_ms=round(compute_s * 1e3, 3) if petra else "", bound=round(bound, 3) if petra else "",
                   efficiency=round(speedup / bound, 3) if petra else "")
    path = write_csv(os.path.join(args.out, "petra_cpu.csv"), rows, meta)
    best = min((k for k in times if k.startswith("revbackprop")), key=times.get)
    ratio = times[best] / times["petra_distributed"]
    print(f"speed-up of PETRA ({args.nproc} processes) over reversible backprop: {ratio:.2f}x (over the fastest, "
          f"{best}; {times[base] / times['petra_distributed']:.2f}x over {base})"
          + (f" ({QUICK_NOTE})" if args.quick else "") + f"; wrote {path}", flush=True)
    print(f"over revbackprop_1thread: {speedup:.2f}x of a bound of {bound:.2f}x for stage groups "
          f"{[f'{g[0]}-{g[-1]}' for g in groups]} (the busiest rank computes {compute_s * 1e3:.1f} ms of its "
          f"{times['petra_distributed'] * 1e3:.1f} ms tick: efficiency {speedup / bound:.0%})", flush=True)
    return rows


def _profile(cfg):
    """Per-stage tick seconds (`stage_costs`) of the benchmark's model on its first batch, on one thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return stage_costs(_model(cfg), _data(cfg, 1)[0][0], warmup=1 if cfg["steps"] < 10 else 2,
                           reps=3 if cfg["steps"] < 10 else 9, accum_k=cfg["accum"])
    finally:
        torch.set_num_threads(old)


def main(argv=None, default_out=DEFAULT_OUT):
    run(parse_args(argv, default_out))
    return 0



# --- projected pipeline speed-up (--project) ------------------------------------------------------------

PROJECT_CONFIGS_CUDA = (("cifar", 32), ("imagenet", 224))


def _timed(fn, device):
    """(seconds, result) of one call of `fn`, the device synchronised before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def _nbytes(xs):
    return sum(t.numel() * t.element_size() for t in xs if t is not None)


def measure_stages(model_name, stem, image_size, batch, device, warmup, reps):
    """Per stage of `model_name` (its own stage list, `revkernels.petra.partition`): the median forward,
    rebuild and VJP times (ms) after `warmup` untimed repetitions, and the bytes it sends forward (its
    output) and backward (its rebuilt input and the input's grad); plus ``backprop_ms``, the median
    standard-backprop step (forward + loss + backward under ordinary autograd, no optimizer step)."""
    from revkernels import models
    from revkernels.petra.partition import partition

    torch.manual_seed(0)
    model = getattr(models, model_name)(num_classes=10 if stem == "cifar" else 1000, stem=stem).to(device).train()
    stages = partition(model)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, image_size, image_size, generator=g).to(device)
    labels = torch.randint(0, 10 if stem == "cifar" else 1000, (batch,), generator=g).to(device)
    rows, x = [], (images,)
    for s in stages:
        times = {"forward": [], "rebuild": [], "backward": []}
        if s.is_last:
            def fwd_loss():
                leaves = tuple(t.detach().requires_grad_() for t in x)
                with torch.enable_grad():
                    return torch.nn.functional.cross_entropy(s.module(*leaves), labels)
            for r in range(warmup + reps):
                t_f, loss = _timed(fwd_loss, device)
                t_b, _ = _timed(loss.backward, device)
                if r >= warmup:
                    times["forward"].append(t_f)
                    times["backward"].append(t_b)
            y = ()
        else:
            with torch.no_grad():
                y = s.module(*x)
            y = y if isinstance(y, tuple) else (y,)
            dy = tuple(torch.randn(t.shape, generator=g).to(device, t.dtype) for t in y)
            for r in range(warmup + reps):
                t_f, _ = _timed(lambda: s.forward(x), device)
                t_b, _ = _timed(lambda: s.backward(y, dy), device)  # what PETRA runs: rebuild + VJP
                t_r = _timed(lambda: s.module.inverse(*y), device)[0] if s.reversible else 0.0
                if r >= warmup:
                    times["forward"].append(t_f)
                    times["backward"].append(t_b)
                    times["rebuild"].append(t_r)
        med = {k: statistics.median(v) * 1e3 if v else 0.0 for k, v in times.items()}
        rows.append({"stage": s.index, "kind": s.kind, "reversible": s.reversible,
                     "forward_ms": med["forward"], "rebuild_ms": med["rebuild"],
                     "vjp_ms": max(med["backward"] - med["rebuild"], 0.0),
                     "petra_ms": med["forward"] + med["backward"],
                     "fwd_send_bytes": _nbytes(y), "bwd_send_bytes": 0 if s.is_first else 2 * _nbytes(x)})
        x = y
        for p in s.module.parameters():
            p.grad = None

    def backprop_step():
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
    bp = []
    for r in range(warmup + reps):
        t, _ = _timed(backprop_step, device)
        model.zero_grad(set_to_none=True)
        if r >= warmup:
            bp.append(t)
    return rows, statistics.median(bp) * 1e3


def _group_cost(stages, a, b, link_gb_s, latency_us, overlap):
    """(tick ms, compute ms, transfer ms) of one worker running stages a..b (inclusive) for a tick."""
    last = len(stages) - 1
    compute = sum(s["petra_ms"] for s in stages[a:b + 1])
    out_b = (stages[b]["fwd_send_bytes"] if b < last else 0) + (stages[a]["bwd_send_bytes"] if a > 0 else 0)
    in_b = (stages[a - 1]["fwd_send_bytes"] if a > 0 else 0) + (stages[b + 1]["bwd_send_bytes"] if b < last else 0)
    messages = (b < last) + (a > 0)
    comm = max(out_b, in_b) / (link_gb_s * 1e9) * 1e3 + messages * latency_us * 1e-3
    return (max(compute, comm) if overlap else compute + comm), compute, comm


def best_grouping(stages, workers, link_gb_s, latency_us, overlap):
    """The contiguous split of the stages into `workers` groups with the smallest tick (the largest
    group cost, `_group_cost`): exact dynamic programming. Returns (tick ms, group sizes)."""
    n = len(stages)
    cost = {(a, b): _group_cost(stages, a, b, link_gb_s, latency_us, overlap)[0] for a in range(n) for b in range(a, n)}
    inf = float("inf")
    best = [[(inf, None)] * (n + 1) for _ in range(workers + 1)]  # best[w][i]: first i stages on w workers
    best[0][0] = (0.0, None)
    for w in range(1, workers + 1):
        for i in range(w, n + 1):
            best[w][i] = min(((max(best[w - 1][j][0], cost[(j, i - 1)]), j) for j in range(w - 1, i)
                              if best[w - 1][j][0] < inf), default=(inf, None))
    sizes, i = [], n
    for w in range(workers, 0, -1):
        j = best[w][i][1]
        sizes.append(i - j)
        i = j
    return best[workers][n][0], sizes[::-1]


def project(stages, backprop_ms, link_gb_s, latency_us):
    """One row per J (1, 2, 4, ..., and the number of stages): the projected PETRA tick under the two
    transfer models, the single-device step times and the speed-ups (module docstring)."""
    n = len(stages)
    revbackprop_ms = sum(s["petra_ms"] for s in stages)
    js = sorted({1, n} | {2 ** k for k in range(1, n.bit_length()) if 2 ** k < n})
    rows = []
    for J in js:
        tick_o, sizes = best_grouping(stages, J, link_gb_s, latency_us, overlap=True)
        tick_s, sizes_s = best_grouping(stages, J, link_gb_s, latency_us, overlap=False)
        bounds, start = [], 0
        for k in sizes:
            bounds.append((start, start + k - 1))
            start += k
        parts = [_group_cost(stages, a, b, link_gb_s, latency_us, True) for a, b in bounds]
        rows.append({"J": J, "groups": " ".join(f"{a}-{b}" for a, b in bounds),
                     "groups_serial": " ".join(str(k) for k in sizes_s),
                     "max_compute_ms": round(max(p[1] for p in parts), 4),
                     "max_transfer_ms": round(max(p[2] for p in parts), 4),
                     "tick_ms_overlap": round(tick_o, 4), "tick_ms_serial": round(tick_s, 4),
                     "revbackprop_ms": round(revbackprop_ms, 4), "backprop_ms": round(backprop_ms, 4),
                     "speedup_overlap": round(revbackprop_ms / tick_o, 3),
                     "speedup_serial": round(revbackprop_ms / tick_s, 3),
                     "speedup_vs_backprop_overlap": round(backprop_ms / tick_o, 3),
                     "speedup_vs_backprop_serial": round(backprop_ms / tick_s, 3)})
    return rows


@plotted((6.5, 4.5))
def plot_projection(fig, ax, rows, meta):
    """Speed-up over single-device reversible backprop against J, one line per configuration
    (``plot_projection(path, rows, meta)`` writes it: `plotted`)."""
    configs = sorted({(r["model"], r["stem"], r["image_size"]) for r in rows})
    top = 1
    for cfg in configs:
        mine = sorted((r for r in rows if (r["model"], r["stem"], r["image_size"]) == cfg), key=lambda r: r["J"])
        js = [r["J"] for r in mine]
        top = max(top, max(js))
        line, = ax.plot(js, [r["speedup_overlap"] for r in mine], marker="o", label=f"{cfg[0]} {cfg[1]} {cfg[2]}px")
        ax.plot(js, [r["speedup_serial"] for r in mine], ls="--", color=line.get_color(), alpha=0.6)
    ax.plot([1, top], [1, top], ls=":", color="grey", label="ideal (J)")
    ax.set_xlabel("J (workers = devices)")
    ax.set_ylabel("projected speed-up over reversible backprop")
    ax.set_title(f"PETRA projection, link {meta['link_gb_s']} GB/s (solid: overlap, dashed: serial)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"{meta['device']} | torch {meta['torch']} | commit {meta['commit']}", fontsize=8)


def run_projection(args):
    """Measures the stages, prints the table, writes petra_projection_<device>.csv (one row per
    configuration and J), petra_projection_stages_<device>.csv and a PNG under args.out; returns the rows."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not args.quick:
        configs = [(stem, args.image_size or size) for stem, size in PROJECT_CONFIGS_CUDA]
        batch = args.batch or 64
    else:
        configs = [("cifar", args.image_size or (8 if args.quick else 16))]
        batch = args.batch or (2 if args.quick else 16)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    reps = args.steps or (2 if args.quick else 20)
    models = args.project_models
    meta = provenance(device)
    meta.update(batch=batch, warmup=warmup, reps=reps, link_gb_s=args.link_gb_s, link_latency_us=args.link_latency_us,
                dtype="float32")
    rows, stage_rows = [], []
    for name in models:
        for stem, size in configs:
            stages, bp = measure_stages(name, stem, size, batch, device, warmup, reps)
            for s in stages:
                stage_rows.append({"model": name, "stem": stem, "image_size": size,
                                   **{k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}})
            proj = project(stages, bp, args.link_gb_s, args.link_latency_us)
            print(f"\n{name} {stem} stem {size}x{size} batch {batch} on {meta['device']}: {len(stages)} stages, "
                  f"reversible backprop {proj[0]['revbackprop_ms']:.2f} ms, backprop {bp:.2f} ms, link "
                  f"{args.link_gb_s:g} GB/s")
            print(f"{'J':>3} {'tick ms (overlap)':>18} {'tick ms (serial)':>17} {'speed-up':>9} {'(serial)':>9} "
                  f"{'vs backprop':>11}  groups")
            for r in proj:
                print(f"{r['J']:>3} {r['tick_ms_overlap']:>18.3f} {r['tick_ms_serial']:>17.3f} "
                      f"{r['speedup_overlap']:>8.2f}x {r['speedup_serial']:>8.2f}x {r['speedup_vs_backprop_overlap']:>10.2f}x"
                      f"  {r['groups']}", flush=True)
            rows += [{"model": name, "stem": stem, "image_size": size, "batch": batch, **r} for r in proj]
    dev = device.type
    write_csv(os.path.join(args.out, f"petra_projection_stages_{dev}.csv"), stage_rows, meta)
    write_results(os.path.join(args.out, f"petra_projection_{dev}.csv"), rows, meta,
                  lambda png: plot_projection(png, rows, meta))
    return rows


if __name__ == "__main__":
    sys.exit(main())
