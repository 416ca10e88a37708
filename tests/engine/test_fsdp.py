"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over reversible runs: two gloo processes on CPU
give the grads of one process.

With a memory-saving engine the whole `ReversibleSequential` must be one FSDP unit
(``fully_shard(seq)``): the engine calls its blocks' forward_with_state/recompute/grads, not the
block modules, so FSDP's per-module unshard hooks would not run for blocks sharded on their own
(their parameters stay sharded DTensors: "got mixed torch.Tensor and DTensor"). The autograd
engine calls the blocks as modules, so each block can be its own unit there.
"""
import datetime
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import assert_close_rel, loss_of, make_seq

WIDTH, BATCH, STEPS = 16, 8, 2

fsdp = pytest.importorskip("torch.distributed.fsdp")


def _mean_loss(seq, x1, x2, w1, w2):
    y1, y2 = seq(x1, x2)
    return loss_of(y1, y2, w1, w2) / x1.shape[0]


def _worker(rank, world, engine, per_block, init_file, data_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a lost peer fails, never hangs
    done = False
    try:
        torch.set_num_threads(1)
        warnings.simplefilter("ignore", UserWarning)
        data = torch.load(data_file)
        seq = make_seq(3, WIDTH, engine=engine)
        seq.load_state_dict(data["state"])
        if per_block:
            for block in seq.blocks:
                fsdp.fully_shard(block)
        fsdp.fully_shard(seq)
        shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        for step in range(STEPS):
            x1, x2, w1, w2 = (t[shard] for t in data["batches"][step])
            _mean_loss(seq, x1, x2, w1, w2).backward()  # reduce-scatter averages the ranks' grads
        grads = [p.grad.full_tensor() for p in seq.parameters()]
        if rank == 0:
            torch.save(grads, out_file)
        dist.barrier()  # neither rank tears gloo down while the other may still be talking to it
        del seq, grads
        done = True
    finally:
        dist.destroy_process_group()
    if done:
        # Skip the interpreter's teardown: destroying FSDP's leftover gloo state at exit sometimes
        # aborts ("terminate called without an active exception") after all the work is done.
        os._exit(0)


@pytest.mark.parametrize("engine,per_block", [
    ("sequential", False),  # one FSDP unit for the whole run: what the memory-saving engines need
    pytest.param("pareprop", False, marks=pytest.mark.slow),
    pytest.param("autograd", True, marks=pytest.mark.slow),  # autograd: blocks may be their own units
])
def test_fsdp2_two_gloo_processes_match_one_process(tmp_path, engine, per_block):
    seq = make_seq(3, WIDTH)
    batches = [tuple(torch.randn(BATCH, WIDTH) for _ in range(4)) for _ in range(STEPS)]
    torch.save({"state": seq.state_dict(), "batches": batches}, tmp_path / "data.pt")
    paths = [str(tmp_path / name) for name in ("init", "data.pt", "grads.pt")]
    mp.spawn(_worker, args=(2, engine, per_block, *paths), nprocs=2, join=True)
    fsdp_grads = torch.load(tmp_path / "grads.pt")
    for x1, x2, w1, w2 in batches:
        _mean_loss(seq, x1, x2, w1, w2).backward()
    for i, (p, g) in enumerate(zip(seq.parameters(), fsdp_grads)):
        assert_close_rel(g, p.grad, 1e-5, f"FSDP2 grad of param {i}")
