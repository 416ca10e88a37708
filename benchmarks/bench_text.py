"""A real text run, offline: a byte-level causal LM (`revtext("gpt2_small", ...)` at small size) on the
Python standard library's own source files, at two depths, trained three ways from the same seed.

    autograd     the reversible model, ordinary autograd (stores every activation)
    sequential   the reversible model, the sequential engine (rebuilds activations; same math, so
                 its loss curve equals autograd's up to rounding)
    standard     a non-reversible pre-norm transformer of the same geometry (the same layers on one
                 stream: x += F(x); x += G(x))

Reports train tokens/s (median step), activations saved for backward (one forward, parameters
excluded), the loss curves and the held-out loss; the largest |loss difference| between sequential
and autograd over the run.

    python benchmarks/bench_text.py [--quick] [--steps N] [--depths 2 4] [--out DIR]

Writes text_<device>.csv (one row per depth and model), text_<device>_loss.csv (the loss of every
step) and text_<device>.png under --out (default benchmarks/results).
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
import revkernels as rk
from revkernels.bench.helptext import description
from revkernels.bench.report import provenance, pyplot, save_figure, write_csv

# A fixed subset of the standard library (top-level modules present in Python 3.9-3.13).
CORPUS_FILES = ("abc.py", "argparse.py", "base64.py", "bisect.py", "calendar.py", "contextlib.py", "copy.py",
                "csv.py", "dataclasses.py", "datetime.py", "difflib.py", "fractions.py", "functools.py",
                "heapq.py", "inspect.py", "operator.py", "os.py", "queue.py", "random.py", "shutil.py",
                "string.py", "subprocess.py", "tempfile.py", "textwrap.py", "threading.py", "typing.py",
                "uuid.py", "warnings.py", "weakref.py", "zipfile.py")
MODELS = ("autograd", "sequential", "standard")


def corpus():
    """The bytes of CORPUS_FILES (those present), concatenated, as a uint8 tensor."""
    root = os.path.dirname(os.__file__)
    data = b""
    for name in CORPUS_FILES:
        path = os.path.join(root, name)
        if os.path.exists(path):
            with open(path, "rb") as handle:
                data += handle.read()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Standard(nn.Module):
    """The layers of a `RevText` run as an ordinary pre-norm transformer on one stream."""

    def __init__(self, rev):
        super().__init__()
        self.rev = rev

    def forward(self, tokens):
        r = self.rev
        h = r.dropout(r.tok_embed(tokens) + r.pos_embed(torch.arange(tokens.shape[1], device=tokens.device)))
        for block in r.blocks:
            h = h + block.f(h)
            h = h + block.g(h)
        return F.linear(r.norm(h), r.tok_embed.weight)


def build(kind, depth, args):
    torch.manual_seed(args.seed)
    model = rk.models.revtext("gpt2_small", 256, args.tokens, depth=depth, dim=args.dim, heads=args.heads,
                              dropout=args.dropout, engine="sequential" if kind == "sequential" else "autograd")
    return Standard(model) if kind == "standard" else model


def lm_loss(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def batches(data, steps, args):
    """The step's batches: (batch, tokens + 1) windows at offsets from a generator of their own, so
    every model sees the same data whatever randomness its layers draw."""
    g = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(data) - args.tokens - 1, (steps, args.batch), generator=g)
    return [torch.stack([data[s:s + args.tokens + 1] for s in row.tolist()]) for row in starts]


def saved_mib(model, batch):
    """Bytes saved for backward by one forward (parameters excluded), in MiB."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model, batch)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params) / 2**20


def train(kind, depth, train_batches, val_batches, args, progress):
    model = build(kind, depth, args).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    torch.manual_seed(args.seed + 1)  # the dropout stream: the same for every model
    losses, times = [], []
    for batch in train_batches:
        start = time.perf_counter()
        loss = lm_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        progress.update(1)
    model.eval()
    with torch.no_grad():
        val = statistics.mean(lm_loss(model, b).item() for b in val_batches)
    model.train()
    step_s = statistics.median(times[1:])
    return {"depth": depth, "model": kind, "params": sum(p.numel() for p in model.parameters()),
            "step_ms": round(step_s * 1e3, 2), "tokens_per_s": round(args.batch * args.tokens / step_s, 1),
            "saved_mib": round(saved_mib(model, train_batches[0]), 3), "final_train_loss": round(losses[-1], 4),
            "val_loss": round(val, 4)}, losses


def plot(path, rows, curves, meta, args):
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for (depth, kind), losses in curves.items():
        style = {"autograd": "-", "sequential": "--", "standard": ":"}[kind]
        axes[0].plot(range(1, len(losses) + 1), losses, style, label=f"depth {depth} {kind}")
    axes[0].set(xlabel="step", ylabel="train loss (nats/byte)", title="loss curves (same seed and data)")
    labels = [f"depth {r['depth']} {r['model']}" for r in rows]
    axes[1].bar(labels, [r["saved_mib"] for r in rows], color=[f"C{MODELS.index(r['model'])}" for r in rows])
    axes[1].set(title="activations saved for backward (MiB)")
    axes[2].bar(labels, [r["tokens_per_s"] for r in rows], color=[f"C{MODELS.index(r['model'])}" for r in rows])
    axes[2].set(title="train tokens/s (median step)")
    axes[0].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    for ax in axes[1:]:
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.suptitle(f"byte-level LM, dim {args.dim}, {args.heads} heads, {args.tokens} tokens x batch {args.batch} | "
                 f"{meta['device']} | torch {meta['torch']} | commit {meta['commit']}", fontsize=9)
    return save_figure(fig, path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--quick", action="store_true", help="small sizes and few steps (under ~2 min on 2 CPU cores)")
    parser.add_argument("--depths", type=int, nargs=2, help="the two depths (default 2 4 with --quick, 4 12)")
    parser.add_argument("--steps", type=int, help="train steps per model (default 30 with --quick, 300)")
    parser.add_argument("--dim", type=int, help="width (default 64 with --quick, 128)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--tokens", type=int, help="context length (default 64 with --quick, 128)")
    parser.add_argument("--batch", type=int, help="sequences per step (default 8 with --quick, 16)")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a loaded machine several threads stall each other)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    quick = args.quick
    args.depths = args.depths or ([2, 4] if quick else [4, 12])
    args.steps = args.steps or (30 if quick else 300)
    args.dim = args.dim or (64 if quick else 128)
    args.tokens = args.tokens or (64 if quick else 128)
    args.batch = args.batch or (8 if quick else 16)
    for name in ("steps", "dim", "heads", "tokens", "batch", "threads"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    if min(args.depths) < 1:
        parser.error(f"--depths must be at least 1, got {args.depths}")
    if args.dim % args.heads:
        parser.error(f"--heads must divide --dim ({args.dim}), got {args.heads}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    meta = provenance("cpu")
    data = corpus()
    split = int(len(data) * 0.9)
    train_batches = batches(data[:split], args.steps, args)
    val_batches = batches(data[split:], 4, args)
    print(f"byte-level LM on {len(data) / 1e6:.2f} MB of the standard library (Python {sys.version.split()[0]}), "
          f"{meta['device']}, torch {meta['torch']}, commit {meta['commit']}")
    rows, curves = [], {}
    with tqdm(total=len(args.depths) * len(MODELS) * args.steps, desc="text", unit="step", file=sys.stderr) as progress:
        for depth in args.depths:
            for kind in MODELS:
                row, losses = train(kind, depth, train_batches, val_batches, args, progress)
                rows.append(row)
                curves[(depth, kind)] = losses
    for row in rows:
        row["max_abs_loss_diff_vs_autograd"] = "" if row["model"] == "standard" else round(
            max(abs(a - b) for a, b in zip(curves[(row["depth"], row["model"])], curves[(row["depth"], "autograd")])), 9)
        row.update(dim=args.dim, heads=args.heads, tokens=args.tokens, batch=args.batch, steps=args.steps,
                   dropout=args.dropout, corpus_bytes=len(data), python=sys.version.split()[0])
    print(f"\n{'depth':>5} {'model':<11} {'tokens/s':>9} {'step ms':>8} {'saved MiB':>10} {'val loss':>9} {'|dloss| vs autograd':>20}")
    for r in rows:
        print(f"{r['depth']:>5} {r['model']:<11} {r['tokens_per_s']:>9.0f} {r['step_ms']:>8.1f} {r['saved_mib']:>10.2f} "
              f"{r['val_loss']:>9.4f} {str(r['max_abs_loss_diff_vs_autograd']):>20}")
    os.makedirs(args.out, exist_ok=True)
    csv_path = write_csv(os.path.join(args.out, "text_cpu.csv"), rows, meta)
    loss_rows = [{"depth": d, "model": k, "step": i + 1, "loss": round(v, 6)} for (d, k), ls in curves.items()
                 for i, v in enumerate(ls)]
    write_csv(os.path.join(args.out, "text_cpu_loss.csv"), loss_rows, meta)
    png_path = plot(os.path.join(args.out, "text_cpu.png"), rows, curves, meta, args)
    print(f"wrote {csv_path}" + (f" and {png_path}" if png_path else " (install matplotlib for the plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
