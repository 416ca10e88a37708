r"""PETRA trainer CLI: ``python -m revkernels.petra.train``.

    python -m revkernels.petra.train --model revnet18 --dataset digits --method petra --accum 2 \
        --epochs 10 --batch-size 64 --lr 0.1 --warmup-epochs 1 --milestones 6 8 --out runs/petra

Trains with `revkernels.petra.Trainer` (runtime ``simulate``: the exact one-process, tick-by-tick
PETRA pipeline, or the backprop / reversible-backprop baselines) and writes to ``--out``:

- ``config.json``: the arguments and derived settings (stages, steps per epoch, peak lr, ...);
- ``metrics.jsonl``: one JSON object per epoch (epoch, step = training batches fed so far,
  optimizer_steps and lr of the first stage's optimizer (under PETRA it lags the head's by the
  pipeline depth), train_loss, test_loss, test_acc, images_per_s (training only), epoch_time_s,
  buffer_bytes (the input FIFOs at the epoch's end, before any drain) and peak_buffer_bytes per stage);
- ``metrics.csv``: the same, with one column per stage for the buffer bytes;
- ``summary.json``: the last epoch's metrics and the final test accuracy.

Schedule: warm-up and milestones are given in epochs and converted to optimizer steps
(``batches per epoch / accum``); the peak lr is ``lr * batch * accum / 256``.

Recipe defaults (why). The paper's base lr 0.1 (peak 0.025 at batch 64, or at batch 32 with k = 2)
suits CIFAR/ImageNet, where RevNet-18's 10-stage pipeline delays the stem's gradient by 18 ticks, ~2%
of a CIFAR epoch. On digits (1,437 training images: 44 batches of 32) 18 ticks are 40% of an epoch and
the network changes fast: the gradient analysis shows the early stages' applied gradients nearly
orthogonal to the end-to-end ones within the first optimizer steps (cosine ~0.1 at the stem at a peak
lr of only 0.0025), for PETRA and for delayed gradients alike (so it is staleness, not PETRA's input
reconstruction nor BatchNorm: delayed recomputes at the exact stored input with the stashed parameters
and diverges the same way; the train loss diverges too, not just the eval-mode statistics). PETRA then
diverges on digits once the lr reaches ~0.0125-0.025 whatever the warm-up (1, 2 or 5 epochs: the
paper's 5-epoch warm-up only postpones it to when the lr gets there), and the linear lr scaling with k does
not help (k = 4 at base 0.1, peak 0.05, also diverged: the parameter drift per tick is the same).
What matters is how far the
stale stages' parameters move during the delay, ~ the peak lr / k per tick: at a fixed peak lr a larger
k (the paper: the gap shrinks as k grows) moves them half as far. Base lr 0.02 with batch 32 and k = 2
(peak 0.005) still oscillated during its constant-lr phase (train loss stuck at ~0.3), base 0.01 with
k = 4 (the same peak, half the drift per tick) trained smoothly. So on the small datasets the default
base lr is 0.01 (peak 0.0025 at the default batch 64, k = 1; the benchmark uses batch 32, k = 4), and
every dataset gets a x``gamma`` step decay at 50% and 75% of training by default (the paper's 150/225 of
300 epochs): at a decayed lr the drift during the delay is small and the stale gradients realign with
the end-to-end ones (``benchmarks/bench_petra_accuracy.py`` has the accuracy and cosine numbers). PETRA's pipeline keeps
running across epoch boundaries (evaluation uses the current parameters and does not drain it);
it is flushed once at the end of training, before the final evaluation. A train loss is averaged
over the losses the head computed during the epoch (for PETRA that excludes the fill ticks).

``--max-steps`` caps the number of training batches over the whole run (for smoke tests).

Methods: ``petra``, ``delayed`` (delayed gradients with input and parameter buffers, the
PipeDream-like baseline), ``backprop``, ``revbackprop`` (`revkernels.petra.simulate`).

Gradient analysis (``--analyze-every N``, simulate only): at every N-th optimizer step of each
optimizer, per stage, the cosine similarity and norm ratio of the gradient the method applies against
the end-to-end backprop gradient of the same batches at the current parameters
(`simulate.Trainer`'s ``analysis``); written, one record per stage per analysis step, to
``analysis.jsonl`` and ``analysis.csv`` (method, stage, step, tick, cosine, norm_ratio, grad_norm,
e2e_norm, epoch), and each epoch's record gets ``mean_cosine`` / ``mean_norm_ratio`` over the
epoch's analysis records.

Checkpoints. ``--checkpoint-every N`` writes ``checkpoint.pt`` in ``--out`` (replaced
atomically) after every N-th training batch, before any drain: the trainer's `state_dict` (model,
every stage's optimizer and lr-schedule step counters, partially accumulated grads, the in-flight
pipeline: messages, FIFOs with their parameter copies, unused labels), the data-order generator's
state at the start of the epoch with the position in it, the torch RNG state and the epoch's running
sums. ``--resume PATH`` loads it into fresh objects (same model/data/method/recipe arguments, checked)
and continues: the run is bit-identical to an uninterrupted one; the logs in ``--out`` keep the epochs
before the checkpoint's and are appended to.
Under ``--runtime distributed`` every rank writes its own ``<out>/checkpoint/rank{r}.pt`` after the same
tick (its worker's stages, optimizers, FIFOs, the messages it has received for the next tick, the
head's unused labels, the feed history; `PipelineRank.state_dict`) with the same data-order / RNG
state, then the ranks meet at a barrier; ``--resume <out>/checkpoint`` (same number of ranks) restores
each rank from its file (the ranks check they are at the same tick) and continues bit-identically.
A rank writes ``rank{r}.pt.tmp``, meets the others at a barrier, then renames it to ``rank{r}.pt``; a
resume takes the newest step for which every rank has a complete file (either name), so a rank killed
while the ranks write leaves a usable set.

Restarts (distributed). Under ``torchrun --max-restarts N``, or with ``--nproc R --max-restarts N`` (the
trainer relaunches its R processes up to N times), a restarted attempt resumes from the last checkpoint this
run wrote in ``<out>/checkpoint`` (each rank file holds the run's id, `distributed.run_id`: files an earlier
run left there are ignored), else from ``--resume``, else from scratch: a run that lost a rank ends
with exactly the parameters of an uninterrupted one. The logs drop the epochs the lost attempt logged
after that checkpoint. At the end the logging rank writes the trained ``model.pt`` (the model's
state_dict) to ``--out``.

Runtimes. ``--runtime simulate`` (default): the exact one-process simulator (any method).
``--runtime distributed`` (``petra`` and ``delayed``): one process per worker, torch.distributed point-to-point
(`revkernels.petra.distributed`; gloo on CPU, NCCL with one GPU per rank), bit-identical to the
simulator with the same grouping and the same torch thread count (``--threads``; by default a distributed
rank gets the CPU count / R threads, the simulator torch's default)::

    torchrun --nproc-per-node 3 -m revkernels.petra.train --runtime distributed ...   # 3 ranks
    python -m revkernels.petra.train --runtime distributed --nproc 3 ...              # starts the 3 itself

``--ranks R`` splits the model's J stages into R contiguous groups, each run as one worker (by either
runtime, so ``--runtime simulate --ranks R`` simulates exactly what R distributed ranks do); the
default is one worker per stage (simulate) or one group per rank (distributed). ``--balance count``
(default) splits by stage count; ``--balance time`` minimises the largest group's per-tick cost, each
stage's forward + rebuild + VJP and 1 / ``--accum`` of its optimizer step timed on the first training batch (`revkernels.petra.stage_costs`; under
the distributed runtime every rank times them at once and rank 0's times decide, within ``--timeout``).
``config.json`` has the grouping (``groups``) and the timed ``stage_costs_s``; a resumed run keeps the
checkpoint's grouping. Every rank iterates
the same seeded batches; the last rank (the head: it has the losses) gathers the other ranks' stage
states at each epoch's end, evaluates and writes the logs, in the same format. ``--timeout`` (s): a
rank that stops answering for that long stops the run; every process then exits non-zero naming it.
"""
import argparse
import csv
import json
import math
import os
import sys
import time
import uuid

import torch
import torch.nn.functional as F
from torch import nn

from revkernels.petra.data import DATASETS, batches, load_dataset
from revkernels.petra.partition import BALANCES, balanced_sizes, check_stage_budget, stage_costs
from revkernels.petra.simulate import METHODS, PIPELINED, Trainer

MODELS = ("revnet18", "revnet34", "revnet50")
SMALL_DATA_LR = 0.01  # the default base lr on digits / synthetic (module docstring: "Recipe defaults")
RUNTIMES = ("simulate", "distributed")


def build_model(name, num_classes, stem="cifar", exact=False):
    """revnet18/34/50 by name; `exact`: its reversible runs in exact mode (fixed-point streams)."""
    if not isinstance(name, str) or name not in MODELS:
        raise ValueError(f"revkernels: --model must be one of {list(MODELS)}, got {name!r}")
    from revkernels import models
    return getattr(models, name)(num_classes=num_classes, stem=stem, exact=exact)


def parse_budget(text):
    """``--memory-budget``'s value: up to 1 a fraction (``0.5``, ``1``: everything), above 1 a whole
    number of bytes (``65536``, ``1e9``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a fraction in [0, 1] or a number of bytes, got {text!r}") from None
    if value <= 1 or not value.is_integer():
        return value  # (a fraction; `check_stage_budget` names a value outside [0, 1])
    return int(value)


def make_parser():
    p = argparse.ArgumentParser(
        prog="python -m revkernels.petra.train",
        description="Train a RevNet with PETRA (or a baseline) on a small image dataset.",
        epilog="distributed PETRA (one process per rank, bit-identical to --runtime simulate --ranks R with the "
               "same --threads, e.g. --threads 1 for both): "
               "torchrun --nproc-per-node R -m revkernels.petra.train --runtime distributed ..., or "
               "python -m revkernels.petra.train --runtime distributed --nproc R ...")
    p.add_argument("--model", default="revnet18", help=f"one of {', '.join(MODELS)}")
    p.add_argument("--stem", default="cifar", help="RevNet stem: cifar (3x3/1 conv) or imagenet")
    p.add_argument("--dataset", default="digits", help=f"one of {', '.join(DATASETS)}")
    p.add_argument("--data", default=None,
                   help="imagefolder: a folder of class subfolders (or train/ and test/ of them); cifar10: the folder "
                        "of the python batches (data_batch_1..5, test_batch)")
    p.add_argument("--method", default="petra", help=f"one of {', '.join(METHODS)}")
    p.add_argument("--exact", action="store_true",
                   help="reversible stages in exact mode: int64 fixed-point streams between them, rebuilt bit for "
                        "bit (docs/exact.md); twice the bytes per stream message")
    p.add_argument("--memory-budget", type=parse_budget, default=0,
                   help="petra: reversible stages keep their inputs (no rebuild) within this budget: a fraction in "
                        "[0, 1] of what keeping every one would hold, or a number of bytes (default 0: all rebuild)")
    p.add_argument("--runtime", default="simulate",
                   help="simulate (one process, any method) or distributed (PETRA, one process per rank: launch "
                        "under torchrun --nproc-per-node R, or pass --nproc R)")
    p.add_argument("--ranks", type=int, default=None,
                   help="split the stages into R contiguous groups, one worker each (default: one per stage, or "
                        "one group per rank under --runtime distributed)")
    p.add_argument("--nproc", type=int, default=None,
                   help="--runtime distributed without torchrun: start this many local processes (ranks)")
    p.add_argument("--balance", default="count",
                   help="stage groups (--ranks / --runtime distributed): count (by stage count) or time (the largest "
                        "group's timed per-tick cost minimised)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: relaunch the processes up to N times after a failure, resuming from the last "
                        "checkpoint (under torchrun, pass --max-restarts to torchrun)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="distributed: seconds before a silent rank counts as failed (every other process then exits "
                        "non-zero within --timeout + 1 s, naming it)")
    p.add_argument("--accum", type=int, default=1, help="backward steps per optimizer step (k)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=None,
                   help="base lr for a batch of 256 (peak = lr*batch*accum/256); default 0.01 on digits/synthetic, "
                        "0.1 (the paper's) on cifar10/imagefolder")
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--milestones", type=float, nargs="*", default=None,
                   help="epochs at which the lr is x gamma (default: 50%% and 75%% of --epochs, as the paper's "
                        "150/225 of 300; give the flag with no value for none)")
    p.add_argument("--gamma", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--image-size", type=int, default=None,
                   help="image side S (digits, synthetic: default 16; cifar10, imagefolder: resized to S x S, by "
                        "default kept at their own size)")
    p.add_argument("--seed", type=int, default=0, help="model init and batch order")
    p.add_argument("--split-seed", type=int, default=0, help="train/test split (digits) or data (synthetic)")
    p.add_argument("--eval-batch-size", type=int, default=256)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many training batches (tests)")
    p.add_argument("--out", default=None, help="log directory (default runs/<model>-<dataset>-<method>)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for this run (default: torch's); 1 avoids oversubscription on busy machines")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--analyze-every", type=int, default=None,
                   help="gradient analysis every N optimizer steps (simulate): analysis.jsonl / analysis.csv")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="write <out>/checkpoint.pt (distributed: <out>/checkpoint/rank{r}.pt) every N training batches")
    p.add_argument("--resume", default=None,
                   help="continue exactly from a checkpoint.pt (distributed: the folder of rank{r}.pt files)")
    return p


def _check_args(args):
    if args.lr is None:  # the recipe defaults: see the module docstring
        args.lr = SMALL_DATA_LR if args.dataset in ("digits", "synthetic") else 0.1
    # (not given: halfway and three quarters through --epochs; a resumed run keeps the checkpoint's)
    args.milestones_default = args.milestones is None
    if args.milestones is None:
        args.milestones = [0.5 * args.epochs, 0.75 * args.epochs]
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"revkernels: --out {args.out!r} exists and is not a folder")
    for name, value in (("--model", args.model), ("--dataset", args.dataset), ("--method", args.method)):
        choices = {"--model": MODELS, "--dataset": DATASETS, "--method": METHODS}[name]
        if value not in choices:
            raise ValueError(f"revkernels: {name} must be one of {list(choices)}, got {value!r}")
    if args.stem not in ("cifar", "imagenet"):
        raise ValueError(f"revkernels: --stem must be 'cifar' or 'imagenet', got {args.stem!r}")
    if args.memory_budget and args.method != "petra":
        raise ValueError(f"revkernels: --memory-budget applies to --method petra only, got {args.method!r}")
    try:
        check_stage_budget(args.memory_budget)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e).replace("memory_budget", "--memory-budget", 1)) from None
    if args.runtime not in RUNTIMES:
        raise ValueError(f"revkernels: --runtime must be one of {list(RUNTIMES)}, got {args.runtime!r}")
    if args.runtime == "distributed" and args.method not in PIPELINED:
        raise ValueError(f"revkernels: --runtime distributed runs --method petra or delayed only, got {args.method!r}")
    if args.ranks is not None and args.method not in PIPELINED:
        raise ValueError(f"revkernels: --ranks applies to --method petra or delayed only, got {args.method!r}")
    if args.analyze_every is not None and args.runtime == "distributed":
        raise ValueError("revkernels: --analyze-every runs with --runtime simulate only")
    for name in ("analyze_every", "checkpoint_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"revkernels: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.resume is not None and args.runtime == "distributed" and not _rank_files(args.resume):
        raise ValueError(f"revkernels: --resume {args.resume!r} is not a folder of rank checkpoints (rank0.pt, ...)")
    if args.resume is not None and args.runtime != "distributed" and not os.path.isfile(args.resume):
        raise ValueError(f"revkernels: --resume {args.resume!r} is not a file")
    if args.dataset in ("imagefolder", "cifar10") and not args.data:
        raise ValueError(f"revkernels: --dataset {args.dataset} needs --data PATH")
    for name, value in (("--ranks", args.ranks), ("--nproc", args.nproc)):
        if value is not None and value < 1:
            raise ValueError(f"revkernels: {name} must be >= 1, got {value}")
    if args.nproc is not None and args.runtime != "distributed":
        raise ValueError("revkernels: --nproc needs --runtime distributed")
    if args.balance not in BALANCES:
        raise ValueError(f"revkernels: --balance must be one of {list(BALANCES)}, got {args.balance!r}")
    if args.balance == "time" and args.runtime != "distributed" and args.ranks is None:
        raise ValueError("revkernels: --balance time needs --ranks R (or --runtime distributed): without groups every "
                         "stage is its own worker")
    if args.max_restarts < 0:
        raise ValueError(f"revkernels: --max-restarts must be >= 0, got {args.max_restarts}")
    if args.max_restarts and args.nproc is None:
        raise ValueError("revkernels: --max-restarts is for the --nproc launcher (under torchrun, pass --max-restarts "
                         "to torchrun)")
    if args.nproc is not None and args.ranks is not None and args.nproc != args.ranks:
        raise ValueError(f"revkernels: --ranks {args.ranks} and --nproc {args.nproc} differ (one rank per group)")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise ValueError(f"revkernels: --timeout must be > 0, got {args.timeout}")
    for name, value, minimum in (("--accum", args.accum, 1), ("--epochs", args.epochs, 1),
                                 ("--batch-size", args.batch_size, 1), ("--eval-batch-size", args.eval_batch_size, 1)):
        if value < minimum:
            raise ValueError(f"revkernels: {name} must be >= {minimum}, got {value}")
    if args.image_size is not None and args.image_size < 1:
        raise ValueError(f"revkernels: --image-size must be >= 1, got {args.image_size}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"revkernels: --threads must be >= 1, got {args.threads}")
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"revkernels: --max-steps must be >= 1, got {args.max_steps}")
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise ValueError(f"revkernels: --lr must be > 0, got {args.lr}")
    if not math.isfinite(args.gamma) or args.gamma <= 0:
        raise ValueError(f"revkernels: --gamma must be > 0, got {args.gamma}")
    if not math.isfinite(args.weight_decay) or args.weight_decay < 0:
        raise ValueError(f"revkernels: --weight-decay must be >= 0, got {args.weight_decay}")
    if not math.isfinite(args.warmup_epochs) or args.warmup_epochs < 0:
        raise ValueError(f"revkernels: --warmup-epochs must be >= 0, got {args.warmup_epochs}")
    if any(not math.isfinite(m) or m < 0 for m in args.milestones) or args.milestones != sorted(args.milestones):
        raise ValueError(f"revkernels: --milestones must be increasing non-negative epochs, got {args.milestones}")


@torch.no_grad()
def evaluate(model, images, labels, batch_size, device=None):
    """(mean cross-entropy, accuracy) of `model` in eval mode; restores the previous mode."""
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for x, y in batches(images, labels, batch_size, shuffle=False, drop_last=False):
        if device is not None:
            x, y = x.to(device), y.to(device)
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(dim=1) == y).sum().item()
    model.train(was_training)
    n = max(int(labels.shape[0]), 1)
    return loss_sum / n, correct / n


ANALYSIS_FIELDS = ["epoch", "method", "stage", "step", "tick", "cosine", "norm_ratio", "grad_norm", "e2e_norm"]


class _Logger:
    """metrics.jsonl / .csv and analysis.jsonl / .csv in `out`: new files, or (resuming at epoch
    `before_epoch`) the existing ones, keeping their records of the epochs before it."""

    def __init__(self, out, num_stages, before_epoch=None):
        self.jsonl = os.path.join(out, "metrics.jsonl")
        self.csv = os.path.join(out, "metrics.csv")
        self.fields = (["epoch", "step", "optimizer_steps", "lr", "train_loss", "test_loss", "test_acc",
                        "images_per_s", "epoch_time_s", "mean_cosine", "mean_norm_ratio"]
                       + [f"buffer_bytes_stage{i}" for i in range(num_stages)]
                       + [f"peak_buffer_bytes_stage{i}" for i in range(num_stages)])
        self.analysis_jsonl = os.path.join(out, "analysis.jsonl")
        self.analysis_csv = os.path.join(out, "analysis.csv")
        for path, fields in ((self.jsonl, None), (self.csv, self.fields), (self.analysis_jsonl, None),
                             (self.analysis_csv, ANALYSIS_FIELDS)):
            kept = []
            if before_epoch is not None and os.path.exists(path):
                with open(path, newline="") as f:
                    if fields:
                        kept = [r for r in csv.DictReader(f) if int(r["epoch"]) < before_epoch]
                    else:
                        kept = [line for line in f if json.loads(line)["epoch"] < before_epoch]
            with open(path, "w", newline="") as f:
                if fields:
                    w = csv.DictWriter(f, fields)
                    w.writeheader()
                    w.writerows(kept)
                else:
                    f.writelines(kept)

    def log_analysis(self, records, epoch):
        with open(self.analysis_jsonl, "a") as f:
            for r in records:
                f.write(json.dumps(dict(r, epoch=epoch)) + "\n")
        with open(self.analysis_csv, "a", newline="") as f:
            w = csv.DictWriter(f, ANALYSIS_FIELDS, extrasaction="ignore")
            for r in records:
                w.writerow(dict(r, epoch=epoch))

    def log(self, record):
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        row = dict(record)
        for key in ("buffer_bytes", "peak_buffer_bytes"):
            for i, v in enumerate(row.pop(key)):
                row[f"{key}_stage{i}"] = v
        with open(self.csv, "a", newline="") as f:
            csv.DictWriter(f, self.fields).writerow(row)


def _rank_main(argv):
    """A rank started by ``--nproc`` (RANK etc. in its environment); argument errors as `cli` prints them."""
    cli(argv)


def main(argv=None):
    """Runs the CLI with `argv` (default sys.argv[1:]); returns the summary dict (None on the ranks of a
    distributed run that do not log). Raises ValueError on bad arguments; ``--runtime distributed --nproc``
    raises `revkernels.petra.distributed.LaunchError` when a rank fails."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser().parse_args(argv)
    _check_args(args)
    if args.runtime == "distributed" and "RANK" not in os.environ:
        if args.nproc is None:
            raise ValueError("revkernels: --runtime distributed runs one process per rank: launch it with "
                             "torchrun --nproc-per-node R -m revkernels.petra.train ..., or pass --nproc R")
        from revkernels.petra.distributed import ATTEMPT_ENV, RUN_ENV, LaunchError, launch
        with torch.device("meta"):  # the stage count only: no weights
            _check_workers(args, len(build_model(args.model, 1, args.stem).stages))
        threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
        run = uuid.uuid4().hex  # the id of this run's checkpoints, the same in every attempt
        for attempt in range(args.max_restarts + 1):
            try:
                # a rank that is not hung exits within --timeout + 1 s of a failure; then the rest are killed
                launch(_rank_main, args.nproc, (argv,), threads=threads, env={ATTEMPT_ENV: str(attempt), RUN_ENV: run},
                       grace=args.timeout + 1)
                break
            except LaunchError as e:
                if attempt == args.max_restarts or ARGUMENT_ERROR in e.exitcodes:  # a restart would repeat it
                    raise
                print(f"python -m revkernels.petra.train: {e}; restart {attempt + 1} of {args.max_restarts} from the "
                      f"last checkpoint", file=sys.stderr, flush=True)
        out = _out(args)
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif args.runtime == "distributed":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _arg_values(args):
    """The command line's values (for config.json and checkpoints), without `_check_args`' notes."""
    return {k: v for k, v in vars(args).items() if k != "milestones_default"}


def _out(args):
    return args.out or os.path.join("runs", f"{args.model}-{args.dataset}-{args.method}")


def _run(args):
    from tqdm import tqdm

    data = load_dataset(args.dataset, args.image_size, split_seed=args.split_seed, path=args.data)
    torch.manual_seed(args.seed)
    model = build_model(args.model, data.num_classes, args.stem, exact=args.exact)
    _check_workers(args, len(model.stages))  # a clear error before any rank waits on another
    batches_per_epoch = data.train_images.shape[0] // args.batch_size
    if batches_per_epoch < 1:
        raise ValueError(f"revkernels: --batch-size {args.batch_size} is larger than the training set "
                         f"({data.train_images.shape[0]} images)")
    _check_batch_size(args, model, data)
    opt_steps_per_epoch = batches_per_epoch / args.accum
    kwargs = dict(accum_k=args.accum, base_lr=args.lr,
                  warmup_steps=int(round(args.warmup_epochs * opt_steps_per_epoch)),
                  milestones=[int(round(m * opt_steps_per_epoch)) for m in args.milestones],
                  weight_decay=args.weight_decay, gamma=args.gamma, batch_size=args.batch_size)
    if args.memory_budget:
        kwargs["memory_budget"] = args.memory_budget
    if args.runtime == "distributed":
        from revkernels.petra import distributed

        kwargs["method"] = args.method
        device = distributed.init(timeout=args.timeout)
        ckpt = None
        if distributed.restart_attempt() > 0:  # a restarted attempt: from this run's last checkpoint, if any
            ckpt = _read_checkpoint(args, os.path.join(_out(args), "checkpoint"), restart=True)
        if ckpt is None and args.resume:
            ckpt = _read_checkpoint(args, args.resume)
        groups, costs = _groups(args, model, data, device, ckpt)
        pipe = distributed.PipelineRank(model, groups=groups, timeout=args.timeout, device=device, **kwargs)
        trainer, logs = pipe.trainer, pipe.is_last
        try:
            return _train(args, data, model, trainer, pipe, logs, device, batches_per_epoch, tqdm, ckpt, costs)
        except Exception as e:  # noqa: BLE001 - a failing rank stops every rank, naming itself
            import traceback

            traceback.print_exc()
            pipe.fail(pipe.rank, f"{type(e).__name__}: {e}")
    ckpt = _read_checkpoint(args, args.resume) if args.resume else None
    groups, costs = _groups(args, model, data, None, ckpt)
    trainer = Trainer(model, method=args.method, groups=groups, analyze_every=args.analyze_every, **kwargs)
    return _train(args, data, model, trainer, None, True, None, batches_per_epoch, tqdm, ckpt, costs)


def _check_workers(args, num_stages):
    """Raises ValueError naming the flag that asks for more workers (stage groups) than the model's stages."""
    world = os.environ.get("WORLD_SIZE") if args.runtime == "distributed" else None
    for name, n in (("--ranks", args.ranks), ("--nproc", args.nproc),
                    ("the world size (torchrun --nproc-per-node)", world and int(world))):
        if n is not None and n > num_stages:
            raise ValueError(f"revkernels: {name} must be at most the number of stages ({num_stages} in "
                             f"{args.model}), got {n}")


def _check_batch_size(args, model, data):
    """Raises ValueError naming --batch-size if a batch of one reaches a BatchNorm layer as one value per
    channel (a 1x1 feature map), which BatchNorm cannot normalise in training."""
    if args.batch_size > 1:
        return
    values = []  # per BatchNorm call: values per channel of a one-image batch
    hooks = [m.register_forward_pre_hook(lambda _, inputs: values.append(inputs[0][0].numel() // inputs[0].shape[1]))
             for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    model.eval()
    try:
        with torch.no_grad():
            model(data.train_images[:1])
    finally:
        model.train()
        for h in hooks:
            h.remove()
    if min(values, default=2) < 2:
        raise ValueError(f"revkernels: --batch-size must be >= 2 here: at batch 1 a BatchNorm layer of {args.model} "
                         f"gets one value per channel (a 1x1 feature map at --image-size {data.image_size}), which it "
                         f"cannot normalise in training")


def _groups(args, model, data, device, ckpt):
    """(the stage grouping for `Trainer` / `PipelineRank`, the timed per-stage costs or None): ``--ranks`` by
    ``--balance`` (time: the checkpoint's grouping when resuming; under the distributed runtime rank 0's timings
    decide)."""
    if args.balance == "count":
        return args.ranks, None
    if ckpt is not None:  # timings differ from run to run: the grouping the checkpoint was made with
        return [len(g) for g in ckpt["trainer"]["groups"]], None
    example = data.train_images[:args.batch_size]
    costs = stage_costs(model, example if device is None else example.to(device), accum_k=args.accum)
    if args.runtime == "distributed":
        import torch.distributed as dist

        shared = [costs]
        dist.broadcast_object_list(shared, src=0)
        costs = shared[0]
    ranks = args.ranks or (int(os.environ["WORLD_SIZE"]) if args.runtime == "distributed" else len(costs))
    return balanced_sizes(costs, ranks), costs


# Arguments a resumed run must share with the checkpoint's (the rest, e.g. --epochs, --max-steps, --out,
# --checkpoint-every, --threads, may differ).
_RESUME_SAME = ("model", "stem", "dataset", "data", "method", "ranks", "balance", "accum", "batch_size", "lr",
                "warmup_epochs", "milestones", "gamma", "weight_decay", "image_size", "seed", "split_seed", "analyze_every")


def _save_checkpoint(path, pipe, state):
    """Writes ``path.tmp`` and renames it to `path`; distributed: after every rank has written its
    ``.tmp`` (so at any moment some complete step is on disk for every rank: `_read_checkpoint`)."""
    tmp = path + ".tmp"
    torch.save(state, tmp)
    if pipe is not None:
        pipe.barrier()
    os.replace(tmp, path)


def _rank_files(folder):
    return os.path.isdir(folder) and any(f.startswith("rank") and f.endswith((".pt", ".pt.tmp"))
                                         for f in os.listdir(folder))


def _check_checkpoint(args, ckpt, path):
    if not isinstance(ckpt, dict) or ckpt.get("kind") != "revkernels.petra.train checkpoint":
        raise ValueError(f"revkernels: --resume {path!r} is not a revkernels.petra.train checkpoint")
    saved = dict({"balance": "count"}, **ckpt["args"])  # checkpoints older than --balance split by count
    if getattr(args, "milestones_default", False):  # a longer --epochs does not move the schedule's milestones
        args.milestones = list(saved["milestones"])
    diff = [k for k in _RESUME_SAME if saved.get(k) != getattr(args, k)]
    if diff:
        raise ValueError("revkernels: --resume: the checkpoint was made with other " + ", ".join(
            f"--{k.replace('_', '-')} ({saved.get(k)!r}, not {getattr(args, k)!r})" for k in diff))
    if ckpt["args"].get("runtime", "simulate") != args.runtime:
        raise ValueError(f"revkernels: --resume: the checkpoint is from --runtime {ckpt['args'].get('runtime')}, "
                         f"not {args.runtime} (revkernels.petra.distributed.merge_rank_states / split_trainer_state "
                         f"convert between the two)")
    if args.max_steps is not None and ckpt["step"] > args.max_steps:
        raise ValueError(f"revkernels: --resume: the checkpoint is at step {ckpt['step']}, past --max-steps "
                         f"{args.max_steps}")
    if ckpt["epoch"] > args.epochs:
        raise ValueError(f"revkernels: --resume: the checkpoint is in epoch {ckpt['epoch']}, past --epochs "
                         f"{args.epochs}")
    return ckpt


def _read_checkpoint(args, folder_or_file, restart=False):
    """The checkpoint to resume from: the file (simulate) or, distributed (collective), this rank's file of the
    newest step for which every rank has a complete ``rank{r}.pt`` or ``rank{r}.pt.tmp`` in the folder.
    `restart`: only files this run wrote (`distributed.run_id`), None if there are none."""
    if args.runtime != "distributed":
        try:
            ckpt = torch.load(folder_or_file, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - any file torch cannot load
            raise ValueError(f"revkernels: --resume {folder_or_file!r} is not a revkernels.petra.train checkpoint "
                             f"(torch.load: {type(e).__name__}: {e})") from e
        return _check_checkpoint(args, ckpt, folder_or_file)
    import torch.distributed as dist

    from revkernels.petra.distributed import run_id

    rank, world = dist.get_rank(), dist.get_world_size()
    found = {}
    for path in (os.path.join(folder_or_file, f"rank{rank}.pt"), os.path.join(folder_or_file, f"rank{rank}.pt.tmp")):
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False)
        except Exception:  # noqa: BLE001 - missing, or cut short by a killed rank: not a candidate
            continue
        if isinstance(ckpt, dict) and "step" in ckpt and (not restart or ckpt.get("run") == run_id()):
            found[ckpt["step"]] = (path, ckpt)
    steps = [None] * world
    dist.all_gather_object(steps, sorted(found))
    common = set(steps[0]).intersection(*steps[1:])
    if not common:
        if restart:
            return None
        raise ValueError(f"revkernels: --resume {folder_or_file!r}: no step with a complete rank file for every one "
                         f"of the {world} ranks (the steps per rank: {steps}; a distributed run resumes with as many "
                         f"ranks as it was saved with)")
    path, ckpt = found[max(common)]
    saved_world = ckpt.get("trainer", {}).get("world_size", world) if isinstance(ckpt, dict) else world
    if saved_world != world:  # (fewer ranks than saved find their own files: an argument error, not a rank's)
        raise ValueError(f"revkernels: --resume {folder_or_file!r}: the checkpoint was saved by {saved_world} ranks, "
                         f"this run has {world} (a distributed run resumes with as many ranks as it was saved with)")
    return _check_checkpoint(args, ckpt, path)


def _train(args, data, model, trainer, pipe, logs, device, batches_per_epoch, tqdm, ckpt, costs):
    """The epoch loop, for the simulator (`pipe` None) or this rank of a distributed run (`logs`: this
    process writes the logs), from `ckpt` when resuming; `costs`: the timed stage costs (config.json)."""
    step_fn = pipe if pipe is not None else trainer
    out = _out(args)
    total_steps = args.epochs * batches_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    gen = torch.Generator().manual_seed(args.seed)
    step, record, start_epoch, skip, carried = 0, None, 1, 0, None
    if ckpt is not None:
        (trainer if pipe is None else pipe).load_state_dict(ckpt["trainer"])
        step, start_epoch, skip = ckpt["step"], ckpt["epoch"], ckpt["step_in_epoch"]
        gen.set_state(ckpt["epoch_generator_state"])
        torch.set_rng_state(ckpt["torch_rng_state"])
        carried = ckpt["epoch_sums"]
    if logs:
        os.makedirs(out, exist_ok=True)
        config = dict(_arg_values(args), out=out, image_size=data.image_size, num_stages=trainer.num_stages,
                      stage_kinds=[s.kind for s in trainer.stages], groups=trainer.groups, exact_stages=trainer.exact,
                      world_size=pipe.world_size if pipe is not None else 1,
                      train_images=int(data.train_images.shape[0]),
                      test_images=int(data.test_images.shape[0]), batches_per_epoch=batches_per_epoch,
                      stage_costs_s=costs,
                      total_steps=total_steps, peak_lr=trainer.peak_lr, warmup_steps=trainer.warmup_steps,
                      milestone_steps=list(trainer.milestones), normalisation={"mean": data.mean, "std": data.std})
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        logger = _Logger(out, trainer.num_stages, before_epoch=None if ckpt is None else ckpt["epoch"])
    analysed = len(trainer.analysis)

    bar = tqdm(total=total_steps, initial=step, desc=f"{args.method} {args.model}", unit="step",
               disable=args.no_progress or not logs, file=sys.stderr)
    for epoch in range(start_epoch, args.epochs + 1):
        epoch_state = gen.get_state()  # the epoch's batch order is drawn from this state
        losses, n_images, in_epoch, t0 = [], 0, 0, time.perf_counter()
        epoch_analysis_start = analysed
        if carried is not None:  # the resumed epoch's running sums
            losses, n_images, in_epoch = list(carried["losses"]), carried["n_images"], skip
            epoch_analysis_start = carried["analysis_start"]
            t0 -= carried["train_time"]
            carried = None
        for i, (images, labels) in enumerate(batches(data.train_images, data.train_labels, args.batch_size, gen)):
            if i < skip:
                continue
            if step >= total_steps:
                break
            result = step_fn.train_step(images, labels)
            step += 1
            in_epoch += 1
            n_images += images.shape[0]
            if result["loss"] is not None:
                losses.append(result["loss"])
                bar.set_postfix(loss=f"{result['loss']:.3f}", refresh=False)
            bar.update(1)
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                if pipe is None:
                    path, state, run = os.path.join(out, "checkpoint.pt"), trainer.state_dict(), None
                else:  # every rank its own file, after the same tick (its sends and next receives waited)
                    from revkernels.petra.distributed import run_id

                    os.makedirs(os.path.join(out, "checkpoint"), exist_ok=True)
                    path, state = os.path.join(out, "checkpoint", f"rank{pipe.rank}.pt"), pipe.state_dict()
                    run = run_id()  # a restarted attempt resumes only from its own run's files
                _save_checkpoint(path, pipe, {
                    "kind": "revkernels.petra.train checkpoint", "args": _arg_values(args), "trainer": state, "run": run,
                    "step": step, "epoch": epoch, "step_in_epoch": in_epoch, "epoch_generator_state": epoch_state,
                    "torch_rng_state": torch.get_rng_state(),
                    "epoch_sums": {"losses": losses, "n_images": n_images, "analysis_start": epoch_analysis_start,
                                   "train_time": time.perf_counter() - t0}})
        skip = 0
        last = epoch == args.epochs or step >= total_steps
        stats = step_fn.buffer_stats()  # the in-flight buffers, before any drain (collective if distributed)
        if last:
            losses.extend(r["loss"] for r in step_fn.flush() if r["loss"] is not None)
        train_time = time.perf_counter() - t0
        if pipe is not None:
            opt_steps = pipe.collect()  # the other stages' states into the logging rank's model
            opt_steps = opt_steps[0] if logs else None
            peak = [s["peak_bytes"] for s in pipe.buffer_stats()]
        else:
            opt_steps = trainer.optimizers[0].steps
            peak = [s["peak_bytes"] for s in trainer.buffer_stats()]
        if not logs:
            pipe.meet()  # (while the logging rank evaluates: no deadline, see PipelineRank.meet)
            if last:
                break
            continue
        new = trainer.analysis[analysed:]
        logger.log_analysis(new, epoch)
        analysed = len(trainer.analysis)
        epoch_recs = trainer.analysis[epoch_analysis_start:]
        test_loss, test_acc = evaluate(model, data.test_images, data.test_labels, args.eval_batch_size, device)
        record = {"epoch": epoch, "step": step, "optimizer_steps": opt_steps,
                  "lr": trainer.lr_at(max(opt_steps - 1, 0)),
                  "train_loss": sum(losses) / len(losses) if losses else None,
                  "test_loss": test_loss, "test_acc": test_acc,
                  "images_per_s": n_images / train_time if train_time > 0 else None,
                  "epoch_time_s": train_time,
                  "mean_cosine": _mean(r["cosine"] for r in epoch_recs),
                  "mean_norm_ratio": _mean(r["norm_ratio"] for r in epoch_recs),
                  "buffer_bytes": [s["bytes"] for s in stats],
                  "peak_buffer_bytes": peak}
        logger.log(record)
        bar.write(f"epoch {epoch}: step {step} train_loss {record['train_loss']} test_acc {test_acc:.4f} "
                  f"images/s {record['images_per_s']:.1f}", file=sys.stderr)
        if pipe is not None:
            pipe.meet()
        if last:
            break
    bar.close()
    if pipe is not None:
        pipe.close()
    if not logs:
        return None
    torch.save(model.state_dict(), os.path.join(out, "model.pt"))
    summary = dict(record, model=args.model, dataset=args.dataset, method=args.method, accum=args.accum,
                   runtime=args.runtime, seed=args.seed, final_test_acc=record["test_acc"],
                   analysis_mean_cosine=_mean(r["cosine"] for r in trainer.analysis),
                   analysis_mean_norm_ratio=_mean(r["norm_ratio"] for r in trainer.analysis))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"final: model={args.model} dataset={args.dataset} method={args.method} accum={args.accum} "
          f"runtime={args.runtime} epochs={record['epoch']} steps={step} train_loss={record['train_loss']} "
          f"test_acc={record['test_acc']:.4f} out={out}", flush=True)
    return summary


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


ARGUMENT_ERROR = 2  # the exit status of an argument error (argparse's), on the CLI and on each rank


def cli(argv=None):
    """`main` with argument errors turned into a one-line message and exit status 2 (`ARGUMENT_ERROR`). A
    ``--nproc`` run in which a rank exits with status 2 exits with it too, without ``--max-restarts``'s
    restarts."""
    from revkernels.petra.distributed import LaunchError

    try:
        main(argv)
    except (ValueError, NotImplementedError) as e:
        print(f"python -m revkernels.petra.train: error: {e}", file=sys.stderr)
        sys.exit(ARGUMENT_ERROR)
    except LaunchError as e:  # a rank's argument error is the run's
        print(f"python -m revkernels.petra.train: error: {e}", file=sys.stderr)
        sys.exit(ARGUMENT_ERROR if ARGUMENT_ERROR in e.exitcodes else 1)


if __name__ == "__main__":
    cli()
