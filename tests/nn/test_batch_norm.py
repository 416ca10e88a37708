"""revkernels.nn.BatchNormAct2d against nn.BatchNorm2d (+ ReLU): outputs, grads, running statistics,
eval mode, state_dict compatibility, frozen statistics under the engines' recompute."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import revkernels as rk
from revkernels.engine.structure import recompute_context
from revkernels.nn import BatchNormAct2d
from tests.helpers import assert_close_rel, assert_low_precision_rule


def _pair(c, relu, momentum=0.1):
    ours = BatchNormAct2d(c, momentum=momentum, relu=relu)
    ref = nn.BatchNorm2d(c, momentum=momentum)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.5 * torch.randn(c))
        ref.bias.copy_(0.5 * torch.randn(c))
    ours.load_state_dict(ref.state_dict())
    return ours, ref


def _ref_forward(ref, x, relu):
    out = ref(x)
    return torch.relu(out) if relu else out


def test_is_a_batchnorm_with_the_same_state():
    ours, ref = BatchNormAct2d(7), nn.BatchNorm2d(7)
    assert isinstance(ours, nn.BatchNorm2d) and isinstance(ours, nn.modules.batchnorm._BatchNorm)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert "relu=True" in repr(ours)
    assert rk.nn.BatchNormAct2d is BatchNormAct2d


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("relu", [True, False])
def test_training_steps_match_batchnorm2d(relu, momentum):
    ours, ref = _pair(6, relu, momentum)
    for step in range(3):
        x = torch.randn(4, 6, 5, 5) * 2 + 1
        if step == 1:
            x = x.contiguous(memory_format=torch.channels_last)
        dout = torch.randn(4, 6, 5, 5)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = ours(xa)
        want = _ref_forward(ref, xb, relu)
        assert_close_rel(out, want, 1e-5, "out")
        out.backward(dout)
        want.backward(dout)
        assert_close_rel(xa.grad, xb.grad, 1e-5, "input grad")
        assert_close_rel(ours.weight.grad, ref.weight.grad, 1e-5, "weight grad")
        assert_close_rel(ours.bias.grad, ref.bias.grad, 1e-5, "bias grad")
    assert_close_rel(ours.running_mean, ref.running_mean, 1e-5, "running_mean")
    assert_close_rel(ours.running_var, ref.running_var, 1e-5, "running_var")
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 3


def test_a_gradient_penalty_matches_batchnorm2d():
    """A gradient penalty through a conv and BatchNormAct2d (create_graph=True, then the penalty's
    backward) gives nn.BatchNorm2d + ReLU's parameter grads in float64 (it gave about half the conv's:
    the fused op's backward was not differentiable)."""
    conv = nn.Conv2d(3, 6, 3, padding=1).double()
    ours, ref = _pair(6, True, 0.1)
    ours, ref = ours.double(), ref.double()
    x = (torch.randn(4, 3, 5, 5, dtype=torch.float64) * 2 + 1).requires_grad_()
    grads = []
    for bn, forward in ((ours, ours), (ref, lambda h: _ref_forward(ref, h, True))):
        out = forward(conv(x))
        (dx,) = torch.autograd.grad((out ** 2).sum(), x, create_graph=True)
        # (conv.bias is left out: the batch statistics remove it, its grads are rounding noise)
        grads.append(torch.autograd.grad((dx ** 2).sum(), (conv.weight, bn.weight, bn.bias)))
    for name, actual, expected in zip(("conv.weight", "weight", "bias"), *grads):
        assert_close_rel(actual, expected, 1e-10, f"penalty grad of {name}")


@pytest.mark.parametrize("momentum", [0.1, None])
def test_an_empty_batch_keeps_the_running_statistics(momentum):
    # (the fused op's mean and rstd of no values are NaN: they went into the statistics)
    ours, ref = _pair(3, relu=False, momentum=momentum)
    for batch in (4, 0, 4):
        x = torch.randn(batch, 3, 2, 2) * 2 + 1
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, want = ours(xa), _ref_forward(ref, xb, relu=False)
        assert out.shape == want.shape == x.shape
        dout = torch.randn(x.shape)
        out.backward(dout)
        want.backward(dout)
        assert_close_rel(ours.running_mean, ref.running_mean, 1e-5, "running_mean")
        assert_close_rel(ours.running_var, ref.running_var, 1e-5, "running_var")
        assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked)
    assert_close_rel(ours.weight.grad, ref.weight.grad, 1e-5, "weight grad")


@pytest.mark.parametrize("relu", [True, False])
def test_eval_mode_uses_running_statistics(relu):
    ours, ref = _pair(5, relu)
    for _ in range(2):  # some running statistics
        x = torch.randn(3, 5, 4, 4) + 2
        ours(x), ref(x)
    ours.eval(), ref.eval()
    buffers = [b.clone() for b in ours.buffers()]
    x = torch.randn(2, 5, 4, 4)
    assert_close_rel(ours(x), _ref_forward(ref, x, relu), 1e-6, "eval out")
    assert all(torch.equal(a, b) for a, b in zip(buffers, ours.buffers()))


def test_state_dict_round_trip():
    ref = nn.BatchNorm2d(4)
    ref(torch.randn(3, 4, 2, 2) + 1)  # non-trivial running statistics
    ours = BatchNormAct2d(4, relu=False)
    ours.load_state_dict(ref.state_dict())
    back = nn.BatchNorm2d(4)
    back.load_state_dict(ours.state_dict())
    for (n, a), (_, b) in zip(ref.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n


def test_frozen_statistics_and_no_tracking():
    ours, _ = _pair(3, True)
    x = torch.randn(2, 3, 4, 4)
    before = [b.clone() for b in ours.buffers()]
    with recompute_context(ours):
        out = ours(x)
    assert all(torch.equal(a, b) for a, b in zip(before, ours.buffers()))
    assert ours.track_running_stats
    torch.testing.assert_close(out, ours(x), rtol=0, atol=0)  # same batch statistics, bitwise
    untracked = BatchNormAct2d(3, track_running_stats=False)
    assert untracked.running_mean is None
    untracked.eval()  # no running statistics: batch statistics in eval mode too, as nn.BatchNorm2d
    ref = nn.BatchNorm2d(3, track_running_stats=False).eval()
    assert_close_rel(untracked(x), torch.relu(ref(x)), 1e-5, "untracked eval out")


def test_affine_false_and_bad_input():
    ours, ref = BatchNormAct2d(3, affine=False), nn.BatchNorm2d(3, affine=False)
    x = torch.randn(2, 3, 4, 4)
    assert_close_rel(ours(x), torch.relu(ref(x)), 1e-5, "affine=False")
    with pytest.raises(ValueError, match="expected 4D input"):
        ours(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        ours(torch.randn(1, 3, 1, 1))


def test_deepcopy_and_bf16_input():
    ours, ref = _pair(4, True)
    twin = copy.deepcopy(ours)
    x = (torch.randn(2, 4, 3, 3) + 1).bfloat16()
    out = twin(x)
    assert out.dtype == torch.bfloat16
    exact = torch.relu(F.batch_norm(x.double(), None, None, ref.weight.double(), ref.bias.double(), True, 0.0, ref.eps))
    assert_low_precision_rule(out, _ref_forward(ref, x.float(), True).bfloat16(), exact, "bf16 out")
