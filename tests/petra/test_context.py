"""PETRA with a per-batch context (a key padding mask, a conditioning vector and a float, as a text
model's stages would get): every method against plain autograd through the same modules, the
distributed runtime against the simulator (bit for bit), checkpoints that keep the in-flight
batches' contexts."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import revkernels as rk
from revkernels.petra import METHODS, Trainer
from revkernels.petra.distributed import PipelineRank, init, launch, merge_rank_states, split_trainer_state
from tests.engine.test_context import BATCH, TOKENS, WIDTH, CondMlp, MaskedAttention, _context
from tests.helpers import assert_close_rel
from tests.petra.test_distributed import assert_ranks_hold_the_simulators_parameters

D_IN, CLASSES = 6, 3
KW = dict(accum_k=2, base_lr=0.5, warmup_steps=1, weight_decay=1e-3)


class TokenStem(nn.Module):
    """Token features -> two streams, the first shifted by the conditioning vector."""

    reversible = False
    kind = "stem"

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, 2 * WIDTH)

    def forward(self, x, cond=None, **context):
        a, b = torch.tanh(self.lin(x)).chunk(2, dim=-1)
        return a + cond[:, None, :], b


class MaskedPoolHead(nn.Module):
    """Mean of the streams over the unmasked tokens -> logits."""

    reversible = False
    kind = "head"

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, CLASSES)

    def forward(self, x1, x2, attn_mask=None, **context):
        m = attn_mask.to(x1.dtype)[..., None]
        return self.fc(((x1 + x2) * m).sum(1) / m.sum(1))


def _model(num_reversible=3):
    torch.manual_seed(0)
    blocks = [rk.nn.ReversibleBlock(MaskedAttention(), CondMlp()) for _ in range(num_reversible)]
    for block in blocks:  # a stage's rebuild draws fresh randomness: no dropout in a PETRA stage
        block.f.drop.p = block.g.mlp[-1].p = 0.0
    return nn.ModuleList([TokenStem(), *blocks, MaskedPoolHead()])


def _batches(n, seed=0):
    torch.manual_seed(seed)
    return [(torch.randn(BATCH, TOKENS, D_IN), torch.randint(0, CLASSES, (BATCH,)),
             {**_context(cond_grad=False), "scale": 0.5 + 0.25 * i}) for i in range(n)]


def _plain_loss(model, x, y, context):
    x1, x2 = model[0](x, **context)
    for block in model[1:-1]:
        x1 = x1 + block.f(x2, **context)
        x2 = x2 + block.g(x1, **context)
    return F.cross_entropy(model[-1](x1, x2, **context), y)


@pytest.mark.parametrize("method", METHODS)
def test_two_batches_with_their_contexts_give_plain_autograd_grads(method):
    # k = 3: no stage steps before both batches' backwards reached it, so each backward (rebuilt
    # with its own batch's context, while the stage already ran the other batch) gives plain
    # autograd's grads; their sum stays in .grad.
    model, reference = _model(), _model()
    batches = _batches(2)
    trainer = Trainer(model, method, accum_k=3)
    results = [trainer.train_step(x, y, **c) for x, y, c in batches] + trainer.flush()
    losses = [r["loss"] for r in results if r["loss"] is not None]
    expected = [_plain_loss(reference, *batch) for batch in batches]
    sum(expected).backward()
    assert losses == pytest.approx([e.item() for e in expected], rel=1e-6)
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert_close_rel(p.grad, r.grad, 1e-5, name)
    assert not trainer._contexts  # every batch's context is dropped once its backward is done


def test_context_tensor_that_requires_grad_is_refused():
    trainer = Trainer(_model(), "petra")
    x, y, context = _batches(1)[0]
    with pytest.raises(ValueError, match="context cond requires grad"):
        trainer.train_step(x, y, **{**context, "cond": context["cond"].requires_grad_()})


def _simulate(n, groups, stop=None):
    trainer = Trainer(_model(), "petra", groups=groups, **KW)
    for x, y, c in _batches(n)[:stop]:
        trainer.train_step(x, y, **c)
    return trainer


def test_checkpoint_keeps_the_in_flight_contexts():
    # Stopped mid-pipeline, saved, loaded into a fresh trainer: the rest of the run is bit for bit
    # the uninterrupted one's; a round trip through the per-rank format keeps the contexts.
    whole = _simulate(5, 3)
    whole.flush()
    half = _simulate(5, 3, stop=3)
    state = half.state_dict()
    assert sorted(state["contexts"]) == [0, 1, 2]
    resumed = Trainer(_model(), "petra", groups=3, **KW)
    resumed.load_state_dict(state)
    for x, y, c in _batches(5)[3:]:
        resumed.train_step(x, y, **c)
    resumed.flush()
    for mine, other in zip(resumed.stages, whole.stages):
        for (name, a), b in zip(mine.module.state_dict().items(), other.module.state_dict().values()):
            assert torch.equal(a, b), f"stage {mine.index} {name}"
    image_spec = ((BATCH, TOKENS, D_IN), torch.float32)
    merged = merge_rank_states([split_trainer_state(state, r, image_spec) for r in range(3)])
    assert sorted(merged["contexts"]) == sorted(state["contexts"])
    for b, c in state["contexts"].items():
        got = merged["contexts"][b]
        assert torch.equal(got["attn_mask"], c["attn_mask"]) and got["scale"] == c["scale"]


def _train_rank(n, groups):
    init(timeout=20.0)
    pr = PipelineRank(_model(), groups=groups, timeout=20.0, **KW)
    losses = [pr.train_step(x, y, **c)["loss"] for x, y, c in _batches(n)]
    losses += [r["loss"] for r in pr.flush()]
    own = pr.trainer.groups[pr.rank]
    state = {i: {k: v.clone() for k, v in pr.stages[i].module.state_dict().items()} for i in own}
    left = len(pr._contexts)
    pr.close()
    return {"state": state, "losses": losses, "contexts_left": left}


def test_distributed_with_context_equals_simulator(tmp_path):
    n = 5
    results = launch(_train_rank, 3, (n, 3), log_dir=str(tmp_path), timeout=120)
    trainer = Trainer(_model(), "petra", groups=3, **KW)
    losses = [trainer.train_step(x, y, **c)["loss"] for x, y, c in _batches(n)]
    losses += [r["loss"] for r in trainer.flush()]
    assert_ranks_hold_the_simulators_parameters(results, trainer, tmp_path)
    assert all(res["contexts_left"] == 0 for res in results)
    assert results[-1]["losses"] == losses
