"""revkernels.nn.attention: which SDPA kernel a compiled CPU graph calls, and values and grads of
both ways against a float64 reference."""
import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch.func import vjp

from revkernels.engine.compiled import isolated
from revkernels.nn.attention import MATH_MAX_KEYS, scaled_dot_product_attention, uses_math
from tests.helpers import assert_close_rel

HEADS, HEAD_DIM = 2, 8
FLASH = "_scaled_dot_product_flash_attention"


def _attention_step(q, k, v, mask, d_out, causal):
    """The helper's output and (dq, dk, dv), as the compiled engine's steps take them (torch.func)."""
    out, pull = vjp(lambda a, b, c: scaled_dot_product_attention(a, b, c, attn_mask=mask, is_causal=causal), q, k, v)
    return out, *pull(d_out)


def _compiled_step(**compile_kwargs):
    """`_attention_step` compiled as a code object of its own, so the tests' compiles do not pile up
    as recompiles of one function against Dynamo's limit."""
    return torch.compile(isolated(_attention_step), fullgraph=True, dynamic=False, **compile_kwargs)


def _reference(q, k, v, mask, d_out, causal):
    """softmax(q k^T / sqrt(d) + mask) v and its VJP by autograd, in float64."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores + mask.double()
    if causal:
        tokens = q.shape[-2]
        future = torch.ones(tokens, tokens, dtype=torch.bool).triu_(1)
        scores = scores.masked_fill(future, float("-inf"))
    out = scores.softmax(-1) @ v
    return out.detach(), *torch.autograd.grad(out, (q, k, v), d_out.double())


def _inputs(tokens, with_mask):
    q, k, v, d_out = (torch.randn(2, HEADS, tokens, HEAD_DIM) for _ in range(4))
    mask = torch.randn(2, 1, tokens, tokens) if with_mask else None
    return q, k, v, mask, d_out


def _compiled_ops(tokens, causal):
    """The aten ops of the compiled step's graph (aot_eager: the graph inductor would get)."""
    backend = AotEagerAndRecordGraphs()
    q, k, v, mask, d_out = _inputs(tokens, with_mask=False)
    _compiled_step(backend=backend)(q, k, v, mask, d_out, causal)
    return {str(node.target) for graph in backend.fw_graphs for node in graph.graph.nodes if node.op == "call_function"}


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_cpu_graph_takes_the_math_formula_up_to_the_key_limit(causal):
    short = _compiled_ops(MATH_MAX_KEYS, causal)
    assert not any(FLASH in op for op in short), sorted(short)
    assert any("bmm" in op for op in short), sorted(short)
    long = _compiled_ops(MATH_MAX_KEYS + 1, causal)
    assert any(FLASH in op for op in long), sorted(long)


def test_eager_calls_take_the_default_kernel():
    q, k = torch.randn(1, 1, 4, HEAD_DIM), torch.randn(1, 1, 4, HEAD_DIM)
    assert not uses_math(q, k)


@pytest.mark.parametrize("tokens,with_mask,causal", [(9, True, False), (9, False, True)])
def test_compiled_math_formula_matches_float64(tokens, with_mask, causal):
    q, k, v, mask, d_out = _inputs(tokens, with_mask)
    actual = _compiled_step()(q, k, v, mask, d_out, causal)
    for i, (a, e) in enumerate(zip(actual, _reference(q, k, v, mask, d_out, causal))):
        assert_close_rel(a, e, 1e-5, f"output/grad {i}")


@pytest.mark.parametrize("tokens", [9, MATH_MAX_KEYS + 1])
def test_eager_and_compiled_calls_on_both_sides_of_the_limit_match_float64(tokens):
    q, k, v, mask, d_out = _inputs(tokens, with_mask=True)
    expected = _reference(q, k, v, mask, d_out, False)
    eager = _attention_step(q, k, v, mask, d_out, False)
    compiled = _compiled_step(backend="aot_eager")(q, k, v, mask, d_out, False)
    for name, actual in (("eager", eager), ("compiled", compiled)):
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close_rel(a, e, 1e-5, f"{name} output/grad {i}")
