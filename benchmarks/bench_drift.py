"""Reconstruction drift of reversible stacks by depth and dtype (what the engines' backward sees).

    python benchmarks/bench_drift.py                 # RevViTBlock(dim 64, heads 4), 17 tokens, batch 4
    python benchmarks/bench_drift.py --quick --out /tmp/drift   # a smoke run of the same code

For each depth (1, 4, 16, 64) and precision mode, a freshly initialised stack of RevViTBlocks
(seeds 0..--seeds-1) runs forward on random inputs and `revkernels.check_reversibility` rebuilds
every block's input from the run's output, as a memory-saving backward does. Reported (relative
max-abs error, worst stream):
    local_max       the worst single-block error (block inverted from its own exact output), worst seed
    chained_max     the worst error of an input rebuilt from the run's final output (errors
                    compound through the blocks after it), worst seed
    chained_median  the same, median over the seeds (low-precision compute makes rare one-ulp
                    rounding flips of F/G's input dominate the worst case)
Modes: fp32 (streams and compute fp32), autocast_bf16 / autocast_fp16 (fp32 streams, F and G
under autocast; fp16 only where autocast supports it on the device), bf16_streams (parameters,
streams and compute in bf16). Streams (--streams): float (the streams in the mode's dtype) and
exact (``exact=True``: int64 fixed-point streams whose float views F and G see, in the mode's
dtype; the rebuild is exact, so its rows read 0). Results: CSV with provenance under --out
(drift_<device>.csv).
"""
import argparse
import os
import statistics

import torch

import revkernels as rk
from revkernels.bench.helptext import description
from revkernels.bench.report import provenance, write_csv
from revkernels.nn.revvit import RevViTBlock

MODES = ("fp32", "autocast_bf16", "autocast_fp16", "bf16_streams")
STREAMS = ("float", "exact")


def _context(mode, device):
    if mode.startswith("autocast_"):
        dtype = torch.bfloat16 if mode.endswith("bf16") else torch.float16
        return torch.autocast(device, dtype=dtype)
    return torch.autocast(device, enabled=False)


def measure(depth, mode, streams, seed, dim, heads, tokens, batch, device):
    torch.manual_seed(seed)
    seq = rk.nn.ReversibleSequential(*[RevViTBlock(dim, heads) for _ in range(depth)],
                                     exact=streams == "exact").to(device)
    x1, x2 = (torch.randn(batch, tokens, dim, device=device) for _ in range(2))
    if mode == "bf16_streams":
        seq, x1, x2 = seq.to(torch.bfloat16), x1.bfloat16(), x2.bfloat16()
    with _context(mode, device):
        report = rk.check_reversibility(seq, x1, x2)
    return max(max(e) for e in report.block_errors), max(max(e) for e in report.chained_errors)


def main(argv=None):
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny stacks, one seed (smoke run)")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--streams", nargs="+", default=list(STREAMS), choices=STREAMS)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    if args.seeds < 1 or min(args.depths) < 1:
        parser.error(f"--seeds and --depths must be at least 1, got {args.seeds} and {args.depths}")
    dim, heads, tokens, batch, depths, seeds = 64, 4, 17, 4, args.depths, args.seeds
    if args.quick:
        dim, heads, tokens, batch, depths, seeds = 16, 2, 5, 2, [1, 2], 1
    device = torch.device(args.device).type
    meta = provenance(args.device)
    print(f"reconstruction drift on {meta['device']}, torch {meta['torch']}, commit {meta['commit']}: "
          f"RevViTBlock(dim={dim}, heads={heads}), {tokens} tokens, batch {batch}, worst of {seeds} seed(s)")
    rows = []
    for mode, streams in ((m, s) for s in args.streams for m in args.modes):
        for depth in depths:
            try:
                results = [measure(depth, mode, streams, s, dim, heads, tokens, batch, device) for s in range(seeds)]
                local, chained = max(r[0] for r in results), max(r[1] for r in results)
                median = statistics.median(r[1] for r in results)
                status = "ok"
            except (RuntimeError, NotImplementedError) as error:  # e.g. fp16 autocast unsupported
                local = chained = median = float("nan")
                status = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            rows.append({"mode": mode, "streams": streams, "depth": depth, "dim": dim, "heads": heads, "tokens": tokens, "batch": batch,
                         "seeds": seeds, "local_max": local, "chained_max": chained,
                         "chained_median": median, "status": status})
    print(f"\n{'mode':<14} {'streams':<8}" + " ".join(f"{'depth ' + str(d):>30}" for d in depths)
          + "   (local max / chained max / chained median)")
    for mode, streams in dict.fromkeys((r["mode"], r["streams"]) for r in rows):
        mine = [r for r in rows if (r["mode"], r["streams"]) == (mode, streams)]
        print(f"{mode:<14} {streams:<8}" + " ".join(
            f"{r['local_max']:>9.1e} /{r['chained_max']:>9.1e} /{r['chained_median']:>8.1e}" for r in mine))
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['mode']} ({r['streams']} streams) depth {r['depth']}: {r['status']}")
    path = write_csv(os.path.join(args.out, f"drift_{device}.csv"), rows, meta)
    print(f"\nwrote {path}")
    return rows


if __name__ == "__main__":
    main()
