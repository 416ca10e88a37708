"""Train-step benchmark of transformer stacks: standard backprop against reversible training.

    python benchmarks/bench_train.py                       # CUDA: ViT-B/L, bf16 autocast
    python benchmarks/bench_train.py --device cpu --quick  # a smoke run of the same code

Variants, all measured in one run (forward, backward, AdamW step; medians after warm-up):
    standard            pre-norm transformer blocks x + F(x), x + G(x), eager autograd
    standard_compile    the same with each block under torch.compile (one compiled graph shared by
                        all blocks of a stack: what large-model trainers do, and cheap to compile)
    checkpoint          standard with per-block torch.utils.checkpoint
    reversible_plain    ReversibleBlock(F, G) of plain nn modules, sequential engine
    revkernels_<engine> RevViTBlock (fused recompute/grads) with each engine
F = attention(LN(x)), G = MLP(LN(x)) with the same modules in every variant; the reversible ones
run two streams of the full width, as Rev-ViT does, so every variant computes one F and one G per
block in the forward. Results: CSV with device, versions and commit, a throughput plot and a
memory-vs-depth plot, under --out.
"""
import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import revkernels as rk  # noqa: E402
from revkernels.bench.report import provenance, pyplot, save_figure, write_csv  # noqa: E402
from revkernels.nn.revvit import AttentionBranch, MlpBranch, RevViTBlock  # noqa: E402

MODELS = {"vit_b": dict(depth=12, dim=768, heads=12), "vit_l": dict(depth=24, dim=1024, heads=16)}
BATCHES = {"vit_b": [8, 32, 128], "vit_l": [8, 32]}
TOKENS = 197
ENGINES = ("sequential", "pareprop")


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


def build(variant, depth, dim, heads):
    if variant in ("standard", "standard_compile", "checkpoint"):
        model = StandardStack(depth, dim, heads, use_checkpoint=variant == "checkpoint")
        return model
    if variant == "reversible_plain":
        return ReversibleStack([rk.nn.ReversibleBlock(AttentionBranch(dim, heads), MlpBranch(dim, 4 * dim))
                                for _ in range(depth)], "sequential")
    engine = variant.removeprefix("revkernels_")
    return ReversibleStack([RevViTBlock(dim, heads) for _ in range(depth)], engine)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(variant, depth, dim, heads, batch, tokens, device, dtype, steps, warmup):
    torch.manual_seed(0)
    model = build(variant, depth, dim, heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant == "standard_compile":
        for block in model.blocks:
            block.compile(dynamic=False)
    x = torch.randn(batch, tokens, dim, device=device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step():
        with autocast:
            loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few steps (smoke run)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: 8 32 128 for vit_b, 8 32 for vit_l)")
    parser.add_argument("--depth-sweep", type=int, nargs="*", default=[12, 24, 48],
                        help="depths for the memory sweep (ViT-B width, batch 32)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    variants = ["standard"] + (["standard_compile"] if device.type == "cuda" else []) + \
        ["checkpoint", "reversible_plain"] + [f"revkernels_{e}" for e in ENGINES]
    if args.quick:
        models, batches, tokens, steps, warmup = {"tiny": dict(depth=2, dim=64, heads=4)}, {"tiny": [2]}, 17, 2, 1
        sweep = [1, 2] if args.depth_sweep else []
    else:
        models = {m: MODELS[m] for m in args.models}
        batches = {m: args.batches or BATCHES[m] for m in models}
        tokens, steps, warmup, sweep = TOKENS, 10, 3, args.depth_sweep
    meta = provenance(args.device)
    print(f"train-step benchmark on {meta['device']} ({dtype}), torch {meta['torch']}, commit {meta['commit']}")
    rows = []
    for name, shape in models.items():
        for batch in batches[name]:
            for variant in variants:
                ms, peak = measure(variant, shape["depth"], shape["dim"], shape["heads"], batch, tokens, device,
                                   dtype, steps, warmup)
                rows.append({"kind": "throughput", "model": name, "depth": shape["depth"], "batch": batch,
                             "variant": variant, "ms": round(ms, 3), "images_per_s": round(batch / ms * 1e3, 1),
                             "peak_mib": round(peak, 1)})
                print(f"{name:>6} batch {batch:>4} {variant:<22} {ms:9.2f} ms  peak {peak:8.1f} MiB", flush=True)
    sweep_shape = next(iter(models.values()))
    for depth in sweep:
        for variant in ("standard", "reversible_plain", "revkernels_sequential"):
            ms, peak = measure(variant, depth, sweep_shape["dim"], sweep_shape["heads"], 32 if not args.quick else 2,
                               tokens, device, dtype, max(2, steps // 3), 1)
            rows.append({"kind": "depth_sweep", "model": "sweep", "depth": depth, "batch": 32 if not args.quick else 2,
                         "variant": variant, "ms": round(ms, 3), "images_per_s": "", "peak_mib": round(peak, 1)})

    print(f"\n{'model':>6} {'batch':>5}  " + "  ".join(f"{v:>14}" for v in variants[1:]) + "   (speed vs standard)")
    for name in models:
        for batch in batches[name]:
            mine = {r["variant"]: r for r in rows if r["kind"] == "throughput" and r["model"] == name and r["batch"] == batch}
            base = mine["standard"]["ms"]
            print(f"{name:>6} {batch:>5}  " + "  ".join(f"{base / mine[v]['ms']:>13.2f}x" for v in variants[1:]))
    os.makedirs(args.out, exist_ok=True)
    tag = device.type
    path = write_csv(os.path.join(args.out, f"train_{tag}.csv"), rows, meta)
    png = _plot(os.path.join(args.out, f"train_{tag}.png"), rows, meta)
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    return 0


def _plot(path, rows, meta):
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
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
    fig.suptitle(f"{meta['device']} | torch {meta['torch']} | commit {meta['commit']}", fontsize=9)
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
