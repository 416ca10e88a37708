"""`revkernels.check`: the reversibility report and the runtime reconstruction monitor."""
import math
import warnings

import pytest
import torch

import revkernels as rk
from revkernels.check import ReconstructionMonitor, monitor_reconstruction
from revkernels.nn.reversible import ReversibleSequential
from revkernels.nn.revvit import RevViTBlock
from tests.helpers import assert_close_rel, loss_of, make_seq, perturb_parameters, run_grads


def _step(seq, shape=(4, 8)):
    x1, x2 = torch.randn(*shape, requires_grad=True), torch.randn(*shape)
    y1, y2 = seq(x1, x2)
    loss_of(y1, y2, torch.randn(shape), torch.randn(shape)).backward()


def _monitor_warnings(caught):
    return [str(w.message) for w in caught if "reconstruction monitor" in str(w.message)]


@pytest.mark.parametrize("engine", ["sequential"])  # pareprop is this code on CPU (see tests/helpers.py)
def test_no_warning_on_an_invertible_stack_and_grads_unchanged(engine):
    seq = make_seq(4, 8, engine=engine, dropout=0.3)
    ref = make_seq(4, 8, engine="autograd", dropout=0.3)
    ref.load_state_dict(seq.state_dict())
    data = [torch.randn(4, 8) for _ in range(4)]
    with warnings.catch_warnings(record=True) as caught, monitor_reconstruction(seq, threshold=1e-4) as monitor:
        warnings.simplefilter("always")
        got = run_grads(seq, seq, *data, seed=3)
    expected = run_grads(ref, ref, *data, seed=3)
    assert not _monitor_warnings(caught)
    assert len(monitor.errors) == 4 and max(monitor.errors) < 1e-5, monitor.errors
    for a, b in zip(got, expected):
        assert_close_rel(a, b, 1e-5)
    assert seq.reconstruction_monitor is None  # detached on exit


def test_an_empty_batch_is_monitored_and_checked():
    # (torch's max rejects empty tensors: both raised on the batch every engine accepts)
    seq = make_seq(2, 8, engine="sequential")
    x = torch.randn(0, 8, requires_grad=True)
    with monitor_reconstruction(seq) as monitor:
        y1, y2 = seq(x, x)
        (y1.sum() + y2.sum()).backward()
    assert monitor.errors == [0.0, 0.0] and x.grad.shape == (0, 8)
    report = rk.check_reversibility(seq, torch.randn(0, 8), torch.randn(0, 8))
    assert report.max_error == 0.0 and len(report.block_errors) == 2


def test_revvit_stack_is_monitored_without_warning():
    seq = perturb_parameters(ReversibleSequential(*[RevViTBlock(16, 2) for _ in range(3)]))
    with warnings.catch_warnings(record=True) as caught, monitor_reconstruction(seq, threshold=1e-4) as monitor:
        warnings.simplefilter("always")
        _step(seq, (2, 5, 16))
    assert not _monitor_warnings(caught) and len(monitor.errors) == 3


def test_warns_naming_the_block_whose_recompute_does_not_invert():
    seq = make_seq(4, 8)
    block = seq.blocks[2]
    original = block.recompute

    def noisy_recompute(y1, y2, state=None):
        rec = original(y1, y2, state)
        rec.x1 = rec.x1 + 1e-2 * torch.randn_like(rec.x1)
        return rec

    block.recompute = noisy_recompute
    monitor = monitor_reconstruction(seq, threshold=1e-4)
    with pytest.warns(UserWarning, match=r"block 2's input was rebuilt with relative error") as record:
        _step(seq)
    message = str([w for w in record if "monitor" in str(w.message)][0].message)
    assert "blocks over it: [2, 1, 0]" in message, message
    assert monitor.errors[3] < 1e-4 < monitor.errors[2]


def test_unreplayed_dropout_is_caught():
    # preserve_rng_state=False on a stochastic stack: the recompute draws new masks and the
    # rebuilt input is wrong (and so are the grads); the monitor says so.
    seq = make_seq(3, 8, dropout=0.5)
    seq.preserve_rng_state = False
    monitor_reconstruction(seq, threshold=1e-3)
    with pytest.warns(UserWarning, match="reconstruction monitor"):
        _step(seq)


def test_sampling_every_n_and_detach():
    seq = make_seq(2, 8)
    monitor = monitor_reconstruction(seq, threshold=1e-3, every=3)
    for _ in range(7):
        _step(seq)
    assert [step for step, _ in monitor.history] == [1, 4, 7]
    with torch.no_grad():  # a plain forward is not a sampled step
        seq(torch.randn(4, 8), torch.randn(4, 8))
    assert monitor.step == 7
    monitor.detach()
    _step(seq)
    assert monitor.step == 7 and seq.reconstruction_monitor is None


@pytest.mark.parametrize("engine", ["graphs", "compiled", "autograd"])
def test_engines_that_are_not_monitored_say_so(engine):
    seq = make_seq(2, 8, engine=engine)
    seq.compile_options = {"backend": "eager"}
    with pytest.warns(UserWarning, match=f"records nothing with engine='{engine}'"):
        monitor = monitor_reconstruction(seq)
    _step(seq)
    assert monitor.history == []


def test_a_rebuild_giving_nan_makes_max_error_nan():
    # F = log(relu(x)) is -inf where x <= 0: the rebuild x1 = y1 - F(x2) is (-inf) - (-inf) = NaN.
    # Python's max() over a list holding NaN depends on the order, so max_error hid it.
    class LogRelu(torch.nn.Module):
        def forward(self, x):
            return torch.log(torch.relu(x))

    torch.manual_seed(0)
    seq = ReversibleSequential(make_seq(1, 6).blocks[0], rk.nn.ReversibleBlock(LogRelu(), torch.nn.Tanh()))
    x1, x2 = torch.randn(3, 6), torch.randn(3, 6)
    x2[0, 0] = -1.0  # at least one -inf in F's output
    report = rk.check_reversibility(seq, x1, x2)
    assert math.isnan(report.block_errors[1][0]) and not math.isnan(report.block_errors[0][0])
    assert math.isnan(report.max_error)
    assert not report.max_error < 1e-4


def test_bad_arguments():
    with pytest.raises(ValueError, match="threshold"):
        ReconstructionMonitor(threshold=0)
    with pytest.raises(ValueError, match="every"):
        ReconstructionMonitor(every=0)
    with pytest.raises(ValueError, match="threshold must be a positive number, got '1e-3'"):
        ReconstructionMonitor(threshold="1e-3")
    with pytest.raises(ValueError, match="keep must be a positive int"):  # (keep=0 kept every entry)
        ReconstructionMonitor(keep=0)
    with pytest.raises(TypeError, match="seq"):
        monitor_reconstruction(rk.nn.ReversibleBlock(torch.nn.Identity(), torch.nn.Identity()))


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["sequential", "pareprop"])
def test_monitor_on_cuda_two_streams(engine):
    seq = make_seq(4, 8, engine=engine).cuda()
    monitor = monitor_reconstruction(seq, threshold=1e-4)
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1, y2 = seq(x, x)
        (y1.sum() + y2.square().sum()).backward()
    assert not _monitor_warnings(caught) and max(monitor.errors) < 1e-5
    block = seq.blocks[1]
    original = block.recompute
    block.recompute = lambda y1, y2, state=None: _noisy(original(y1, y2, state))
    with pytest.warns(UserWarning, match="block 1's input"):
        y1, y2 = seq(x, x)
        (y1.sum() + y2.square().sum()).backward()


def _noisy(rec):
    rec.x1 = rec.x1 + 1e-2 * torch.randn_like(rec.x1)
    return rec
