"""The pareprop engine (two CUDA streams) against plain autograd; on CPU it is the sequential schedule."""
import random

import pytest
import torch

import revkernels as rk
from revkernels.nn.revvit import RevViTBlock
from tests.helpers import assert_close_rel, loss_of, make_seq, perturb_parameters, plain_forward, rel_err, run_grads


def test_cpu_runs_the_sequential_schedule():
    seq = make_seq(3, 16, dropout=0.2)
    data = [torch.randn(4, 16) for _ in range(4)]
    seq.engine = "sequential"
    expected = run_grads(seq, seq, *data, seed=5)
    seq.engine = "pareprop"
    actual = run_grads(seq, seq, *data, seed=5)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


def _vit_stack(depth, drop_path=0.1, dim=64, heads=4):
    return perturb_parameters(rk.nn.ReversibleSequential(*[RevViTBlock(dim, heads, drop_path=drop_path) for _ in range(depth)],
                                                             engine="pareprop").cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2, 3, 12, 25])
def test_cuda_grads_equal_autograd_fp32(depth):
    seq = _vit_stack(depth)
    data = [torch.randn(4, 9, 64, device="cuda") for _ in range(4)]
    expected = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data, seed=1)
    actual = run_grads(seq, seq, *data, seed=1)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close_rel(a, e, 1e-5, f"output/grad {i}")


@pytest.mark.gpu
def test_cuda_a_parameter_unfrozen_between_forward_and_backward_gets_no_grad():
    """As with autograd and the sequential walker: a parameter that did not require grad when the
    forward ran gets no grad from that backward (the two-stream walker raised KeyError)."""
    seq = _vit_stack(2)
    frozen = seq.blocks[0].g.fc1.weight
    frozen.requires_grad_(False)
    data = [torch.randn(4, 9, 64, device="cuda") for _ in range(4)]
    a1, a2 = (t.clone().requires_grad_() for t in data[:2])
    y1, y2 = seq(a1, a2)
    frozen.requires_grad_(True)
    loss_of(y1, y2, *data[2:]).backward()
    assert frozen.grad is None and all(p.grad is not None for p in seq.parameters() if p is not frozen)


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [2, 3])
def test_cuda_autocast_bf16_over_three_optimizer_steps(depth):
    seq = _vit_stack(depth)
    reference = _vit_stack(depth)
    reference.load_state_dict(seq.state_dict())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-3) for m in (seq, reference))
    for step in range(3):
        data = [torch.randn(4, 9, 64, device="cuda") for _ in range(4)]
        exact = run_grads(lambda a, b: plain_forward(reference, a, b), reference, *data, seed=step)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            same_dtype = run_grads(lambda a, b: plain_forward(reference, a, b), reference, *data, seed=step)
            ours = run_grads(seq, seq, *data, seed=step)
        for i, (o, s, e) in enumerate(zip(ours, same_dtype, exact)):
            assert rel_err(o, e) <= 2 * rel_err(s, e) + 1e-6, f"step {step} output/grad {i}"
        # Both stepped with the exact grads: the parameters stay equal, so each step compares the
        # engine with plain autograd on the same, updated model.
        for model, optimizer in ((seq, opt), (reference, ref_opt)):
            for p, g in zip(model.parameters(), exact[4:]):
                p.grad = g.clone()
            optimizer.step()


@pytest.mark.gpu
def test_cuda_repeated_runs_are_identical_under_stress():
    # Races between the two streams would show up as run-to-run differences.
    rng = random.Random(0)
    stacks = {d: _vit_stack(d, drop_path=0.0, dim=32, heads=2) for d in (1, 2, 3, 5, 8)}
    for step in range(200):
        depth, batch = rng.choice(list(stacks)), rng.choice([1, 2, 4, 8])
        seq = stacks[depth]
        data = [torch.randn(batch, 17, 32, device="cuda") for _ in range(4)]
        first = run_grads(seq, seq, *data, seed=step)
        second = run_grads(seq, seq, *data, seed=step)
        for a, b in zip(first, second):
            assert torch.equal(a, b), f"step {step}: depth {depth}, batch {batch} differs between runs"
