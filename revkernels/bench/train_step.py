"""Train-step measurements: time, saved activation memory and peak memory per engine and depth.

Time: median over `steps` timed steps after `warmup` steps, synchronised on CUDA.
Saved memory: bytes of the distinct storages autograd keeps between forward and backward (parameters
excluded), counted with `torch.autograd.graph.saved_tensors_hooks`: exact and device-independent.
Peak memory: on CUDA `torch.cuda.max_memory_allocated` above what was allocated before the step;
on CPU the growth of the peak resident set of a fresh process over two steps (malloc's mmap
threshold pinned so freed activations go back to the system): an upper bound that includes
allocator overhead. Both include the parameter grads a step allocates.
"""
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

import revkernels as rk
from revkernels.bench.report import synchronize


@dataclass(frozen=True)
class TrainStepConfig:
    engine: str
    depth: int
    width: int
    rows: int
    device: str
    autocast_dtype: str | None = None  # "bfloat16" / "float16" under autocast, None for fp32
    steps: int = 10
    warmup: int = 3


def _mlp(width):
    return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def build(config, seed=0):
    torch.manual_seed(seed)
    blocks = [rk.nn.ReversibleBlock(_mlp(config.width), _mlp(config.width)) for _ in range(config.depth)]
    seq = rk.nn.ReversibleSequential(*blocks, engine=config.engine).to(config.device)
    x1 = torch.randn(config.rows, config.width, device=config.device)
    x2 = torch.randn(config.rows, config.width, device=config.device)
    optimizer = torch.optim.SGD(seq.parameters(), lr=1e-3)
    return seq, x1, x2, optimizer


def _autocast(config):
    dtype = getattr(torch, config.autocast_dtype) if config.autocast_dtype else torch.float32
    return torch.autocast(torch.device(config.device).type, dtype=dtype, enabled=config.autocast_dtype is not None)


def train_step(seq, x1, x2, optimizer, config):
    with _autocast(config):
        y1, y2 = seq(x1, x2)
        loss = (y1.float().square().mean() + y2.float().square().mean())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def median_step_ms(config):
    seq, x1, x2, optimizer = build(config)
    for _ in range(config.warmup):
        train_step(seq, x1, x2, optimizer, config)
    times = []
    for _ in range(config.steps):
        synchronize(config.device)
        start = time.perf_counter()
        train_step(seq, x1, x2, optimizer, config)
        synchronize(config.device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def saved_bytes(config):
    seq, x1, x2, _ = build(config)
    x1.requires_grad_()
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(config):
        seq(x1, x2)
    params = {p.untyped_storage().data_ptr() for p in seq.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def peak_bytes(config):
    if torch.device(config.device).type == "cuda":
        seq, x1, x2, optimizer = build(config)
        train_step(seq, x1, x2, optimizer, config)  # grads and optimizer state exist from here on
        synchronize(config.device)
        torch.cuda.reset_peak_memory_stats(config.device)
        base = torch.cuda.memory_allocated(config.device)
        train_step(seq, x1, x2, optimizer, config)
        synchronize(config.device)
        return torch.cuda.max_memory_allocated(config.device) - base
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run([sys.executable, "-m", "revkernels.bench.train_step", json.dumps(asdict(config))],
                         capture_output=True, text=True, env=env, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _peak_rss_bytes():
    # VmHWM belongs to this process image; ru_maxrss would carry the parent's peak across exec.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _cpu_peak_in_this_process(config):
    torch.set_num_threads(1)  # one thread: no per-thread scratch in the measurement
    seq, x1, x2, optimizer = build(config)
    base = _peak_rss_bytes()
    for _ in range(2):
        train_step(seq, x1, x2, optimizer, config)
    return _peak_rss_bytes() - base


if __name__ == "__main__":
    print(_cpu_peak_in_this_process(TrainStepConfig(**json.loads(sys.argv[1]))))
