"""DDP over the sequential engine: two gloo processes give the grads of one process."""
import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from tests.helpers import assert_close_rel, loss_of, make_seq

WIDTH, BATCH, STEPS = 16, 8, 2


def _mean_loss(seq, x1, x2, w1, w2):
    y1, y2 = seq(x1, x2)
    return loss_of(y1, y2, w1, w2) / x1.shape[0]


def _worker(rank, world, init_file, data_file, out_file):
    # A bounded timeout: a lost peer fails the test instead of hanging it.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        data = torch.load(data_file)
        seq = make_seq(3, WIDTH)
        seq.load_state_dict(data["state"])
        ddp = DistributedDataParallel(seq)
        shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        for step in range(STEPS):  # two backward calls: grads accumulate across steps as usual
            x1, x2, w1, w2 = (t[shard] for t in data["batches"][step])
            _mean_loss(ddp, x1, x2, w1, w2).backward()  # DDP averages the ranks' grads
        if rank == 0:
            torch.save([p.grad for p in seq.parameters()], out_file)
        dist.barrier()  # both ranks are done with gloo
    except BaseException:
        dist.destroy_process_group()
        raise
    # Exit without tearing gloo down: its shutdown once left a rank waiting forever after all the
    # work was done (the test hung CI); the process's exit frees everything.
    os._exit(0)


def test_ddp_two_gloo_processes_match_one_process(tmp_path):
    seq = make_seq(3, WIDTH)
    batches = [tuple(torch.randn(BATCH, WIDTH) for _ in range(4)) for _ in range(STEPS)]
    torch.save({"state": seq.state_dict(), "batches": batches}, tmp_path / "data.pt")
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "data.pt"), str(tmp_path / "grads.pt")),
             nprocs=2, join=True)
    ddp_grads = torch.load(tmp_path / "grads.pt")

    for x1, x2, w1, w2 in batches:
        _mean_loss(seq, x1, x2, w1, w2).backward()
    for i, (p, g) in enumerate(zip(seq.parameters(), ddp_grads)):
        assert_close_rel(g, p.grad, 1e-5, f"DDP grad of param {i}")
