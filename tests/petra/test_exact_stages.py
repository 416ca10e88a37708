"""Exact PETRA stages (`partition(..., exact=True)`): int64 fixed-point streams between reversible
stages, rebuilt bit for bit; grads equal to the exact autograd engine run as a whole network;
dropout replayed; overflow and dtype errors; `ReversibleSequential.reverse` on int64 streams."""
import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from revkernels.models import revnet18
from revkernels.nn import HalfCouplingBlock, ReversibleBlock, ReversibleSequential
from revkernels.nn.exact import FixedPointStreams, run_exact_autograd
from revkernels.ops.fixed_point import fixed_point_view
from revkernels.engine.sequential import exact_forward
from revkernels.petra import Trainer, partition
from revkernels.petra.distributed import RANK_STATE_KIND, PipelineRank, boundary_specs, init, launch
from tests.helpers import assert_close_rel
from tests.petra.test_distributed import assert_ranks_hold_the_simulators_parameters
from tests.petra.test_simulate import Mix, Split, TwoStreamHead, synthetic_stages
from tests.petra.test_simulate import _batches as simulate_batches

WIDTH, D_IN, CLASSES = 6, 8, 3
# A coarse grid for the gradient tests: there the exact network differs from the float one by far
# more than the tolerance (tanh' at values rounded to 2^-8), so a float step in place of an exact
# one fails them
BITS = 8


def _branch(dropout=0.0):
    layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh()] + ([nn.Dropout(dropout)] if dropout else [])
    return nn.Sequential(*layers)


class Down(Mix):
    """Mix without the bias its BatchNorm cancels (whose true grad is 0: fp32 noise, no relative
    comparison)."""

    def __init__(self, width):
        super().__init__(width)
        self.b = nn.Linear(width, width, bias=False)


def _stages(depth, dropout=0.0):
    """Stem, `depth` reversible stages (full and half couplings alternating), a non-reversible
    "down" stage with a BatchNorm, `depth` more reversible stages, the head; random parameters."""
    def rev(i):
        return ReversibleBlock(_branch(dropout), _branch(dropout)) if i % 2 else HalfCouplingBlock(_branch(dropout))

    return nn.ModuleList([Split(D_IN, WIDTH), *[rev(i) for i in range(depth)], Down(WIDTH),
                          *[rev(i) for i in range(depth)], TwoStreamHead(CLASSES, WIDTH)])


def _batches(n, batch=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, D_IN, generator=g), torch.randint(0, CLASSES, (batch,), generator=g))
            for _ in range(n)]


def _rebuild_errors(stages, batches):
    """Runs the forwards of every batch through `stages`, then their backwards (oldest first, each
    stage receiving its successor's returned input as its output, as in the pipeline); returns per
    reversible stage the inputs its forwards got and those its backwards returned."""
    seen = {s.index: [] for s in stages if s.reversible}
    head_inputs = []
    for images, _ in batches:
        x = images
        for s in stages[:-1]:
            if s.reversible:
                seen[s.index].append(tuple(t.clone() for t in x))
            x = s.forward(x)
        head_inputs.append(x)
    rebuilt = {i: [] for i in seen}
    for x, (_, labels) in zip(head_inputs, batches):
        _, _, x, dx = stages[-1].forward_backward(x, labels)
        for s in reversed(stages[:-1]):
            x, dx = s.backward(x, dx)
            if s.reversible:
                rebuilt[s.index].append(x)
    return seen, rebuilt


def test_exact_stages_rebuild_their_inputs_bit_for_bit_where_float_stages_drift():
    """Parameters unchanged (no optimizer step): every reversible stage's backward returns its
    forward's input, bit for bit on the int64 streams, over 3 batches in flight at once and 16
    reversible stages; the same stages with float streams drift (the contrast)."""
    torch.manual_seed(0)
    model = _stages(8)
    batches = _batches(3)
    seen, rebuilt = _rebuild_errors(partition(copy.deepcopy(model), exact=True), batches)
    for i in seen:
        for b, (x, r) in enumerate(zip(seen[i], rebuilt[i])):
            if i == 1 or i == 10:  # fed floats by the stem / the down stage: on the grid, in their dtype
                assert all(t.dtype == torch.float32 for t in (*x, *r)), f"stage {i}"
            else:
                assert all(t.dtype == torch.int64 for t in (*x, *r)), f"stage {i}"
            for a, e in zip(r, x):
                if a.dtype == torch.int64:
                    assert torch.equal(a, e), f"stage {i} batch {b}: rebuilt input differs"
                else:  # the float input on the grid (2^-32): within one fp32 rounding of it
                    assert_close_rel(a, e, 1e-6, f"stage {i} batch {b}")
    seen, rebuilt = _rebuild_errors(partition(copy.deepcopy(model), exact=False), batches)
    drift = max((a - e).abs().max().item() for i in seen for x, r in zip(seen[i], rebuilt[i]) for a, e in zip(r, x))
    assert drift > 0


def _reference_grads(model, batches, exact=True):
    """The exact autograd engine over the whole network: stem, each run of reversible stages as one
    ``ReversibleSequential(exact=True, engine="autograd")``, the non-reversible stages; the grads
    summed over the batches. ``exact=False``: plain autograd through the stage modules."""
    model = copy.deepcopy(model)
    segments, run = [], []
    for m in model if exact else ():
        if isinstance(m, ReversibleBlock):
            run.append(m)
            continue
        if run:
            segments.append(ReversibleSequential(*run, engine="autograd", exact=True))
            segments[-1].exact_bits = BITS
            run = []
        segments.append(m)
    for images, labels in batches:
        x = images
        for m in segments if exact else model:
            x = m(*(x if isinstance(x, tuple) else (x,)))
        F.cross_entropy(x, labels).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("method, groups", [("petra", 1), ("petra", None), ("delayed", 3)])
def test_exact_pipeline_grads_equal_the_exact_autograd_engine(method, groups):
    """accum_k larger than the batches: no optimizer step, so every backward sees the forward's
    parameters and the accumulated grads are end-to-end grads of exact mode (groups=1: one worker,
    no delay; None: one worker per stage, int64 messages between them; the delayed baseline's
    stages recompute at their stored int64 inputs)."""
    torch.manual_seed(0)
    model = _stages(2)
    batches = _batches(3)
    expected = _reference_grads(model, batches)
    trainer = Trainer(model, method, accum_k=10, groups=groups, exact=True, exact_bits=BITS)
    assert [s.exact for s in trainer.stages] == [s.reversible for s in trainer.stages]
    for images, labels in batches:
        trainer.train_step(images, labels)
    trainer.flush()
    for (name, p), e in zip(model.named_parameters(), expected):
        assert_close_rel(p.grad, e, 1e-5, name)


def test_revnet_built_exact_gets_exact_stages_and_the_models_gradient():
    """A RevNet built with exact=True: partition's default takes its runs' setting; one batch
    through the pipeline gives the grads of the model itself on the exact autograd engine."""
    torch.manual_seed(0)
    model = revnet18(num_classes=10, stem="cifar", exact=True)
    for run in model.runs:
        run.exact_bits = BITS  # (partition takes the runs' bits)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 10, (2,), generator=g)
    reference = copy.deepcopy(model).set_engine("autograd")
    F.cross_entropy(reference(x), y).backward()
    trainer = Trainer(model, "petra", accum_k=2)
    assert trainer.exact and all(s.exact and s.exact_bits == BITS for s in trainer.stages if s.reversible)
    trainer.train_step(x, y)
    trainer.flush()
    assert not partition(revnet18(num_classes=10, stem="cifar"))[1].exact
    for (name, p), (_, e) in zip(model.named_parameters(), reference.named_parameters()):
        assert_close_rel(p.grad, e.grad, 1e-5, name)


def _stream_start(stage):
    """Sets the CPU generator where the stage's own stream stands (its forward draws from there)."""
    state = stage._stream.state
    return (lambda: torch.manual_seed(stage._stream.seed)) if state is None else state.restore


def _exact_reference(block, x, dy, start):
    """The exact autograd engine through a copy of `block` from the generator state `start()` sets,
    on float streams (rounded onto the grid) or int64 ones (their views differentiated): the int64
    output, the input grads, the parameter grads."""
    block = copy.deepcopy(block)
    streams = FixedPointStreams(BITS, torch.float32)
    fixed = x if x[0].dtype == torch.int64 else None
    leaves = tuple((t if fixed is None else streams.view(t)).clone().requires_grad_() for t in x)
    start()
    out = run_exact_autograd([block], *leaves, {}, streams, fixed)
    torch.autograd.backward(out, dy)
    return out, [t.grad for t in leaves], [p.grad for p in block.parameters()]


@pytest.mark.parametrize("delayed", [False, True])
def test_dropout_stages_replay_their_draws_exactly(delayed):
    """Reversible stages with dropout, fed floats (stage 1) and int64 streams (stage 2), two batches
    in flight with other draws in between: the forward draws what the exact autograd engine draws
    from the stage's stream, the backward (rebuild; delayed: recompute at the stored input) returns
    the input bit for bit and the engine's grads."""
    torch.manual_seed(0)
    model = [Split(D_IN, WIDTH), ReversibleBlock(_branch(0.3), _branch(0.5)), HalfCouplingBlock(_branch(0.4)),
             TwoStreamHead(CLASSES, WIDTH)]
    stages = partition(model, exact=True, delayed=delayed, exact_bits=BITS)
    g = torch.Generator().manual_seed(5)
    inputs = {1: [tuple(torch.randn(4, WIDTH, generator=g) for _ in range(2)) for _ in range(2)]}
    inputs[2] = [tuple(torch.randint(-2 ** 10, 2 ** 10, (4, WIDTH), generator=g) for _ in range(2)) for _ in range(2)]
    for i in (1, 2):
        stage, outputs, starts = stages[i], [], []
        for x in inputs[i]:
            starts.append(_stream_start(stage))
            outputs.append(stage.forward(x))
            torch.randn(7)  # other stages draw in between
        for x, y, start in zip(inputs[i], outputs, starts):
            dy = tuple(torch.randn(t.shape, generator=g) for t in y)
            ref_out, ref_dx, ref_grads = _exact_reference(stage.module, x, dy, start)
            assert all(torch.equal(fixed_point_view(a, BITS), b) for a, b in zip(y, ref_out)), f"stage {i}: forward"
            stage.module.zero_grad(set_to_none=True)
            x_back, dx = stage.backward(y, dy)
            # (fed floats, a rebuild returns them on the grid; the delayed stage its stored input)
            on_grid = x if i == 2 or delayed else tuple(FixedPointStreams(BITS, torch.float32).enter(t)[0] for t in x)
            assert all(torch.equal(a, b) for a, b in zip(x_back, on_grid, strict=True)), f"stage {i}: rebuilt input"
            for a, b in zip(dx, ref_dx, strict=True):
                assert_close_rel(a, b, 1e-5, f"stage {i}: input grad")
            for (name, p), b in zip(stage.module.named_parameters(), ref_grads, strict=True):
                assert_close_rel(p.grad, b, 1e-5, f"stage {i}: grad of {name}")


def test_exact_stage_overflow_names_the_stage():
    torch.manual_seed(0)
    stages = partition(_stages(2), exact=True)
    with pytest.raises(OverflowError, match=r"input of stage 1 \(HalfCouplingBlock\)"):
        stages[1].forward((torch.full((2, WIDTH), 2.0 ** 40), torch.zeros(2, WIDTH)))

    class Blowup(nn.Module):
        def forward(self, x):
            return x * 2.0 ** 40

    stages = partition([Split(D_IN, WIDTH), HalfCouplingBlock(Blowup()), TwoStreamHead(CLASSES, WIDTH)], exact=True)
    with pytest.raises(OverflowError, match=r"exact mode: stage 1 \(HalfCouplingBlock\) made a value"):
        stages[1].forward(stages[0].forward(torch.randn(2, D_IN)))


def test_exact_stage_and_reverse_check_their_arguments():
    torch.manual_seed(0)
    stages = partition(_stages(2), exact=True)
    x = stages[1].forward(stages[0].forward(torch.randn(2, D_IN)))
    with pytest.raises(TypeError, match="stage 2's input x must be the int64 fixed-point streams"):
        stages[2].forward(tuple(t.float() for t in x))
    seq = ReversibleSequential(ReversibleBlock(_branch(), _branch()), exact=True)
    y, dy = torch.zeros(2, WIDTH, dtype=torch.int64), torch.zeros(2, WIDTH)
    with pytest.raises(TypeError, match="y1 must be an int64 fixed-point stream"):
        seq.reverse(dy, y, dy, dy)
    with pytest.raises(TypeError, match="y2 must be an int64 fixed-point stream"):
        seq.reverse(y, dy, dy, dy)
    with pytest.raises(TypeError, match="dy1 must be a floating-point tensor"):
        seq.reverse(y, y, y, dy)
    with pytest.raises(TypeError, match="dy2 must have dy1's dtype"):
        seq.reverse(y, y, dy, dy.double())
    with pytest.raises(TypeError, match="exact must be a bool or None"):
        partition(_stages(1), exact=1)


def test_reverse_on_int64_streams_equals_the_exact_autograd_engine():
    """`ReversibleSequential.reverse` in exact mode: from the int64 outputs of the exact steps, the
    int64 inputs bit for bit, and input and parameter grads equal to exact autograd's; the
    caller's tensors are left alone."""
    torch.manual_seed(0)
    seq = ReversibleSequential(*[ReversibleBlock(_branch(), _branch()) for _ in range(3)],
                               HalfCouplingBlock(_branch()), exact=True)
    x1, x2 = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    dy1, dy2 = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    streams = seq.fixed_point_streams(torch.float32)
    y1, y2, _, _ = exact_forward(seq, x1, x2, {}, streams)
    kept = [t.clone() for t in (y1, y2, dy1, dy2)]
    r1, r2, dx1, dx2 = seq.reverse(y1, y2, dy1, dy2)
    grads = [p.grad.clone() for p in seq.parameters()]
    assert all(torch.equal(a, b) for a, b in zip((y1, y2, dy1, dy2), kept))
    fixed = FixedPointStreams(seq.exact_bits, torch.float32)
    assert r1.dtype == torch.int64 and torch.equal(r1, fixed.enter(x1)[1]) and torch.equal(r2, fixed.enter(x2)[1])
    seq.zero_grad(set_to_none=True)
    a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    seq.engine = "autograd"
    torch.autograd.backward(seq(a1, a2), (dy1, dy2))
    assert_close_rel(dx1, a1.grad, 1e-5, "dx1")
    assert_close_rel(dx2, a2.grad, 1e-5, "dx2")
    for (name, p), g in zip(seq.named_parameters(), grads):
        assert_close_rel(g, p.grad, 1e-5, name)


# --- the distributed runtime: int64 messages -------------------------------------------------------

DIST_KW = dict(accum_k=2, base_lr=0.5, warmup_steps=1, weight_decay=1e-3, exact=True, exact_bits=BITS)


def _exact_rank(layout, groups, n, budget):
    """One rank of an exact pipeline (seed 0, `n` batches, flush): its stages' states, losses, stats."""
    torch.manual_seed(0)
    model = synthetic_stages(layout)
    init(timeout=20.0)
    pr = PipelineRank(model, groups=groups, timeout=20.0, memory_budget=budget, **DIST_KW)
    losses = [pr.train_step(x, y)["loss"] for x, y in simulate_batches(n)] + [r["loss"] for r in pr.flush()]
    own = pr.trainer.groups[pr.rank]
    state = {i: {k: v.clone() for k, v in pr.stages[i].module.state_dict().items()} for i in own}
    stats = pr.buffer_stats()
    bits = pr.state_dict()["exact_bits"]
    pr.close()
    return {"state": state, "losses": losses, "stats": stats, "exact_bits": bits}


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_distributed_exact_stages_equal_the_simulator(tmp_path):
    """2 gloo ranks, exact stages (int64 forward messages, int64 inputs and float grads backward,
    int64 FIFO entries after an exact stage) and a memory budget (the same plan on every rank),
    training with optimizer steps: every parameter and buffer, loss and FIFO peak bit for bit the
    simulator's."""
    # (rank 0 ends with an exact stage, which rebuilds; the budget keeps stages 2 (int64 inputs)
    # and 4, on rank 1)
    layout, groups, n, budget = "S r r D r H", [2, 4], 5, 0.5
    results = launch(_exact_rank, 2, (layout, groups, n, budget), log_dir=str(tmp_path), timeout=120)
    torch.manual_seed(0)
    model = synthetic_stages(layout)
    trainer = Trainer(model, "petra", groups=groups, memory_budget=budget, **DIST_KW)
    losses = [trainer.train_step(x, y)["loss"] for x, y in simulate_batches(n)] + [r["loss"] for r in trainer.flush()]
    assert_ranks_hold_the_simulators_parameters(results, trainer, tmp_path)
    assert results[-1]["losses"] == losses
    assert results[0]["stats"] == trainer.buffer_stats()
    assert [r["exact_bits"] for r in results] == [BITS, BITS]  # (saved in each rank's checkpoint)
    assert trainer.memory_plan.kept == [2, 4] and trainer.stages[2].peak_buffer_bytes > 0
    assert [spec[1:] for spec in boundary_specs(trainer.stages, trainer.groups, (4, 8))[0]] == \
        [(torch.int64, torch.float32)] * 2  # (what crossed the wire)


def test_a_checkpoint_resumes_only_on_its_exact_bits():
    # (the in-flight int64 streams are on the checkpoint's grid: another grid reads them 2^k off)
    torch.manual_seed(0)
    model = _stages(1)
    trainer = Trainer(model, "petra", accum_k=2, exact=True, exact_bits=BITS)
    images, labels = _batches(1)[0]
    trainer.train_step(images, labels)
    state = trainer.state_dict()
    assert state["exact_bits"] == BITS
    with pytest.raises(ValueError, match="exact_bits is 8, this run's 12"):
        Trainer(copy.deepcopy(model), "petra", accum_k=2, exact=True, exact_bits=12).load_state_dict(state)
    Trainer(copy.deepcopy(model), "petra", accum_k=2, exact=True, exact_bits=BITS).load_state_dict(state)
    # a rank's checkpoint too (a stand-in rank: the check comes before any collective)
    fresh = Trainer(copy.deepcopy(model), "petra", accum_k=2, exact=True, exact_bits=12)
    rank = types.SimpleNamespace(trainer=fresh, rank=0, world_size=1, tick=0, batches_in=0)
    rank_state = {"kind": RANK_STATE_KIND, "rank": 0, "world_size": 1, "method": "petra", "num_stages": fresh.num_stages,
                  "groups": fresh.groups, "accum_k": 2, "exact": True, "exact_bits": BITS}
    with pytest.raises(ValueError, match="exact_bits is 8, this run's 12"):
        PipelineRank.load_state_dict(rank, rank_state)
