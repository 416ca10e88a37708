"""python -m revkernels.bench: the benchmark suite, one command for what reversible training costs and
saves on this machine.

Parts (each also runs alone as ``python -m revkernels.bench.<part>`` with more flags, and writes its
own CSV and PNG under --out):
  memory   a train step of reversible MLP stacks, autograd engine (stores activations) against the
           sequential engine (rebuilds them): time, activations saved for backward, peak memory
           (train_step_<device>.csv)
  kernels  every fused op against the eager composition it replaces (and torch.compile and both GPU
           backends on CUDA) (kernels_<device>.csv)
  train    transformer and RevNet train steps: standard backprop, checkpointing, plain reversible
           blocks and revkernels' engines (train_<device>.csv)
  overhead host-bound and compute-bound train steps (standard, checkpoint, a minREV-style reversible
           stack, every revkernels engine), each fused op's per-call cost against ATen, and (not in
           --quick) the compile time of a ViT-S (overhead_<device>.csv, overhead_ops_<device>.csv,
           overhead_compile_<device>.csv)
  petra    the PETRA distributed runtime (2 CPU processes over gloo) against single-process
           reversible backprop (petra_cpu.csv); always on CPU

On CPU the suite runs train and petra in their quick modes (their full shapes are GPU-sized or take
long on a few cores); memory, kernels and overhead run their CPU defaults, or quick modes with --quick.
On CUDA every part but overhead and petra runs by default (name them in --parts to run them: petra
measures CPU processes; overhead, the host-cost study, runs its CPU shapes under bf16 autocast there):
memory and kernels with their full CUDA defaults, train with a selection that fits the suite's
time: ViT-B at batch 32 and 128, CIFAR RevNet-18 at 256 and ImageNet RevNet-50 at 64, the depth sweep
12/24/48, and a time budget: once the suite has run 360 s, train starts no new configuration (its
first, ViT-B at batch 32 with every variant, always runs), so the suite ends within about 8 minutes.
--quick: kernels keeps the CUDA sizes with fewer repetitions.
"""
import argparse
import importlib
import math
import os
import sys
import time

import torch
from tqdm import tqdm

from revkernels.bench.report import DEFAULT_OUT, check_device, check_out_folder

PARTS = ("memory", "kernels", "train", "overhead", "petra")
CUDA_ONLY_WHEN_NAMED = ("overhead", "petra")
# On CUDA without --quick: the train part starts no new configuration once the whole run has taken this
# long (it measures the most important points first), so the suite ends within about 8 minutes.
CUDA_BUDGET_S = 360
CUDA_TRAIN_SELECTION = ["--models", "vit_b", "--batches", "32", "128",
                        "--revnets", "revnet18:cifar:256", "revnet50:imagenet:64", "--depth-sweep", "12", "24", "48"]


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m revkernels.bench", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to run on (default: cuda if available, else cpu)")
    parser.add_argument("--quick", action="store_true",
                        help="every part's quick mode (under 2 minutes in all on a 2-core CPU)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, metavar="PART",
                        help=f"parts to run, from {', '.join(PARTS)} (default: all; on CUDA all but overhead and petra)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"folder for CSV and PNG (default: ./{DEFAULT_OUT})")
    parser.add_argument("--memory-depths", type=int, nargs="+", metavar="DEPTH",
                        help="stack depths of the memory part (its --depths; default: the part's own: 4 8 16 "
                        "on CPU, 4 8 with --quick; 12 24 48 on CUDA, 12 24 with --quick). On CPU each depth "
                        "costs two fresh processes (the peak-memory measurement), so a smoke run may name one")
    args = parser.parse_args(argv)
    check_out_folder(parser, args.out)
    check_device(parser, args.device)
    if args.memory_depths and min(args.memory_depths) < 1:
        parser.error("--memory-depths must be positive")
    return args


def default_parts(device):
    """The parts run when --parts is not given: all on CPU; on CUDA all but overhead and petra."""
    return [p for p in PARTS if not (torch.device(device).type == "cuda" and p in CUDA_ONLY_WHEN_NAMED)]


def part_argv(part, args, elapsed_s=0.0):
    """The command-line arguments the suite gives one part."""
    cuda = torch.device(args.device).type == "cuda"
    argv = ["--out", args.out]
    if part != "petra":
        argv += ["--device", args.device]
    if part == "memory" and getattr(args, "memory_depths", None):
        argv += ["--depths", *map(str, args.memory_depths)]
    if args.quick or (not cuda and part in ("train", "petra")):
        return argv + ["--quick"]
    if cuda and part == "train":
        return argv + CUDA_TRAIN_SELECTION + ["--budget-s", str(round(max(0.0, CUDA_BUDGET_S - elapsed_s)))]
    return argv


def _x(a, b):
    """a / b as 'N.NNx', or 'n/a' where either is missing or nan."""
    try:
        a, b = float(a), float(b)
    except (TypeError, ValueError):
        return "n/a"
    return f"{a / b:.2f}x" if math.isfinite(a) and math.isfinite(b) and b > 0 else "n/a"


def _summary_memory(rows):
    deepest = max(r["depth"] for r in rows)
    by = {r["engine"]: r for r in rows if r["depth"] == deepest}
    auto, seq = by["autograd"], by["sequential"]
    return [f"depth {deepest}: saved for backward autograd/sequential {_x(auto['saved_mib'], seq['saved_mib'])}, "
            f"step peak autograd/sequential {_x(auto['peak_mib'], seq['peak_mib'])}, "
            f"step time sequential/autograd {_x(seq['step_ms'], auto['step_ms'])}"]


def _summary_kernels(rows):
    largest = max((r["rows"] * r["width"], r["rows"], r["width"]) for r in rows)[1:]
    at = [r for r in rows if (r["rows"], r["width"]) == largest]
    fused = [i for i in dict.fromkeys(r["impl"] for r in at) if i not in ("eager", "compile")]
    cells = []
    for op in dict.fromkeys(r["op"] for r in at):
        mine = {r["impl"]: r for r in at if r["op"] == op}
        best = min(fused, key=lambda i: mine[i]["ms"])
        cell = f"{op} {_x(mine['eager']['ms'], mine[best]['ms'])}"
        if "compile" in mine:
            cell += f" (vs compile {_x(mine['compile']['ms'], mine[best]['ms'])})"
        cells.append(cell)
    return [f"best fused ({'/'.join(fused)}) speed vs eager at {largest[0]}x{largest[1]}:", "  " + ", ".join(cells)]


def _summary_train(rows):
    lines = []
    throughput = [r for r in rows if r["kind"] == "throughput" and math.isfinite(float(r["ms"]))]
    if throughput:
        model, batch = throughput[0]["model"], throughput[0]["batch"]  # the first point measured: the main one
        mine = {r["variant"]: r for r in throughput if (r["model"], r["batch"]) == (model, batch)}
        ours = [v for v in mine if v.startswith("revkernels_")]
        if ours:
            best = min(ours, key=lambda v: mine[v]["ms"])
            lines.append(f"{model} batch {batch}: {best} (fastest engine) speed vs standard "
                         f"{_x(mine.get('standard', {}).get('ms'), mine[best]['ms'])}, vs reversible_plain "
                         f"{_x(mine.get('reversible_plain', {}).get('ms'), mine[best]['ms'])}"
                         + (f", vs standard_graphs {_x(mine['standard_graphs']['ms'], mine[best]['ms'])}"
                            if "standard_graphs" in mine else ""))
    revnet = [r for r in rows if r["kind"] == "revnet" and math.isfinite(float(r["ms"]))]
    if revnet:
        model, batch = revnet[0]["model"], revnet[0]["batch"]
        mine = {r["variant"]: r for r in revnet if (r["model"], r["batch"]) == (model, batch)}
        others = [e for e in mine if e != "autograd"]
        if "autograd" in mine and others:
            best = min(others, key=lambda e: mine[e]["ms"])
            line = f"{model} batch {batch}: {best} engine speed vs autograd {_x(mine['autograd']['ms'], mine[best]['ms'])}"
            if math.isfinite(float(mine["autograd"]["transient_mib"])):
                line += f", transient memory autograd/{best} {_x(mine['autograd']['transient_mib'], mine[best]['transient_mib'])}"
            lines.append(line)
    sweep = [r for r in rows if r["kind"] == "depth_sweep" and math.isfinite(float(r["peak_mib"]))]
    if sweep:
        deepest = max(r["depth"] for r in sweep)
        mine = {r["variant"]: r for r in sweep if r["depth"] == deepest}
        if "standard" in mine and "revkernels_sequential" in mine:
            lines.append(f"depth {deepest}: step peak memory standard/revkernels_sequential "
                         f"{_x(mine['standard']['peak_mib'], mine['revkernels_sequential']['peak_mib'])}")
    return lines or ["no complete measurement"]


def _summary_petra(rows):
    from revkernels.bench.petra import QUICK_NOTE

    petra = next(r for r in rows if r["variant"] == "petra_distributed")
    return [f"PETRA distributed ({petra['processes']} processes) speed vs reversible backprop: "
            f"{petra['speedup_vs_revbackprop_best']:.2f}x over the fastest, "
            f"{petra['speedup_vs_revbackprop_same_cores']:.2f}x over the same cores"
            + (f" ({QUICK_NOTE})" if petra["quick"] else "")]


def _summary_overhead(rows):
    from revkernels.bench.overhead import summary

    return summary(rows)


SUMMARIES = {"memory": _summary_memory, "kernels": _summary_kernels, "train": _summary_train,
             "overhead": _summary_overhead, "petra": _summary_petra}


def summary(results):
    """Headline ratios, a few lines per part, from the rows each part's run() returned."""
    lines = []
    for part, rows in results.items():
        if isinstance(rows, BaseException):
            lines.append(f"{part:<8} FAILED: {type(rows).__name__}: {str(rows).splitlines()[0][:200] if str(rows) else ''}")
            continue
        try:
            part_lines = SUMMARIES[part](rows) if rows else ["no rows"]
        except Exception as error:  # noqa: BLE001 - a summary must not hide the other parts'
            part_lines = [f"summary failed: {type(error).__name__}: {error}"]
        lines += [f"{part if i == 0 else '':<8} {line}" for i, line in enumerate(part_lines)]
    return lines


def main(argv=None):
    args = _parse(argv)
    parts = args.parts or default_parts(args.device)
    parts = [p for p in PARTS if p in parts]  # the suite's order, each once
    start = time.perf_counter()
    results, timings = {}, {}
    for part in tqdm(parts, desc="revkernels.bench", unit="part", file=sys.stderr):
        part_args = part_argv(part, args, time.perf_counter() - start)
        print(f"\n=== {part}: python -m revkernels.bench.{part} {' '.join(part_args)}", flush=True)
        module = importlib.import_module(f"revkernels.bench.{part}")
        t0 = time.perf_counter()
        try:
            results[part] = module.run(module.parse_args(part_args))
        except Exception as error:  # noqa: BLE001 - one failing part keeps the others' results
            print(f"{part} FAILED: {type(error).__name__}: {error}", flush=True)
            results[part] = error
        timings[part] = time.perf_counter() - t0
    print(f"\n=== summary ({args.device}{', quick' if args.quick else ''}; "
          + ", ".join(f"{p} {s:.0f} s" for p, s in timings.items()) + f"; results in {os.path.abspath(args.out)})")
    for line in summary(results):
        print(line)
    return 1 if any(isinstance(r, BaseException) for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
