"""revkernels.reference: the stack that saves only its outputs gives plain autograd's grads through
the same blocks (the forward written out here, the whole graph kept), in float32 and float64, for
couplings, half couplings and a mix; its inverse rebuilds the inputs; it keeps no activations."""
import pytest
import torch
from torch import nn

from revkernels.reference import Coupling, HalfCoupling, ReferenceSequential, ReversibleFunction

WIDTH, ROWS = 6, 5


def branch(width=WIDTH):
    """A non-identity branch with random parameters everywhere (LayerNorm's affine included)."""
    net = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return net


def make_blocks(kinds, dtype):
    """One block per letter of `kinds`: "c" a `Coupling`, "h" a `HalfCoupling`."""
    return [(Coupling(branch(), branch()) if kind == "c" else HalfCoupling(branch())).to(dtype) for kind in kinds]


def plain_forward(blocks, x1, x2):
    """The blocks' equations run under plain autograd (every activation kept)."""
    for block in blocks:
        if isinstance(block, Coupling):
            x1 = x1 + block.f(x2)
            x2 = x2 + block.g(x1)
        else:
            x1, x2 = x2, x1 + block.f(x2)
    return x1, x2


def loss_of(y1, y2, w1, w2):
    """A loss that weighs every output element differently (so no grad is a plain sum's)."""
    return (y1 * w1).sum() + (y2.tanh() * w2).sum()


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


KINDS = ["c", "cc", "ccc", "ccccccc", "h", "hh", "hhh", "chhc", "hchchch"]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kinds", KINDS)
def test_grads_equal_plain_autograd_through_the_same_blocks(kinds, dtype):
    torch.manual_seed(len(kinds) + 10 * kinds.count("h"))
    blocks = make_blocks(kinds, dtype)
    seq = ReferenceSequential(*blocks)
    x1, x2, w1, w2 = (torch.randn(ROWS, WIDTH, dtype=dtype) for _ in range(4))

    inputs = [x1.clone().requires_grad_(), x2.clone().requires_grad_()]
    loss_of(*plain_forward(blocks, *inputs), w1, w2).backward()
    want = [t.grad for t in inputs] + [p.grad.clone() for p in seq.parameters()]
    seq.zero_grad(set_to_none=True)

    inputs = [x1.clone().requires_grad_(), x2.clone().requires_grad_()]
    y1, y2 = seq(*inputs)
    want_y = plain_forward(blocks, x1, x2)
    torch.testing.assert_close((y1, y2), want_y, rtol=0, atol=0)  # the same ops in the same order
    loss_of(y1, y2, w1, w2).backward()
    got = [t.grad for t in inputs] + [p.grad for p in seq.parameters()]

    assert len(got) == len(want) == 2 + sum(1 for _ in seq.parameters())
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g is not None and w.abs().max() > 0, i
        assert rel_err(g, w) <= TOL[dtype], (i, rel_err(g, w))


def test_grads_reach_the_parameters_when_no_input_requires_grad():
    torch.manual_seed(0)
    blocks = make_blocks("chc", torch.float64)
    seq = ReferenceSequential(*blocks)
    x1, x2 = torch.randn(ROWS, WIDTH, dtype=torch.float64), torch.randn(ROWS, WIDTH, dtype=torch.float64)
    plain_forward(blocks, x1, x2)[1].sum().backward()
    want = [p.grad.clone() for p in seq.parameters()]
    seq.zero_grad(set_to_none=True)
    seq(x1, x2)[1].sum().backward()
    assert x1.grad is None and not x1.requires_grad  # the caller's tensors are left alone
    for g, w in zip((p.grad for p in seq.parameters()), want, strict=True):
        assert rel_err(g, w) <= 1e-12


def test_same_tensor_as_both_streams():
    """The benchmarks feed one input as both streams: its grad is the sum of both streams' grads."""
    torch.manual_seed(1)
    blocks = make_blocks("cc", torch.float64)
    seq = ReferenceSequential(*blocks)
    x = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    a = x.clone().requires_grad_()
    sum(plain_forward(blocks, a, a)).pow(2).sum().backward()
    b = x.clone().requires_grad_()
    sum(seq(b, b)).pow(2).sum().backward()
    assert rel_err(b.grad, a.grad) <= 1e-12


@pytest.mark.parametrize("kinds", ["c", "h", "chhc"])
def test_inverse_rebuilds_the_inputs(kinds):
    torch.manual_seed(2)
    seq = ReferenceSequential(*make_blocks(kinds, torch.float64))
    x1, x2 = torch.randn(ROWS, WIDTH, dtype=torch.float64), torch.randn(ROWS, WIDTH, dtype=torch.float64)
    with torch.no_grad():
        y1, y2 = seq(x1, x2)
    r1, r2 = seq.inverse(y1, y2)
    assert rel_err(r1, x1) <= 1e-12 and rel_err(r2, x2) <= 1e-12
    for block in seq.blocks:  # each block's own inverse, too
        assert all(rel_err(r, x) <= 1e-12 for r, x in zip(block.inverse(*block(x1, x2)), (x1, x2)))


@pytest.mark.parametrize("depth", [1, 4])
def test_only_the_outputs_are_saved(depth):
    torch.manual_seed(3)
    seq = ReferenceSequential(*make_blocks("c" * depth, torch.float32))
    x1, x2 = (torch.randn(ROWS, WIDTH, requires_grad=True) for _ in range(2))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        seq(x1, x2)
    assert saved == [(ROWS, WIDTH), (ROWS, WIDTH)]


def test_recompute_runs_under_the_forwards_autocast():
    """bf16 autocast on CPU: the rebuild recomputes F and G in bf16 as the forward did, so the grads
    are plain autograd's under the same autocast (a recompute in fp32 differs by ~4e-2)."""
    torch.manual_seed(4)
    blocks = make_blocks("ch", torch.float32)
    seq = ReferenceSequential(*blocks)
    x1, x2 = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    grads = []
    for forward in (lambda a, b: plain_forward(blocks, a, b), seq):
        inputs = [x1.clone().requires_grad_(), x2.clone().requires_grad_()]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y1, y2 = forward(*inputs)
        (y1.float().pow(2).sum() + y2.float().sum()).backward()
        grads.append([p.grad.clone() for p in seq.parameters()])
        seq.zero_grad(set_to_none=True)
    for g, w in zip(*grads, strict=True):
        assert rel_err(g, w) <= 1e-5


def test_function_takes_any_block_with_the_two_steps():
    """ReversibleFunction needs of a block only ``forward(x1, x2)`` and ``backward_step``."""
    torch.manual_seed(5)
    block = Coupling(branch(), branch()).double()
    x1, x2 = (torch.randn(ROWS, WIDTH, dtype=torch.float64, requires_grad=True) for _ in range(2))
    y1, y2 = ReversibleFunction.apply(x1, x2, (block,))
    (y1 * y2).sum().backward()
    a1, a2 = (t.detach().clone().requires_grad_() for t in (x1, x2))
    block.zero_grad(set_to_none=True)
    (lambda y: (y[0] * y[1]).sum())(plain_forward([block], a1, a2)).backward()
    assert rel_err(x1.grad, a1.grad) <= 1e-12 and rel_err(x2.grad, a2.grad) <= 1e-12
