"""Where a train step's time goes: torch.profiler over a few steps of one variant of the train benchmark
(`revkernels.bench.train`).

    python benchmarks/profile_train.py --variant revkernels_sequential --model vit_b --batch 32

Prints the wall time of a step, the time the GPU was busy in it, and the ops ranked by host (self
CPU) time and by device time: a step whose wall time is far above its GPU-busy time is bound by
launch overhead, and the host ranking says which calls cost it.
"""
import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from revkernels.bench.helptext import description
from revkernels.bench.train import MODELS, TOKENS, all_variants, build, compile_as_measured


def main(argv=None):
    parser = argparse.ArgumentParser(description=description(__doc__))
    # (standard_graphs is a whole-step CUDA graph capture of the train benchmark's timing loop, not profiled here)
    parser.add_argument("--variant", default="revkernels_sequential",
                        choices=[v for v in all_variants() if v != "standard_graphs"])
    parser.add_argument("--model", default="vit_b", choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--depth", type=int, help="blocks (default: the model's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=20, help="ops listed per ranking")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = MODELS[args.model]
    torch.manual_seed(0)
    model = compile_as_measured(args.variant, build(args.variant, args.depth or shape["depth"], shape["dim"],
                                                    shape["heads"]).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, TOKENS, shape["dim"], device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize() if device.type == "cuda" else None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize() if device.type == "cuda" else None
        wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / args.steps if device.type == "cuda" else 0.0
    print(f"{args.variant} {args.model} batch {args.batch}: {wall_ms:.2f} ms per step (profiled), "
          f"GPU busy {device_us / 1e3:.2f} ms per step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    if device.type == "cuda":
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
