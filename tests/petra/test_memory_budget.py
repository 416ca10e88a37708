"""A memory budget for PETRA stages (`partition(..., memory_budget=...)`, `Trainer(memory_budget=...)`):
the plan keeps the cheapest reversible stages' inputs; kept stages return their stored input and
recompute at it; grads at every budget equal the no-delay reference; the FIFOs stay within it."""
import copy

import pytest
import torch

from revkernels.petra import Trainer, partition
from revkernels.petra.partition import plan_memory
from tests.helpers import assert_close_rel
from tests.petra.test_exact_stages import BITS, D_IN, _batches, _reference_grads, _stages


@pytest.mark.parametrize("exact", [False, True])
def test_grads_at_every_budget_equal_the_reference_and_fifos_stay_within_it(exact):
    """accum_k larger than the batches (no optimizer step): at budgets none, part (bytes, a
    fraction) and all, the pipeline's grads equal the whole network's (exact: the exact autograd
    engine on a 2^-8 grid; else plain autograd), and the kept stages' FIFO peaks add up to the
    plan's bytes, within the budget; the rebuilding stages keep nothing."""
    torch.manual_seed(0)
    model = _stages(2)  # stem, 2 reversible, down, 2 reversible, head: 6 workers
    batches = _batches(12)  # (stage 1 holds 11 batches at once)
    expected = _reference_grads(model, batches, exact)
    kept_sets = []
    for budget in (0, 2000, 0.5, 1.0):
        m = copy.deepcopy(model)
        trainer = Trainer(m, "petra", accum_k=20, exact=exact, exact_bits=BITS, memory_budget=budget)
        for images, labels in batches:
            trainer.train_step(images, labels)
        trainer.flush()
        plan = trainer.memory_plan
        assert (plan is None) == (budget == 0)
        kept = [s.index for s in trainer.stages if s.keeps_input]
        kept_sets.append(kept)
        if plan is not None:
            assert plan.kept == kept
            peaks = sum(s.peak_buffer_bytes for s in trainer.stages if s.keeps_input)
            assert peaks == plan.kept_bytes <= plan.budget_bytes, (budget, peaks, plan.kept_bytes)
        assert all(s.peak_buffer_bytes == 0 for s in trainer.stages if s.rebuilds)
        for (name, p), e in zip(m.named_parameters(), expected):
            assert_close_rel(p.grad, e, 1e-5, f"budget {budget}: {name}")
    # Cheapest first (per batch 240 bytes fed floats, 480 fed int64 streams, times 11, 9, 5, 3
    # batches in flight): 2000 bytes hold stages 4 and 5 (1200 + 720), or in exact mode stage 4
    # only (1200, then 1440); half of all (6720 or 9600 bytes) holds stages 4 and 5
    assert kept_sets[0] == [] and kept_sets[-1] == [1, 2, 4, 5]
    assert kept_sets[1] == ([4] if exact else [4, 5]) and kept_sets[2] == [4, 5]


def test_the_plan_costs_each_stage_by_its_workers_batches_in_flight():
    """Each reversible stage costs its input bytes per batch (int64 after an exact stage) times
    the batches its worker holds at once, 2(R - w) + 1; groups change R and w."""
    torch.manual_seed(0)
    x = torch.randn(5, D_IN)
    stages = partition(_stages(2), exact=True, memory_budget=1.0, example=x)
    plan = stages[0].memory_plan
    assert all(s.memory_plan is plan for s in stages) and plan.kept == [1, 2, 4, 5]
    float_in, fixed_in = 2 * 5 * 6 * 4, 2 * 5 * 6 * 8  # two (5, 6) streams, fp32 or int64
    assert [(c.index, c.pending, c.input_bytes) for c in plan.stages] == \
        [(1, 11, float_in), (2, 9, fixed_in), (4, 5, float_in), (5, 3, fixed_in)]
    assert all(c.bytes == c.pending * c.input_bytes for c in plan.stages)
    assert plan.budget_bytes == plan.all_bytes == plan.kept_bytes
    groups = partition(_stages(2), memory_budget=1.0, example=x, groups=2)  # [stem r r D] [r r H]
    assert [c.pending for c in groups[0][0].memory_plan.stages] == [3, 3, 1, 1]
    text = str(plan)
    assert "4 of 4 reversible stages keep their inputs" in text and text.count("keep") == 5
    half = plan_memory(partition(_stages(2)), 0.5, x)
    assert "rebuild" in str(half) and half.kept_bytes <= half.budget_bytes == half.all_bytes // 2


def test_a_kept_stage_returns_its_stored_input_whatever_the_parameters_did():
    """A kept stage's backward returns the input its forward stored (the same int64 tensors),
    though the parameters changed in between, where a rebuild returns another input."""
    torch.manual_seed(0)
    x = torch.randn(5, D_IN)
    for budget, same in ((1.0, True), (0, False)):
        stages = partition(_stages(2), exact=True, memory_budget=budget, example=x if budget else None)
        a = stages[1].forward(stages[0].forward(x))
        y = stages[2].forward(a)
        with torch.no_grad():
            for p in stages[2].parameters():
                p.add_(0.5)
        back, _ = stages[2].backward(y, tuple(torch.ones(t.shape) for t in y))
        assert stages[2].keeps_input == same and all(t.dtype == torch.int64 for t in back)
        assert all(torch.equal(b, e) for b, e in zip(back, a)) == same


def test_invalid_budgets_raise_naming_memory_budget():
    x = torch.randn(5, D_IN)
    for bad, error in ((-1, ValueError), (1.5, ValueError), (float("nan"), ValueError), ("auto", ValueError),
                       (True, TypeError), ("half", ValueError)):
        with pytest.raises(error, match="memory_budget"):
            partition(_stages(1), memory_budget=bad, example=x)
    with pytest.raises(ValueError, match="memory_budget needs example="):
        partition(_stages(1), memory_budget=0.5)
    with pytest.raises(ValueError, match="memory_budget applies to PETRA's stages, not the delayed"):
        partition(_stages(1), memory_budget=0.5, example=x, delayed=True)
    with pytest.raises(ValueError, match="memory_budget applies to method 'petra' only"):
        Trainer(_stages(1), "backprop", memory_budget=0.5)
    with pytest.raises(ValueError, match="example and context to groups=R or a memory_budget"):
        partition(_stages(1), example=x)


def test_a_checkpoint_keeps_the_plan_and_resumes_bit_for_bit():
    """Saved mid-pipeline with kept stages holding int64 inputs, loaded into a fresh trainer: the
    restored stages keep as before (their FIFOs hold those batches) and the run ends with the
    uninterrupted run's parameters; a trainer without the budget, or not exact, refuses it."""
    torch.manual_seed(0)
    model = _stages(2)
    batches = _batches(9)
    kw = dict(accum_k=2, base_lr=0.5, exact=True, exact_bits=BITS, memory_budget=0.5)

    def run(trainer, part):
        for images, labels in part:
            trainer.train_step(images, labels)

    whole = Trainer(copy.deepcopy(model), "petra", **kw)
    run(whole, batches)
    whole.flush()
    first = Trainer(copy.deepcopy(model), "petra", **kw)
    run(first, batches[:6])
    assert any(s.keeps_input and s.buffered_inputs for s in first.stages)
    state = first.state_dict()
    resumed = Trainer(copy.deepcopy(model), "petra", **kw)
    resumed.load_state_dict(state)
    assert [s.keeps_input for s in resumed.stages] == [s.keeps_input for s in first.stages]
    run(resumed, batches[6:])
    resumed.flush()
    for s, t in zip(resumed.stages, whole.stages):
        for (name, a), b in zip(s.module.state_dict().items(), t.module.state_dict().values()):
            assert torch.equal(a, b), f"stage {s.index} {name}"
    for other in (0, 1.0):  # (another budget's next plan would change which stages keep, mid-pipeline)
        with pytest.raises(ValueError, match=rf"made with memory_budget=0.5, this run has memory_budget={other}"):
            Trainer(copy.deepcopy(model), "petra", **{**kw, "memory_budget": other}).load_state_dict(state)
    without = Trainer(copy.deepcopy(model), "petra", **{**kw, "memory_budget": 0})
    run(without, batches[:3])
    with pytest.raises(ValueError, match=r"made with memory_budget=0, this run has memory_budget=0.5"):
        Trainer(copy.deepcopy(model), "petra", **kw).load_state_dict(without.state_dict())
    old = {k: v for k, v in state.items() if k != "memory_budget"}  # (a checkpoint from before it was saved)
    with pytest.raises(ValueError, match="keep their inputs for a memory_budget, but this run has none"):
        Trainer(copy.deepcopy(model), "petra", **{**kw, "memory_budget": 0}).load_state_dict(old)
    with pytest.raises(ValueError, match="checkpoint's exact is True"):
        Trainer(copy.deepcopy(model), "petra", **{**kw, "exact": False}).load_state_dict(state)


def test_the_plan_sizes_stages_on_meta_copies_without_copying_their_data(monkeypatch):
    """`input_specs` runs copies of the stages on the meta device made without copying a parameter
    or buffer (a model on a GPU is not copied there first; a deep copy of a Parameter or of a
    buffer would call Tensor.__deepcopy__); the specs are the shapes a real forward hands on, the
    stages and their parameters are left as they were."""
    from revkernels.petra.partition import input_specs, meta_copy

    torch.manual_seed(0)
    x = torch.randn(5, D_IN)
    stages = partition(_stages(2))
    params = [(p, p.detach().clone()) for s in stages for p in s.module.parameters()]
    real, expected = x, []
    with torch.no_grad():
        for s in stages:
            expected.append([tuple(t.shape) for t in (real if isinstance(real, tuple) else (real,))])
            if s is not stages[-1]:
                real = s.module(*(real if isinstance(real, tuple) else (real,)))

    def no_data_copy(self, memo):
        raise AssertionError("a tensor's data was deep-copied")

    monkeypatch.setattr(torch.Tensor, "__deepcopy__", no_data_copy)
    specs = input_specs(stages, x)
    assert [[shape for shape, _, _ in spec] for spec in specs] == expected
    copied = meta_copy(stages[1].module)
    assert all(p.is_meta and isinstance(p, torch.nn.Parameter) for p in copied.parameters())
    assert all(b.is_meta for b in copied.buffers())
    for p, before in params:
        assert not p.is_meta and torch.equal(p, before)
