"""RevViTBlock: fused recompute/grads against ordinary autograd through the same modules."""
import pytest
import torch
import torch.nn.utils.prune

import revkernels as rk
from revkernels.nn.revvit import RevViTBlock
from tests.helpers import assert_close_rel, perturb_parameters, plain_forward, rel_err, run_grads

DIM, HEADS, BATCH, TOKENS = 32, 4, 3, 7


def _stack(depth, **kwargs):
    # Random LayerNorm weights/biases and linear parameters: a fused step that reads F's parameter
    # for G's (or a weight for a bias) must give a wrong result, not the identity-init one.
    return perturb_parameters(rk.nn.ReversibleSequential(*[RevViTBlock(DIM, HEADS, **kwargs) for _ in range(depth)]))


def _data(device="cpu"):
    x1 = torch.randn(BATCH, TOKENS, DIM, device=device)
    x2 = torch.randn(BATCH, TOKENS, DIM, device=device)
    w1, w2 = torch.randn_like(x1), torch.randn_like(x2)
    return x1, x2, w1, w2


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("options", [{}, {"drop_path": 0.3}, {"approximate": "tanh", "qkv_bias": False}])
def test_fused_grads_equal_plain_autograd(depth, options):
    seq = _stack(depth, **options)
    data = _data()
    seed = torch.randint(0, 2**31, ()).item()
    expected = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data, seed)
    actual = run_grads(seq, seq, *data, seed)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close_rel(a, e, 1e-5, f"output/grad {i}")


def test_fused_grads_equal_plain_autograd_in_float64():
    """fp64 parameters and streams: every grad (f.proj's bias too) is summed in fp64."""
    seq = _stack(2).double()
    data = [t.double() for t in _data()]
    expected = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data)
    actual = run_grads(seq, seq, *data)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_close_rel(a, e, 1e-10, f"output/grad {i}")


class _LowRankAdapted(torch.nn.Module):
    """A LoRA-style wrapper: the base linear plus a low-rank update (no `weight` of its own)."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base
        self.down = torch.nn.Parameter(0.3 * torch.randn(rank, base.in_features))
        self.up = torch.nn.Parameter(0.3 * torch.randn(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + x @ self.down.t() @ self.up.t()


SWAPS = {
    "fc1 without bias": lambda b: setattr(b.g, "fc1", torch.nn.Linear(DIM, 4 * DIM, bias=False)),
    "norm without affine": lambda b: setattr(b.f, "norm", torch.nn.LayerNorm(DIM, elementwise_affine=False)),
    "RMSNorm": lambda b: setattr(b.g, "norm", torch.nn.RMSNorm(DIM)),
    "LoRA qkv": lambda b: setattr(b.f, "qkv", _LowRankAdapted(b.f.qkv)),
    "LoRA fc2": lambda b: setattr(b.g, "fc2", _LowRankAdapted(b.g.fc2)),
    "weight_norm fc1": lambda b: torch.nn.utils.parametrizations.weight_norm(b.g.fc1),
    # (no parameter named weight: weight_orig and a mask, or a buffer; the steps raised KeyError)
    "pruned fc1": lambda b: torch.nn.utils.prune.l1_unstructured(b.g.fc1, "weight", amount=0.3),
    "qkv weight as a buffer": lambda b: _weight_as_buffer(b.f.qkv),
}


def _weight_as_buffer(linear):
    weight = linear.weight.detach().clone()
    del linear.weight
    linear.register_buffer("weight", weight)


@pytest.mark.parametrize("swap", list(SWAPS))
@pytest.mark.parametrize("engine", ["sequential", "autograd"])
def test_blocks_with_other_layers_run_the_generic_steps(swap, engine):
    """A block whose branches hold other layers than the fused steps read by name runs the generic
    ReversibleBlock steps on its modules (it raised KeyError, with every engine)."""
    seq = _stack(2)
    SWAPS[swap](seq.blocks[1])
    seq = perturb_parameters(seq)
    seq.engine = engine
    assert seq.blocks[0]._parts().fused and not seq.blocks[1]._parts().fused
    data = _data()
    expected = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data)
    actual = run_grads(seq, seq, *data)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_close_rel(a, e, 1e-5, f"output/grad {i}")


def test_fused_steps_with_an_empty_batch():
    seq = _stack(2)
    data = [t[:0] for t in _data()]
    expected = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data)
    actual = run_grads(seq, seq, *data)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.shape == e.shape and torch.equal(a, e), f"output/grad {i}"


@pytest.mark.parametrize("alias", [False, True])
def test_fused_steps_with_a_norm_shared_by_f_and_g(alias):
    """G's LayerNorm is F's: the shared parameters get the sum of both branches' grads (also with
    the block holding F under another name too)."""
    seq = _stack(2)
    for block in seq.blocks:
        block.g.norm = block.f.norm
        if alias:
            block.attention = block.f
    data = _data()
    expected = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data)
    actual = run_grads(seq, seq, *data)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_close_rel(a, e, 1e-5, f"output/grad {i}")


def test_fused_steps_agree_with_the_generic_block_on_the_same_modules():
    seq = _stack(2, drop_path=0.2)
    generic = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(b.f, b.g) for b in seq.blocks])
    data = _data()
    fused = run_grads(seq, seq, *data, seed=3)
    plain = run_grads(generic, seq, *data, seed=3)
    for i, (a, e) in enumerate(zip(fused, plain)):
        assert_close_rel(a, e, 1e-5, f"output/grad {i}")


def test_reverse_with_fused_blocks():
    seq = _stack(2)
    x1, x2, w1, w2 = _data()
    y1, y2 = plain_forward(seq, x1, x2)
    r1, r2, dx1, dx2 = seq.reverse(y1.detach(), y2.detach(), w1, 2 * y2.detach() * w2)
    assert_close_rel(r1, x1, 1e-5, "x1")
    assert_close_rel(r2, x2, 1e-5, "x2")
    a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    z1, z2 = plain_forward(seq, a1, a2)
    ((z1 * w1).sum() + (z2 * z2 * w2).sum()).backward()
    assert_close_rel(dx1, a1.grad, 1e-5, "dx1")
    assert_close_rel(dx2, a2.grad, 1e-5, "dx2")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_autocast_bf16_follows_the_low_precision_rule(approximate):
    seq = _stack(2, approximate=approximate)
    data = _data()
    exact = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        same_dtype = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data, seed=0)
        ours = run_grads(seq, seq, *data, seed=0)
    for i, (o, s, e) in enumerate(zip(ours, same_dtype, exact)):
        assert rel_err(o, e) <= 2 * rel_err(s, e) + 1e-6, f"output/grad {i}"


def _norm_rel_err(actual, expected):
    """||actual - expected|| / ||expected||, in float64."""
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("drop_path", [0.0, 0.3])
def test_recompute_under_autocast_bf16_rebuilds_to_fp32_rounding(drop_path):
    # The rebuild must subtract exactly (same kernels, same dtypes) the F and G values the forward
    # added, so that under autocast the rebuilt input carries only the fp32 rounding of the
    # residual streams, not bf16 rounding of recomputed branch outputs.
    torch.manual_seed(3)  # with drop_path 0.3: each branch keeps one sample and drops the other
    block = RevViTBlock(DIM, HEADS, drop_path=drop_path)
    with torch.random.fork_rng():  # the seeded stream (and so the drop-path masks) stays as it was
        perturb_parameters(block)
    x1, x2 = torch.randn(2, 5, DIM), torch.randn(2, 5, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2, state = block.forward_with_state(x1, x2)
        rec = block.recompute(y1, y2, state)
    if drop_path:
        # The replayed masks must matter: per sample, a branch was either dropped (y == x) or not.
        for y, x in ((y1, x1), (y2, x2)):
            kept = [not torch.equal(y[i], x[i]) for i in range(2)]
            assert kept == [True, False], kept
    assert rec.x1.dtype == x1.dtype and rec.x2.dtype == x2.dtype
    err1, err2 = _norm_rel_err(rec.x1, x1), _norm_rel_err(rec.x2, x2)
    assert err1 <= 1e-6, f"x1: relative error {err1:.3e}"
    assert err2 <= 1e-6, f"x2: relative error {err2:.3e}"


def test_bad_input():
    with pytest.raises(ValueError, match="must be divisible by num_heads"):
        RevViTBlock(30, 4)
    with pytest.raises(ValueError, match="num_heads must be a positive int, got 0"):
        RevViTBlock(DIM, 0)
    with pytest.raises(ValueError, match=r"\(batch, tokens, dim=32\), got shape \(4, 32\)"):
        RevViTBlock(DIM, HEADS)(torch.randn(4, DIM), torch.randn(4, DIM))
    with pytest.raises(ValueError, match="drop_path must be in"):
        RevViTBlock(DIM, HEADS, drop_path=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast(dtype):
    seq = _stack(3, drop_path=0.1).cuda()
    data = _data("cuda")
    exact = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data, seed=0)
    with torch.autocast("cuda", dtype=dtype):
        same_dtype = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data, seed=0)
        ours = run_grads(seq, seq, *data, seed=0)
    for i, (o, s, e) in enumerate(zip(ours, same_dtype, exact)):
        assert rel_err(o, e) <= 2 * rel_err(s, e) + 1e-6, f"output/grad {i}"
