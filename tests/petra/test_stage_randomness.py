"""PETRA stages whose modules draw random numbers (dropout, drop-path): each backward replays the
draws of its own batch's forward (a reversible stage's rebuild and VJP, a non-reversible stage's
recompute), with other batches' forwards in between, and leaves the global generator as it found
it; a checkpoint taken with such batches in flight resumes bit for bit."""
import copy

import pytest
import torch
from torch import nn

import revkernels as rk
from revkernels.models import ReversibleStage
from revkernels.petra import Trainer, partition
from revkernels.petra.distributed import merge_rank_states, split_trainer_state
from tests.helpers import assert_close_rel, perturb_parameters
from tests.petra.test_simulate import TwoStreamHead

WIDTH, D_IN, CLASSES, BATCH = 6, 5, 3, 8


class NoisyStem(nn.Module):
    reversible = False
    kind = "stem"

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, 2 * WIDTH)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return tuple(self.drop(torch.tanh(self.lin(x))).chunk(2, dim=1))


class NoisyMix(nn.Module):
    reversible = False
    kind = "down"

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.4)

    def forward(self, x1, x2):
        return self.drop(torch.tanh(self.lin(x2))), x1 + x2


def _branch(p):
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(p))


def _model(tokens=True):
    """Stem, a half-coupling stage, a full coupling, a non-reversible stage, a `RevViTBlock` with
    drop-path on (batch, tokens, width) streams (`tokens`), head: every kind of stage draws random
    numbers."""
    torch.manual_seed(0)
    stages = [NoisyStem(), ReversibleStage(_branch(0.5)), rk.nn.ReversibleBlock(_branch(0.3), _branch(0.2)),
              NoisyMix()] + ([rk.nn.RevViTBlock(WIDTH, 2, drop_path=0.5)] if tokens else []) + [TwoStreamHead(CLASSES, WIDTH)]
    return perturb_parameters(nn.ModuleList(stages))


def _input_of(stages, i):
    """A random input for stage i: a tensor for the stem, two streams of the right shape after it."""
    if i == 0:
        return torch.randn(BATCH, D_IN)
    shape = (BATCH, 3, WIDTH) if isinstance(stages[i], rk.nn.RevViTBlock) else (BATCH, WIDTH)
    return torch.randn(shape), torch.randn(shape)


def _stream_start(stage):
    """Sets the CPU generator where the stage's own stream stands (its forward draws from there)."""
    state = stage._stream.state
    return (lambda: torch.manual_seed(stage._stream.seed)) if state is None else state.restore


def _reference(module, x, dy, start):
    """Plain autograd through a copy of `module` from the generator state `start()` sets: output,
    input grads, parameter grads."""
    module = copy.deepcopy(module)
    leaves = tuple(t.clone().requires_grad_() for t in (x if isinstance(x, tuple) else (x,)))
    start()
    out = module(*leaves)
    torch.autograd.backward(out, dy)
    return out, [t.grad for t in leaves], [p.grad for p in module.parameters()]


@pytest.mark.parametrize("delayed", [False, True])
def test_a_backward_replays_its_own_forwards_draws(delayed):
    model = _model()
    stages = partition(list(model), delayed=delayed)
    for i, stage in enumerate(stages[:-1]):
        inputs = [_input_of(model, i) for _ in range(2)]
        outputs, starts = [], []
        for x in inputs:  # two batches in flight, as in a pipeline
            starts.append(_stream_start(stage))
            generator = torch.get_rng_state()
            outputs.append(stage.forward(x))  # (from the stage's own stream: the global one stays)
            assert torch.equal(torch.get_rng_state(), generator), f"stage {i}: the forward moved the generator"
            torch.randn(7)  # other stages draw in between
        for x, y, start in zip(inputs, outputs, starts):
            dy = tuple(torch.randn_like(t) for t in y)
            ref_out, ref_dx, ref_grads = _reference(stage.module, x, dy, start)
            for a, b in zip(y, ref_out, strict=True):  # the forward drew what plain autograd draws
                assert torch.equal(a, b), f"stage {i}: forward"
            for p in stage.module.parameters():
                p.grad = None
            generator = torch.get_rng_state()
            x_back, dx = stage.backward(y, dy)
            assert torch.equal(torch.get_rng_state(), generator), f"stage {i}: the backward moved the generator"
            for a, b in zip(x_back, x if isinstance(x, tuple) else (x,)):
                assert_close_rel(a, b, 1e-6, f"stage {i}: rebuilt input")
            if i > 0:
                for a, b in zip(dx, ref_dx, strict=True):
                    assert_close_rel(a, b, 1e-5, f"stage {i}: input grad")
            for (name, p), b in zip(stage.module.named_parameters(), ref_grads, strict=True):
                assert_close_rel(p.grad, b, 1e-5, f"stage {i}: grad of {name}")


def test_each_stage_draws_from_a_stream_of_its_own():
    """Stages holding copies of one dropout module draw other masks from the same input (before, all
    drew from the process's generator: on ranks seeded alike, the same masks), and a partition
    made after the same seed draws the same masks again, whatever the global generator did."""
    def masks_of(seed):
        torch.manual_seed(seed)
        branch = _branch(0.5)
        stages = partition([NoisyStem()] + [ReversibleStage(copy.deepcopy(branch)) for _ in range(3)]
                           + [TwoStreamHead(CLASSES, WIDTH)])
        x = (torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH))
        torch.manual_seed(1234)  # every stage starts from this state (the forwards leave it as it is)
        return [stage.forward(x)[1] - x[0] for stage in stages[1:4]], x

    first, x = masks_of(0)
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert not torch.equal(first[a] == 0, first[b] == 0), f"stages {a + 1} and {b + 1} drew the same mask"
    again, x_again = masks_of(0)
    assert all(torch.equal(a, b) for a, b in zip(x, x_again)) and all(torch.equal(a, b) for a, b in zip(first, again))
    other, _ = masks_of(1)
    assert not torch.equal(first[0] == 0, other[0] == 0)

def _batches(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, D_IN, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)) for _ in range(n)]


def _train(trainer, batches):
    for x, y in batches:
        trainer.train_step(x, y)


def test_a_checkpoint_keeps_the_draws_of_the_batches_in_flight():
    # Stopped mid-pipeline, saved, loaded into a fresh trainer: with the generator where the
    # uninterrupted run had it, the rest of the run is bit for bit the uninterrupted one's.
    # (Without the in-flight forwards' generator states the resumed backwards would draw anew.)
    batches = _batches(6)
    whole = Trainer(_model(tokens=False), "petra", groups=3, base_lr=0.05)
    _train(whole, batches[:3])
    state = whole.state_dict()
    assert any(replays[1] for _, _, replays in state["fifos"])
    generator = torch.get_rng_state()
    _train(whole, batches[3:])
    whole.flush()
    # directly, and through the distributed runtime's per-rank checkpoints
    image_spec = ((BATCH, D_IN), torch.float32)
    for checkpoint in (state, merge_rank_states([split_trainer_state(state, r, image_spec) for r in range(3)])):
        resumed = Trainer(_model(tokens=False), "petra", groups=3, base_lr=0.05)
        resumed.load_state_dict(checkpoint)
        torch.set_rng_state(generator)
        _train(resumed, batches[3:])
        resumed.flush()
        for mine, other in zip(resumed.stages, whole.stages):
            for (name, a), b in zip(mine.module.state_dict().items(), other.module.state_dict().values()):
                assert torch.equal(a, b), f"stage {mine.index} {name}"


class _Drop(nn.Module):
    """Dropout through F.dropout, declared on the module itself (as docs/engines.md asks)."""

    draws_random = True

    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5, self.training)


@pytest.mark.parametrize("make", [lambda: nn.Dropout(0.5), _Drop], ids=["nn.Dropout", "declared"])
def test_a_stage_that_is_itself_a_random_layer_replays_its_draws(make):
    # (the stage's own module was not looked at, only its submodules: its backward drew a new mask)
    torch.manual_seed(0)
    stage = partition([nn.Linear(D_IN, D_IN), make(), nn.Linear(D_IN, CLASSES)])[1]
    x = torch.randn(64, D_IN)
    (out,) = stage.forward((x,), batch=0)
    torch.randn(100)  # (other work between the forward and its backward)
    _, (dx,) = stage.backward((out,), (torch.ones_like(out),), batch=0)
    assert torch.equal(dx, (out != 0).float() * 2)  # the VJP of the forward's own mask (p = 0.5)
    assert 0 < (out == 0).sum() < out.numel()


@pytest.mark.parametrize("method", ["backprop", "revbackprop"])
def test_a_baselines_checkpoint_resumes_its_draws_bit_for_bit(method):
    # (the baselines draw from the global generator, which state_dict left out: the resumed run
    # drew other dropout masks than the uninterrupted one)
    def model():
        torch.manual_seed(0)
        return [nn.Flatten(), nn.Linear(D_IN, 16), nn.Sequential(nn.Dropout(0.5)), nn.Linear(16, CLASSES)]

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, D_IN, generator=g), torch.randint(0, CLASSES, (4,), generator=g)) for _ in range(6)]
    torch.manual_seed(123)
    whole = Trainer(model(), method=method)
    expected = [whole.train_step(x, y)["loss"] for x, y in data]
    torch.manual_seed(123)
    first = Trainer(model(), method=method)
    got = [first.train_step(x, y)["loss"] for x, y in data[:3]]
    state = first.state_dict()
    torch.manual_seed(7)  # (a new process: its own generator state until the checkpoint is loaded)
    resumed = Trainer(model(), method=method)
    resumed.load_state_dict(state)
    got += [resumed.train_step(x, y)["loss"] for x, y in data[3:]]
    assert got == expected
