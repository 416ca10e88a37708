"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over reversible runs: two gloo processes on CPU
give the grads of one process, with every engine, for blocks sharded one by one (each block, or F
and G inside generic blocks, or every stage of a RevNet-like model whose non-reversible stages are
recomputed; RevNet-18 itself in a slow test), with ``reshard_after_forward`` True and False, and
for a run sharded as one unit. One spawn runs every CI case (each spawn costs seconds); the parent
compares each case's grads with plain autograd in one process.

Also checked inside the spawn: a forward saves only the run's outputs for the backward; the
parameters are half per rank; in the backward, when block i
is rebuilt, its parameters are the only unsharded ones allocated (the blocks after it are
resharded, their grads reduce-scattered: per block, as FSDP does for ordinary modules); with
``reshard_after_forward=False`` the forward leaves them unsharded. A mixed-precision policy (bf16
parameters, fp32 reduce; fp32 streams under bf16 autocast) gives fp32 grads as accurate as the
autograd engine under the same policy. Through dropout, ``backward(retain_graph=True)`` then
``backward()`` gives twice the grads of one backward, as plain autograd does (the block nodes keep
each block's generator states for the second rebuild).
"""
import dataclasses
import datetime
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import revkernels as rk
from revkernels.check import monitor_reconstruction
from revkernels.engine import budget as budget_module
from revkernels.engine.recompute import run_recomputed
from revkernels.models.staged import StagedModel
from tests.helpers import assert_close_rel, loss_of, make_seq, residual_fn

fsdp = pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402 (after the FSDP check)

WIDTH, DEPTH, TOKENS, BATCH, STEPS = 16, 3, 4, 4, 2
# The streams stay fp32 (no input cast; F and G compute in bf16 under autocast): bf16 streams would
# rebuild each block only to bf16 precision (docs/numerics.md), which is not FSDP's doing.
BF16 = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)

# name: (model, what fully_shard wraps before the model, reshard_after_forward, engine, mixed precision)
CASES = {
    "generic-block-raf": ("generic", "block", True, "sequential", False),
    "generic-block-keep": ("generic", "block", False, "sequential", False),
    "generic-fg-raf": ("generic", "fg", True, "sequential", False),
    "generic-run": ("generic", "none", True, "sequential", False),  # the run as one unit
    "vit-block-late": ("vit", "block", True, "sequential", False),  # a step before fully_shard
    "vit-block-nosync": ("vit", "block", True, "sequential", False),  # grads accumulated unsharded, then synced
    "context-block-raf": ("context", "block", True, "sequential", False),  # seq(x1, x2, cond=c), c requires grad
    "vit-block-raf": ("vit", "block", True, "sequential", False),
    "vit-block-keep": ("vit", "block", False, "sequential", False),
    "staged-stage-raf": ("staged", "block", True, "sequential", False),
    "generic-block-autograd": ("generic", "block", True, "autograd", False),
    "generic-block-pareprop": ("generic", "block", True, "pareprop", False),
    "generic-block-graphs": ("generic", "block", False, "graphs", False),
    "generic-block-compiled": ("generic", "block", True, "compiled-dynamo", False),
    "mlp-block-bf16": ("mlp", "block", True, "sequential", True),
    "mlp-block-bf16-autograd": ("mlp", "block", True, "autograd", True),
    "generic-block-y1": ("generic", "block", True, "sequential", False),  # a loss of y1 only: G's of the last block get no grad
    "dropout-block-retain": ("dropout", "block", True, "sequential", False),  # backward(retain_graph=True) twice
    "exact-block-raf": ("exact", "block", True, "sequential", False),  # exact mode: int64 streams node to node
    "exact-fg-keep": ("exact", "fg", False, "sequential", False),
    "budget-block-raf": ("budget", "block", True, "sequential", False),  # memory_budget=0.5: kept and rebuilt blocks
    # each rank its own one-rank FSDP mesh (a replica: not in step with the other): its own plan
    "budget-replicas-raf": ("budget", "replicas", True, "sequential", False),
    "dropout-block-switch": ("dropout", "block", True, "sequential", False),  # eval() or new rates before backward
}
SLOW_CASES = {"revnet18-stage-raf": ("revnet18", "block", True, "sequential", False),
              "vit-block-inductor": ("vit", "block", True, "compiled", False)}


class _Split(nn.Module):
    """x -> two streams (a stem)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(WIDTH, 2 * WIDTH)

    def forward(self, x):
        x1, x2 = self.proj(x).chunk(2, dim=-1)
        return x1, x2


class _Mix(nn.Module):
    """A non-reversible two-stream stage (a downsampling stage's shape)."""

    def __init__(self):
        super().__init__()
        self.f = residual_fn(WIDTH)

    def forward(self, x1, x2):
        return torch.tanh(x2), x1 + self.f(x2)


def _mlp():
    """F or G without a LayerNorm (CPU LayerNorm takes no bf16 weights with an fp32 input)."""
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))


class _Film(nn.Module):
    """F or G scaled by a context tensor: ``fn(x) * (1 + cond)``."""

    def __init__(self):
        super().__init__()
        self.fn = residual_fn(WIDTH)

    def forward(self, x, cond=None):
        return self.fn(x) * (1 + cond)


class _Staged(StagedModel, nn.Module):
    """RevNet in miniature: stem, run of half blocks, non-reversible stage, run, head; the stem and
    the non-reversible stage recomputed, as RevNet's are."""

    def __init__(self, engine):
        super().__init__()
        runs = [rk.nn.ReversibleSequential(*(rk.nn.HalfCouplingBlock(residual_fn(WIDTH)) for _ in range(2)),
                                           engine=engine) for _ in range(2)]
        self.segments = nn.ModuleList([_Split(), runs[0], _Mix(), runs[1], nn.Linear(2 * WIDTH, 10)])
        self._engine = engine

    def forward(self, x):
        stem, run1, mix, run2, head = self.segments
        out = run2(*run_recomputed(mix, *run1(*run_recomputed(stem, x))))
        return head(torch.cat(out, dim=-1))


def _model(kind, engine="autograd"):
    """The case's model; engine "compiled-dynamo": the compiled engine with Dynamo's eager backend
    (the steps traced as for inductor, in seconds instead of a minute)."""
    if kind == "staged":
        return _Staged(engine)
    if kind in ("generic", "mlp", "vit", "context", "dropout", "exact", "budget"):
        blocks = {"generic": lambda: make_seq(DEPTH, WIDTH).blocks, "exact": lambda: make_seq(DEPTH, WIDTH).blocks,
                  "budget": lambda: make_seq(DEPTH, WIDTH).blocks,
                  "mlp": lambda: [rk.nn.ReversibleBlock(_mlp(), _mlp()) for _ in range(DEPTH)],
                  "dropout": lambda: [rk.nn.ReversibleBlock(nn.Sequential(_mlp(), nn.Dropout(0.5)),
                                                            nn.Sequential(_mlp(), nn.Dropout(0.5))) for _ in range(DEPTH)],
                  "vit": lambda: [rk.nn.RevViTBlock(WIDTH, 2, mlp_ratio=2.0) for _ in range(2)],
                  "context": lambda: [rk.nn.ReversibleBlock(_Film(), _Film()) for _ in range(2)]}[kind]()
        # (the references: exact autograd; plain autograd, which has no budget)
        seq = rk.nn.ReversibleSequential(*blocks, exact=kind == "exact", memory_budget=0.5 if kind == "budget" else 0)
        seq.engine = engine.removesuffix("-dynamo")
        if engine.endswith("-dynamo"):
            seq.compile_options = {"backend": "eager"}
        return seq
    # eval: BatchNorm uses its running statistics, so a rank's grads do not depend on the other's batch
    return rk.models.revnet18(num_classes=10, stem="cifar", engine=engine).eval()


def _batch(kind):
    if kind == "revnet18":
        return torch.randn(BATCH, 3, 8, 8), torch.randn(BATCH, 10)
    if kind == "staged":
        return torch.randn(BATCH, WIDTH), torch.randn(BATCH, 10)
    shape = (BATCH, TOKENS, WIDTH) if kind == "vit" else (BATCH, WIDTH)
    return tuple(torch.randn(shape) for _ in range(5 if kind == "context" else 4))


def _loss(model, kind, batch, y1_only=False):
    """The rank's mean loss (FSDP's reduce-scatter averages the ranks' grads; `y1_only`: of the
    output y1 alone) and the input (or context tensor) whose grad is checked (None: none requires
    grad)."""
    if kind in ("revnet18", "staged"):
        x, w = batch
        return (model(x) * w).sum() / x.shape[0], None
    x1, x2, w1, w2, *cond = batch
    leaf = (cond[0] if cond else x1).detach().requires_grad_()  # FSDP hooks the grad-requiring inputs
    y1, y2 = model(x1, x2, cond=leaf) if cond else model(leaf, x2)
    return (y1 * w1).sum() / x1.shape[0] if y1_only else loss_of(y1, y2, w1, w2) / x1.shape[0], leaf


def _shard(model, kind, units, raf, mixed):
    options = dict(reshard_after_forward=raf, mp_policy=BF16 if mixed else fsdp.MixedPrecisionPolicy())
    if units == "replicas":
        options["mesh"] = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))["shard"]
    for block in (model.stages if kind in ("revnet18", "staged") else model.blocks if units != "none" else []):
        if units == "fg":
            fsdp.fully_shard(block.f, **options)
            fsdp.fully_shard(block.g, **options)
        else:
            fsdp.fully_shard(block, **options)
    fsdp.fully_shard(model, mp_policy=options["mp_policy"], mesh=options.get("mesh"))


def _is_sharded(block):
    return all(isinstance(p, torch.distributed.tensor.DTensor) for p in block.parameters())


def _watch_backward(model, observed):
    """Records, at each block's rebuild in the first step's backward, which blocks' unsharded
    parameters are allocated and which blocks already have (reduce-scattered) grads."""
    blocks = list(model.blocks)
    unsharded = [None] * len(blocks)  # each block's unsharded parameter tensors, seen in its rebuild

    def watch(i, recompute):
        def rebuild(*args, **kwargs):
            unsharded[i] = [p for p in blocks[i].parameters() if not isinstance(p, torch.distributed.tensor.DTensor)]
            allocated = [j for j, ps in enumerate(unsharded) if ps and all(p.untyped_storage().size() for p in ps)]
            with_grads = [j for j, b in enumerate(blocks) if _is_sharded(b) and all(p.grad is not None for p in b.parameters())]
            observed.append((i, allocated, with_grads, [j for j, b in enumerate(blocks) if not _is_sharded(b)]))
            return recompute(*args, **kwargs)
        return rebuild

    for i, block in enumerate(blocks):
        block.recompute = watch(i, block.recompute)


def _once_and_twice(model, kind, batch):
    """The parameter grads of a loss through dropout backwarded once, then twice (the first with
    ``retain_graph=True``), each from the same generator state."""
    grads = []
    for twice in (False, True):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss, _ = _loss(model, kind, batch)
        if twice:
            loss.backward(retain_graph=True)
        loss.backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
    return {"once": grads[0], "twice": grads[1]}


def _switched(model, kind, batch):
    """The parameter grads of a loss through dropout, from the same generator state: as is, with
    ``model.eval()`` between its forward and backward, and with every dropout rate changed then."""
    layers = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    switches = {"none": (lambda: None, lambda: None), "eval": (model.eval, model.train),
                "rates": (lambda: [setattr(m, "p", 0.2) for m in layers], lambda: [setattr(m, "p", 0.5) for m in layers])}
    grads = {}
    for name, (switch, undo) in switches.items():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss, _ = _loss(model, kind, batch)
        switch()
        loss.backward()
        undo()
        grads[name] = [p.grad.full_tensor() for p in model.parameters()]
    return grads


def _run_case(name, case, data, shard):
    """One case's training steps on this rank; what the parent checks."""
    kind, units, raf, engine, mixed = case
    model = _model(kind, engine)
    model.load_state_dict(data["state"])
    if name.endswith(("-retain", "-switch")):
        _shard(model, kind, units, raf, mixed)
        run = _once_and_twice if name.endswith("-retain") else _switched
        return run(model, kind, tuple(t[shard] for t in data["batches"][0]))
    if name.endswith("-late"):  # the structure cache is built before sharding
        _loss(model, kind, tuple(t[shard] for t in data["batches"][0]))[0].backward()
        model.zero_grad(set_to_none=True)
    _shard(model, kind, units, raf, mixed)
    if kind == "budget" and dist.get_rank() == 1:  # rank 1 measures its blocks free to rebuild: its own plan
        measure = budget_module.activation_bytes  # would rebuild them all, rank 0's does not

        def free(*args):
            return [dataclasses.replace(c, forward_ms=0.0, recompute_ms=0.0) for c in measure(*args)]
        budget_module.activation_bytes = free
    observed, after_forward = [], None
    if name == "generic-block-raf":
        _watch_backward(model, observed)
    monitor = monitor_reconstruction(model) if name in ("generic-block-keep", "exact-fg-keep") else None
    for step, batch in enumerate(data["batches"]):
        if name.endswith("-nosync"):
            model.set_requires_gradient_sync(step == len(data["batches"]) - 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss, leaf = _loss(model, kind, tuple(t[shard] for t in batch), name.endswith("-y1"))
        if step == 0 and units == "block" and kind in ("generic", "vit"):
            after_forward = [_is_sharded(b) for b in model.blocks]
        loss.backward()
        if observed and step == 0:
            for block in model.blocks:  # the watch is for the first step only
                del block.recompute
    params = list(model.parameters())
    result = {
        # the last step's input grad, scaled from the rank's mean loss to the whole batch's
        "input_grad": None if leaf is None else leaf.grad * (shard.stop - shard.start) / BATCH,
        "grads": [None if p.grad is None else p.grad.full_tensor() for p in params],
        "grad_dtypes": {p.grad.dtype for p in params if p.grad is not None},
        "local": sum(p.to_local().numel() for p in params), "total": sum(p.numel() for p in params),
        "resharded": all(isinstance(p, torch.distributed.tensor.DTensor) for p in params),
        "after_forward": after_forward, "observed": observed,
        "monitored": None if monitor is None else monitor.errors,
    }
    if kind == "budget":  # every rank's plan (the ranks plan from rank 0's measurement)
        result["plans"] = [None] * dist.get_world_size()
        dist.all_gather_object(result["plans"], model.memory_plan(*(t[shard] for t in data["batches"][0][:2])).options)
    if name == "exact-block-raf":  # a forward without grad hands its int64 outputs on, as a node does
        streams = model.fixed_point_streams(torch.float32)
        model.hand_streams(streams)
        with torch.no_grad():
            y1, _ = model(*(t[shard] for t in data["batches"][0][:2]))
        result["plain_outputs"] = streams.outputs is not None and torch.equal(streams.view(streams.outputs[0]), y1)
    if name in ("generic-block-raf", "vit-block-keep", "exact-block-raf"):  # what a forward saves for the backward
        x1, x2 = (t[shard].detach().requires_grad_() for t in data["batches"][0][:2])
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            y1, y2 = model(x1, x2)
        (y1.sum() + y2.sum()).backward()  # completes FSDP's iteration (the grads were read above)
        result["saved"], result["outputs"] = sum(saved), y1.numel() + y2.numel()
    return result


def _worker(rank, world, cases, data_file, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a lost peer fails, never hangs
    done = False
    try:
        torch.set_num_threads(1)
        data, out = torch.load(data_file), {}
        shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        for name, case in cases.items():
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always", UserWarning)
                out[name] = _run_case(name, case, data[name], shard)
            out[name]["warnings"] = [str(w.message) for w in warned if str(w.message).startswith("revkernels")]
        if rank == 0:
            torch.save(out, out_file)
        dist.barrier()  # neither rank tears gloo down while the other may still be talking to it
        done = True
    finally:
        dist.destroy_process_group()
    if done:
        # Skip the interpreter's teardown: destroying FSDP's leftover gloo state at exit sometimes
        # aborts ("terminate called without an active exception") after all the work is done.
        os._exit(0)


def _two_ranks(tmp, cases):
    """(data, results): `cases` run by two gloo processes in one spawn."""
    data = {name: {"state": _model(kind).state_dict(), "batches": [_batch(kind) for _ in range(STEPS)]}
            for name, (kind, *_rest) in cases.items()}
    torch.save(data, tmp / "data.pt")
    mp.spawn(_worker, args=(2, cases, str(tmp / "data.pt"), str(tmp / "init"), str(tmp / "out.pt")), nprocs=2,
             join=True)
    return data, torch.load(tmp / "out.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _two_ranks(tmp_path_factory.mktemp("fsdp"), CASES)


def _one_process_grads(kind, data, y1_only=False):
    """The parameter grads after the steps and the last step's input grad, in one process."""
    model = _model(kind)
    model.load_state_dict(data["state"])
    for batch in data["batches"]:
        loss, leaf = _loss(model, kind, batch, y1_only)
        loss.backward()
    return [p.grad for p in model.parameters()], leaf


def _check_case(name, case, data, result):
    grads, leaf = _one_process_grads(case[0], data, name.endswith("-y1"))
    assert [g is None for g in result["grads"]] == [g is None for g in grads], f"{name}: which params have grads"
    for i, (g, ref) in enumerate(zip(result["grads"], grads, strict=True)):
        if ref is not None:
            assert_close_rel(g, ref, 1e-5, f"{name}: FSDP2 grad of param {i}")
    if leaf is not None:  # rank 0's input grad: its half of the batch
        assert_close_rel(result["input_grad"], leaf.grad[:BATCH // 2], 1e-5, f"{name}: input grad")
    # Each rank keeps half the parameters (dim-0 shards; every dim here is even) and, after the
    # step, only its shards: nothing is left unsharded.
    assert result["local"] * 2 == result["total"], name
    assert result["resharded"], name
    assert not result["warnings"], (name, result["warnings"])  # e.g. a compiled step fallen back to eager
    if "saved" in result:  # only the run's outputs: activation memory O(1) in depth
        assert result["saved"] == result["outputs"], (name, result["saved"], result["outputs"])
    if result["monitored"] is not None:  # the reconstruction monitor sees every block's rebuild
        assert len(result["monitored"]) == DEPTH and max(result["monitored"]) < 1e-5, result["monitored"]
        if case[0] == "exact":  # every block input rebuilt bit for bit
            assert result["monitored"] == [0.0] * DEPTH, result["monitored"]
    if "plain_outputs" in result:
        assert result["plain_outputs"], name
    if "plans" in result:
        plans = result["plans"]
        assert plans[0] == plans[1] and "rebuild" in plans[0] and set(plans[0]) != {"rebuild"}, plans
    if result["after_forward"] is not None:
        raf = case[2]
        assert result["after_forward"] == [raf] * len(result["after_forward"]), f"{name}: sharded after forward"


@pytest.mark.parametrize("name", [n for n, case in CASES.items()
                                  if not case[4] and not n.endswith(("-retain", "-switch", "-replicas-raf"))])
def test_two_gloo_processes_match_one_process(two_ranks, name):
    data, results = two_ranks
    _check_case(name, CASES[name], data[name], results[name])


@pytest.mark.slow
def test_revnet18_and_inductor_compiled_steps(tmp_path):
    data, results = _two_ranks(tmp_path, SLOW_CASES)
    for name, case in SLOW_CASES.items():
        _check_case(name, case, data[name], results[name])


def test_ranks_not_in_one_fsdp_mesh_plan_each_for_itself(two_ranks):
    """Each rank shards over a one-rank mesh of its own (replicas): nothing runs in step between
    them, so rank 1 keeps its own plan (every block rebuilt: its measurement saw no time to save);
    a plan broadcast over the default group gave it rank 0's, and would hang ranks that run other
    models (pipeline stages)."""
    plans = two_ranks[1]["budget-replicas-raf"]["plans"]
    assert plans[1] == ("rebuild",) * DEPTH and plans[0] != plans[1], plans


def test_second_backward_with_retain_graph_replays_the_same_dropout(two_ranks):
    """Plain autograd's second backward reuses the forward's dropout masks, so the grads of two
    backwards are twice those of one; a block node that drew fresh masks (or none) in its second
    rebuild would give others."""
    result = two_ranks[1]["dropout-block-retain"]
    for i, (once, twice) in enumerate(zip(result["once"], result["twice"], strict=True)):
        assert_close_rel(twice, 2 * once, 1e-5, f"param {i}")


def test_a_switch_between_forward_and_backward_rebuilds_the_blocks_as_the_forward_ran(two_ranks):
    """model.eval() or new dropout rates between a forward and its backward: each block node
    rebuilds its block in the forward's modes and rates, so the grads are those without the switch
    (a rebuild without dropout, or with other rates, draws other masks)."""
    result = two_ranks[1]["dropout-block-switch"]
    for switch in ("eval", "rates"):
        for i, (got, want) in enumerate(zip(result[switch], result["none"], strict=True)):
            assert_close_rel(got, want, 1e-5, f"{switch}: param {i}")


def test_backward_unshards_one_block_at_a_time(two_ranks):
    observed = two_ranks[1]["generic-block-raf"]["observed"]
    assert [i for i, *_ in observed] == list(reversed(range(DEPTH)))
    for i, allocated, with_grads, unsharded in observed:
        # Block i was all-gathered again for its rebuild (the forward resharded it); the blocks
        # after it are resharded with their grads reduce-scattered; no other block's parameters
        # are allocated (FSDP's prefetch of block i-1 is its all-gather buffer, not yet these).
        assert allocated == [i] and unsharded == [i], (i, allocated, unsharded)
        assert with_grads == list(range(i + 1, DEPTH)), (i, with_grads)


def test_mixed_precision_policy(two_ranks):
    """bf16 parameters and compute, fp32 reduce: the grads are fp32, and their error against fp32
    in one process is at most twice the autograd engine's under the same policy.

    The error is ||grads - reference|| / ||reference|| over all grads: a max-abs error of bf16
    grads is set by the few elements whose bf16 rounding flips (the rebuild differs from the
    forward's input by fp32 rounding, enough to flip a bf16 cast now and then), so the ratio of two
    such maxima spread from 0.6x to 4x over seeds while the norms' ratio stays near 1."""
    data, results = two_ranks
    errors = {}
    for name in ("mlp-block-bf16", "mlp-block-bf16-autograd"):
        assert results[name]["grad_dtypes"] == {torch.float32}
        reference = _one_process_grads(CASES[name][0], data[name])[0]
        actual, expected = (torch.cat([g.reshape(-1).double() for g in grads])
                            for grads in (results[name]["grads"], reference))
        errors[name] = ((actual - expected).norm() / expected.norm()).item()
    assert 0 < errors["mlp-block-bf16"] <= 2 * errors["mlp-block-bf16-autograd"], errors
