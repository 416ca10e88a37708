"""revkernels.engine: the engine names and ``engine="auto"``, the default."""
import logging
import types

import pytest
import torch

import revkernels as rk
from revkernels.engine import choose_engine, get_engine
from tests.helpers import assert_close_rel, loss_of, make_seq, perturb_parameters, plain_forward, run_grads


def test_auto_is_the_default_and_runs_the_sequential_engine_on_cpu(caplog):
    torch.manual_seed(0)
    seq = perturb_parameters(rk.nn.ReversibleSequential(*make_seq(3, 8).blocks))
    assert seq.engine == "auto" and seq.engine_in_use is None
    data = [torch.randn(4, 8) for _ in range(4)]
    with caplog.at_level(logging.DEBUG, logger="revkernels"):
        got = run_grads(seq, seq, *data)
        run_grads(seq, seq, *data)
    assert seq.engine_in_use == "sequential"
    assert [r.getMessage() for r in caplog.records] == [
        "revkernels: engine='auto' runs ReversibleSequential with the sequential engine"]  # said once
    expected = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data)
    for a, e in zip(got, expected, strict=True):
        assert_close_rel(a, e)


def test_auto_saves_only_the_runs_outputs():
    # what makes the pick a memory-saving engine: the saved bytes do not grow with depth
    def saved(depth):
        seq = rk.nn.ReversibleSequential(*make_seq(depth, 16).blocks)
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        x = torch.randn(4, 16, requires_grad=True)
        params = {id(p) for p in seq.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(lambda t: pack(t) if id(t) not in params else t, lambda t: t):
            y1, y2 = seq(x, x)
        loss_of(y1, y2, 1.0, 1.0).backward()
        return total[0]

    assert saved(2) == saved(8) > 0


def test_auto_picks_graphs_for_a_capturable_cuda_run_and_sequential_otherwise():
    cuda = types.SimpleNamespace(is_cuda=True)  # (only where the inputs live is read)
    seq = make_seq(2, 8, dropout=0.1)
    assert choose_engine(seq, cuda, {}) == "sequential"  # dropout to replay
    seq.eval()
    assert choose_engine(seq, cuda, {}) == "graphs"
    assert choose_engine(seq, cuda, {"mask": None}) == "sequential"  # context keywords
    assert choose_engine(seq, torch.randn(2, 8), {}) == "sequential"  # CPU


def test_engine_names_are_checked():
    assert get_engine("auto") is None and get_engine("sequential") is rk.engine.run_sequential
    with pytest.raises(ValueError, match=r"engine must be one of \['auto', 'autograd', 'compiled', 'graphs'"):
        rk.nn.ReversibleSequential(*make_seq(1, 4).blocks, engine="fast")
