"""Train-step benchmark: standard backprop against reversible training (transformer stacks, RevNets).

    python -m revkernels.bench.train                       # CUDA: ViT-B/L and RevNets, bf16 autocast
    python -m revkernels.bench.train --device cpu --quick  # a smoke run of the same code
    python benchmarks/bench_train.py ...                   # the same, from a checkout (results in benchmarks/results)
    python -m revkernels.bench --parts train               # as a part of the benchmark suite

Transformer variants, all measured in one run (forward, backward, AdamW step (fused on CUDA);
medians after warm-up):
    standard            pre-norm transformer blocks x + F(x), x + G(x), eager autograd
    standard_compile    the same with each block under torch.compile (one compiled graph shared by
                        all blocks of a stack: what large-model trainers do, and cheap to compile)
    standard_graphs     the same with the whole stack's forward and backward as CUDA graphs
                        (torch.cuda.make_graphed_callables)
    checkpoint          standard with per-block torch.utils.checkpoint
    reversible_plain    ReversibleBlock(F, G) of plain nn modules, sequential engine
    peer_revlib         the same F, G modules in RevLib's ReversibleSequential (pip install revlib)
    peer_memcnn         the same F, G modules in memcnn's additive couplings with keep_input=False
                        (pip install memcnn); peers run only where importable
    revkernels_<engine> RevViTBlock (fused recompute/grads) with each engine ("compiled": each block's
                        forward and backward step compiled once and shared by all blocks)
F = attention(LN(x)), G = MLP(LN(x)) with the same modules in every variant; the reversible ones
run two streams of the full width, as Rev-ViT does, so every variant computes one F and one G per
block in the forward. Memory, per model on an emptied device: ``peak_mib`` the step's peak
(parameters, grads, optimizer state, activations, captured graphs' pools) and ``transient_mib`` the
part of it above what stays allocated between steps (the activations; a captured graph keeps its
pool, holding its activations, allocated between steps, so for the graphs variants only
``peak_mib`` is comparable). Compile time: the first warm-up step is timed alone
(``first_step_ms``); for the variants that compile (standard_compile, revkernels_compiled)
``compile_s`` = first step - median step, with inductor's cache as the run finds it (point
TORCHINDUCTOR_CACHE_DIR at an empty folder for a cold compile) and Dynamo's caches reset before
each of them (every configuration compiles afresh, with static shapes). Warm-up steps never count
in ``ms``.

RevNets (``--revnets name:stem:batch``; on CUDA RevNet-18/50 at 224x224, batch 64 and 256, and
CIFAR RevNet-18 at 32x32, batch 256): plain autograd against each reversible engine, cross-entropy on
random images and labels.

Results: CSV with device, versions and commit, a throughput plot and a memory-vs-depth plot,
under --out. A variant that fails is printed with its error and recorded as nan. --budget-s: after
the first configuration (all variants of the first model and batch), no new configuration starts once
that many seconds have passed (the most important points run first); what was skipped is printed.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tqdm import tqdm

import revkernels as rk
from revkernels.bench.helptext import description
from revkernels.bench.report import (DEFAULT_OUT, check_device, check_out_folder, provenance, pyplot, save_figure,
                                     synchronize, timed_ms, write_csv)
from revkernels.nn.revvit import AttentionBranch, MlpBranch, RevViTBlock

MODELS = {"vit_b": dict(depth=12, dim=768, heads=12), "vit_l": dict(depth=24, dim=1024, heads=16)}
BATCHES = {"vit_b": [8, 32, 128], "vit_l": [8, 32]}
TOKENS = 197
ENGINES = ("sequential", "pareprop", "graphs", "compiled")
COMPILING = ("standard_compile", "revkernels_compiled")


class StandardBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.f, self.g = AttentionBranch(dim, heads), MlpBranch(dim, 4 * dim)

    def forward(self, x):
        x = x + self.f(x)
        return x + self.g(x)


class StandardStack(nn.Module):
    def __init__(self, depth, dim, heads, use_checkpoint=False):
        super().__init__()
        self.blocks = nn.ModuleList(StandardBlock(dim, heads) for _ in range(depth))
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.use_checkpoint else block(x)
        return x


class ReversibleStack(nn.Module):
    """Input duplicated into two streams, reversible blocks, streams averaged at the end."""

    def __init__(self, blocks, engine):
        super().__init__()
        self.seq = rk.nn.ReversibleSequential(*blocks, engine=engine)

    def forward(self, x):
        y1, y2 = self.seq(x, x)
        return (y1 + y2) * 0.5


class PeerStack(nn.Module):
    """A peer library's reversible stack on the two streams concatenated along the feature dim
    (the layout RevLib and memcnn split), streams averaged at the end like `ReversibleStack`. The
    concatenated input requires grad: RevLib's Function returns no graph otherwise."""

    def __init__(self, stack):
        super().__init__()
        self.stack = stack

    def forward(self, x):
        y1, y2 = self.stack(torch.cat([x, x], dim=-1).requires_grad_()).chunk(2, dim=-1)
        return (y1 + y2) * 0.5


def peer_available(variant):
    module = {"peer_revlib": "revlib", "peer_memcnn": "memcnn"}[variant]
    try:
        __import__(module)
    except Exception:  # not installed, or fails to import with this torch
        return False
    return True


def build(variant, depth, dim, heads):
    if variant == "peer_revlib":
        import revlib

        branches = [m for _ in range(depth) for m in (AttentionBranch(dim, heads), MlpBranch(dim, 4 * dim))]
        return PeerStack(revlib.ReversibleSequential(*branches, split_dim=-1))
    if variant == "peer_memcnn":
        import memcnn

        return PeerStack(nn.Sequential(*[
            memcnn.InvertibleModuleWrapper(memcnn.AdditiveCoupling(AttentionBranch(dim, heads), MlpBranch(dim, 4 * dim),
                                                                   split_dim=-1), keep_input=False)
            for _ in range(depth)]))
    if variant in ("standard", "standard_compile", "standard_graphs", "checkpoint"):
        return StandardStack(depth, dim, heads, use_checkpoint=variant == "checkpoint")
    if variant == "reversible_plain":
        return ReversibleStack([rk.nn.ReversibleBlock(AttentionBranch(dim, heads), MlpBranch(dim, 4 * dim))
                                for _ in range(depth)], "sequential")
    engine = variant.removeprefix("revkernels_")
    return ReversibleStack([RevViTBlock(dim, heads) for _ in range(depth)], engine)


def time_steps(model, inputs, loss_of, device, dtype, steps, warmup, graph_whole_model=False):
    """(median ms of a train step, ms of the first warm-up step (it compiles, where anything does),
    peak MiB of the step, of which MiB above what stays allocated between steps): forward under
    autocast, backward, AdamW step (fused on CUDA). The last is the step's transient memory
    (activations); what stays allocated between steps is parameters, optimizer state and, for
    captured CUDA graphs, their memory pools. graph_whole_model: the model is first replaced by
    torch.cuda.make_graphed_callables (the standard-backprop-in-a-CUDA-graph baseline)."""
    if warmup < 1:
        raise ValueError(f"warmup must be at least 1 (the first step is timed alone), got {warmup}")
    autocast = lambda **kw: torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32, **kw)  # noqa: E731
    if graph_whole_model:
        with autocast(cache_enabled=False):
            model = torch.cuda.make_graphed_callables(model, (inputs,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step():
        with autocast():
            loss = loss_of(model(inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    first = timed_ms(step, device, 1)[0]
    for _ in range(warmup - 1):
        step()
    synchronize(device)
    if device.type == "cuda":
        between_steps = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = timed_ms(step, device, steps)
    if device.type != "cuda":
        return statistics.median(times), first, float("nan"), float("nan")
    peak = torch.cuda.max_memory_allocated(device)
    return statistics.median(times), first, peak / 2**20, (peak - between_steps) / 2**20


def _fresh_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def compile_as_measured(variant, model):
    """Compiles `model`'s blocks where `variant` is standard_compile (each block under torch.compile,
    static shapes); the other variants run as `build` made them (standard_graphs is captured by
    `time_steps`)."""
    if variant == "standard_compile":
        for block in model.blocks:
            block.compile(dynamic=False)
    return model


def measure(variant, depth, dim, heads, batch, tokens, device, dtype, steps, warmup):
    _fresh_device(device)
    if variant in COMPILING:
        # A fresh compile of these shapes, as a training process would make, not a recompile of an
        # earlier configuration's graphs (which Dynamo would make dynamic in the sizes that changed).
        torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device(device):
        model = build(variant, depth, dim, heads)
        x = torch.randn(batch, tokens, dim)
    compile_as_measured(variant, model)
    return time_steps(model, x, lambda y: y.float().square().mean(), device, dtype, steps, warmup,
                      graph_whole_model=variant == "standard_graphs")


def measure_revnet(name, stem, engine, batch, device, dtype, steps, warmup):
    """A RevNet train step on random images and labels; engine "autograd" is plain backprop."""
    _fresh_device(device)
    torch.manual_seed(0)
    size = 32 if stem == "cifar" else 224
    classes = 10 if stem == "cifar" else 1000
    with torch.device(device):
        model = getattr(rk.models, name)(num_classes=classes, stem=stem, engine=engine)
        images = torch.randn(batch, 3, size, size)
        labels = torch.randint(0, classes, (batch,))
    return time_steps(model, images, lambda logits: F.cross_entropy(logits.float(), labels), device, dtype,
                      steps, warmup)


def _safely(fn, *args):
    """fn(*args), or four nans (time_steps' results) with the error printed: one failing variant
    keeps the others' rows."""
    try:
        return fn(*args)
    except Exception as error:  # reported in the output and the CSV (nan), never silently
        print(f"    FAILED: {type(error).__name__}: {str(error).splitlines()[0][:200]}", flush=True)
        return float("nan"), float("nan"), float("nan"), float("nan")


REVNETS_CUDA = ["revnet18:imagenet:64", "revnet18:imagenet:256", "revnet50:imagenet:64", "revnet50:imagenet:256",
                "revnet18:cifar:256"]
REVNET_ENGINES = ("autograd", "sequential", "pareprop", "graphs")
REVNET_NAMES = ("revnet18", "revnet34", "revnet50")


def _ratio(a, b):
    return f"{a / b:.2f}x" if a == a and b == b and b else "n/a"  # nan-safe


def parse_args(argv=None, default_out=DEFAULT_OUT):
    parser = argparse.ArgumentParser(prog="python -m revkernels.bench.train", description=description(__doc__))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few steps (smoke run)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: 8 32 128 for vit_b, 8 32 for vit_l)")
    parser.add_argument("--variants", nargs="+", help="transformer variants to run (default: all for the device)")
    parser.add_argument("--depth-sweep", type=int, nargs="*", default=[12, 24, 48],
                        help="depths for the memory sweep (ViT-B width, batch 32)")
    parser.add_argument("--revnets", nargs="*", help="RevNet configs name:stem:batch (default on CUDA: "
                        + " ".join(REVNETS_CUDA) + "; none on CPU unless --quick); empty to skip")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new configuration after this many seconds; the first always runs (default: no limit)")
    parser.add_argument("--out", default=default_out, help=f"folder for CSV and PNG (default: {default_out})")
    args = parser.parse_args(argv)
    check_out_folder(parser, args.out)
    check_device(parser, args.device)
    known = all_variants()
    unknown = [v for v in args.variants or [] if v not in known]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(known)})")
    for name in ("batches", "depth_sweep"):
        if getattr(args, name) and min(getattr(args, name)) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for config in args.revnets or []:
        name, stem, batch = (config.split(":") + ["", "", ""])[:3]
        if config.count(":") != 2 or name not in REVNET_NAMES or stem not in rk.models.revnet.STEMS \
                or not batch.isdigit() or int(batch) < 1:
            parser.error(f"--revnets: {config!r} is not name:stem:batch with name in {', '.join(REVNET_NAMES)}, "
                         f"stem in {', '.join(rk.models.revnet.STEMS)} and a positive batch")
    return args


def all_variants():
    """Every transformer variant name (a run measures those its device and installed peers allow)."""
    return ["standard", "standard_compile", "standard_graphs", "checkpoint", "reversible_plain", "peer_revlib",
            "peer_memcnn"] + [f"revkernels_{e}" for e in ENGINES]


def run(args):
    """Measures, prints the tables, writes train_<device>.csv/.png under args.out; returns the rows."""
    start = time.perf_counter()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    variants = [v for v in all_variants() if (cuda or v != "standard_graphs")
                and (not v.startswith("peer_") or peer_available(v)) and (not args.variants or v in args.variants)]
    if args.quick:
        models, batches, tokens, steps, warmup = {"tiny": dict(depth=2, dim=64, heads=4)}, {"tiny": [2]}, 17, 2, 1
        sweep = [1, 2] if args.depth_sweep else []
        revnets = ["revnet18:cifar:2"] if args.revnets is None else args.revnets
    else:
        models = {m: MODELS[m] for m in args.models}
        batches = {m: args.batches or BATCHES[m] for m in models}
        tokens, steps, warmup, sweep = TOKENS, 10, 3, args.depth_sweep
        revnets = (REVNETS_CUDA if cuda else []) if args.revnets is None else args.revnets
    meta = provenance(args.device)
    print(f"train-step benchmark on {meta['device']} ({dtype}), torch {meta['torch']}, commit {meta['commit']}")
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, f"train_{device.type}.csv")
    rows = []

    def record(row, label):
        row = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
        rows.append(row)
        write_csv(csv_path, rows, meta)  # after every row: a run stopped early keeps what it measured
        compile_s = f"  (compile {row['compile_s']:.1f} s)" if row["compile_s"] != "" else ""
        print(f"{label:<42} {row['ms']:9.2f} ms  peak {row['peak_mib']:8.1f} MiB  transient "
              f"{row['transient_mib']:8.1f} MiB{compile_s}", flush=True)

    def timing(variant, ms, first):
        # compile time beside the step time, for the variants that compile
        return {"ms": ms, "first_step_ms": first, "compile_s": (first - ms) / 1e3 if variant in COMPILING else ""}

    def transformer(name, batch):
        shape = models[name]
        for variant in variants:
            ms, first, peak, transient = _safely(measure, variant, shape["depth"], shape["dim"], shape["heads"],
                                                 batch, tokens, device, dtype, steps, warmup)
            record({"kind": "throughput", "model": name, "depth": shape["depth"], "batch": batch, "variant": variant,
                    **timing(variant, ms, first), "images_per_s": batch / ms * 1e3, "peak_mib": peak,
                    "transient_mib": transient},
                   f"{name} batch {batch} {variant}")

    def revnet(config):
        name, stem, batch = config.split(":")
        for engine in REVNET_ENGINES:
            ms, first, peak, transient = _safely(measure_revnet, name, stem, engine, int(batch), device, dtype,
                                                 max(2, steps // 2), max(1, warmup - 1))
            record({"kind": "revnet", "model": f"{name}_{stem}", "depth": "", "batch": int(batch), "variant": engine,
                    **timing(engine, ms, first), "images_per_s": int(batch) / ms * 1e3, "peak_mib": peak,
                    "transient_mib": transient},
                   f"{name}_{stem} batch {batch} {engine}")

    def depth_sweep(depth):
        shape, batch = next(iter(models.values())), (2 if args.quick else 32)
        for variant in ("standard", "reversible_plain", "revkernels_sequential"):
            ms, first, peak, transient = _safely(measure, variant, depth, shape["dim"], shape["heads"], batch,
                                                 tokens, device, dtype, max(2, steps // 3), 1)
            record({"kind": "depth_sweep", "model": "sweep", "depth": depth, "batch": batch, "variant": variant,
                    **timing(variant, ms, first), "images_per_s": "", "peak_mib": peak, "transient_mib": transient},
                   f"depth {depth} batch {batch} {variant}")

    # The headline points first (ViT-B 32/128, ViT-L 32, the RevNets, the depth sweep), the
    # small batches last, so a run stopped by a time limit has measured what matters most.
    transformers = [(transformer, (name, batch)) for name in models for batch in batches[name]]
    jobs = [job for job in transformers if job[1][1] >= 32] + [(revnet, (config,)) for config in revnets] + \
        [(depth_sweep, (depth,)) for depth in sweep] + [job for job in transformers if job[1][1] < 32]
    skipped = []
    for k, (job, job_args) in enumerate(tqdm(jobs, desc="train", unit="config", file=sys.stderr, leave=False)):
        if args.budget_s is not None and k > 0 and time.perf_counter() - start > args.budget_s:
            skipped.append(" ".join(str(a) for a in job_args))
            continue
        job(*job_args)
    if skipped:
        print(f"time budget of {args.budget_s:.0f} s spent; not measured: {', '.join(skipped)}", flush=True)

    def pick(kind, model, batch):
        return {r["variant"]: r for r in rows if r["kind"] == kind and r["model"] == model and r["batch"] == batch}

    def measured(variant):
        """(model, batch, that configuration's throughput rows by variant) where `variant` was measured."""
        for name in models:
            for batch in batches[name]:
                mine = pick("throughput", name, batch)
                if variant in mine:
                    yield name, batch, mine

    print(f"\n{'model':>6} {'batch':>5}  " + "  ".join(f"{v:>14}" for v in variants[1:]) + "   (speed vs standard)")
    for name, batch, mine in measured("standard"):
        print(f"{name:>6} {batch:>5}  " + "  ".join(f"{_ratio(mine['standard']['ms'], mine[v]['ms']):>14}"
                                                   for v in variants[1:] if v in mine))
    if "revkernels_graphs" in variants:
        print("\nrevkernels_graphs speed vs: " + ", ".join(v for v in variants if v != "revkernels_graphs"))
        for name, batch, mine in measured("revkernels_graphs"):
            ours = mine["revkernels_graphs"]["ms"]
            print(f"{name:>6} {batch:>5}  " + "  ".join(f"{_ratio(mine[v]['ms'], ours):>8}" for v in variants
                                                       if v != "revkernels_graphs" and v in mine))
    if "revkernels_compiled" in variants:
        print("\nrevkernels_compiled speed vs standard eager and vs standard_compile; compile s (first step - median)")
        for name, batch, mine in measured("revkernels_compiled"):
            ours = mine["revkernels_compiled"]["ms"]
            eager, compiled = (mine.get(v, {}).get("ms", float("nan")) for v in ("standard", "standard_compile"))
            compile_s = ", ".join(f"{v} {mine[v]['compile_s']:.1f} s" for v in COMPILING if v in mine)
            print(f"{name:>6} {batch:>5}  vs standard {_ratio(eager, ours)}  vs standard_compile "
                  f"{_ratio(compiled, ours)}  compile: {compile_s}")
    if revnets:
        print("\nRevNet vs autograd: speed, and how many times less step peak / transient (activation) memory")
        for config in revnets:
            name, stem, batch = config.split(":")
            mine = pick("revnet", f"{name}_{stem}", int(batch))
            if "autograd" not in mine:
                continue
            base = mine["autograd"]
            print(f"{name}_{stem} batch {batch}: " + "  ".join(
                f"{e} {_ratio(base['ms'], mine[e]['ms'])} speed, {_ratio(base['peak_mib'], mine[e]['peak_mib'])}"
                f" / {_ratio(base['transient_mib'], mine[e]['transient_mib'])} less memory"
                for e in REVNET_ENGINES[1:] if e in mine))
    if not rows:
        print("\nnothing measured: no CSV or plot written", flush=True)
        return rows
    png = _plot(os.path.join(args.out, f"train_{device.type}.png"), rows, meta)
    print(f"\nwrote {csv_path}" + (f" and {png}" if png else ""))
    return rows


def main(argv=None, default_out=DEFAULT_OUT):
    run(parse_args(argv, default_out))
    return 0


def _plot(path, rows, meta):
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(19, 4.5))
    throughput = [r for r in rows if r["kind"] == "throughput"]
    for (model, variant) in dict.fromkeys((r["model"], r["variant"]) for r in throughput):
        mine = sorted((r for r in throughput if r["model"] == model and r["variant"] == variant), key=lambda r: r["batch"])
        axes[0].plot([r["batch"] for r in mine], [r["images_per_s"] for r in mine], marker="o", label=f"{model} {variant}")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("batch")
    axes[0].set_ylabel("images / s")
    axes[0].legend(fontsize=6)
    sweep = [r for r in rows if r["kind"] == "depth_sweep"]
    for variant in dict.fromkeys(r["variant"] for r in sweep):
        mine = sorted((r for r in sweep if r["variant"] == variant), key=lambda r: r["depth"])
        axes[1].plot([r["depth"] for r in mine], [r["peak_mib"] for r in mine], marker="o", label=variant)
    axes[1].set_xlabel("depth (blocks)")
    axes[1].set_ylabel("peak memory of a step (MiB)")
    if sweep:
        axes[1].legend(fontsize=7)
    revnet = [r for r in rows if r["kind"] == "revnet"]
    configs = list(dict.fromkeys((r["model"], r["batch"]) for r in revnet))
    engines = list(dict.fromkeys(r["variant"] for r in revnet))
    width = 0.8 / max(1, len(engines))
    for k, engine in enumerate(engines):
        values = [next((r["images_per_s"] for r in revnet if (r["model"], r["batch"]) == c and r["variant"] == engine), 0)
                  for c in configs]
        axes[2].bar([i + k * width for i in range(len(configs))], values, width, label=engine)
    if configs:
        axes[2].set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(configs))],
                           [f"{m}\nbatch {b}" for m, b in configs], fontsize=7)
        axes[2].set_ylabel("images / s")
        axes[2].legend(fontsize=7)
    fig.suptitle(f"{meta['device']} | torch {meta['torch']} | commit {meta['commit']}", fontsize=9)
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
