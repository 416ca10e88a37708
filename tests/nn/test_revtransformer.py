"""RevTransformerBlock: causal and masked attention, residual dropout; fused steps against ordinary
autograd through the same modules called with the same context."""
import warnings

import pytest
import torch
from torch import nn

import revkernels as rk
from tests.helpers import assert_close_rel, rel_err, run_grads

DIM, HEADS, BATCH, TOKENS = 16, 2, 3, 6


def _stack(depth, engine="sequential", **kwargs):
    seq = rk.nn.ReversibleSequential(*[rk.nn.RevTransformerBlock(DIM, HEADS, **kwargs) for _ in range(depth)],
                                     engine=engine)
    for block in seq.blocks:  # non-identity norms: a swapped parameter cannot pass
        for norm in (block.f.norm, block.g.norm):
            nn.init.normal_(norm.weight, 1.0, 0.3)
            nn.init.normal_(norm.bias, 0.0, 0.3)
    return seq


def _plain(seq, context):
    def forward(x1, x2):
        for block in seq.blocks:
            x1 = x1 + block.f(x2, **context)
            x2 = x2 + block.g(x1, **context)
        return x1, x2
    return forward


def _padding():
    mask = torch.ones(BATCH, TOKENS, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 2:] = False
    return mask


MASKS = {"none": lambda: None, "padding": _padding, "padding_float": lambda: (~_padding()).float() * -1e4,
         "additive_4d": lambda: torch.randn(BATCH, 1, TOKENS, TOKENS)}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_grads_equal_plain_autograd(causal, mask):
    seq = _stack(2, causal=causal, drop_path=0.2, dropout=0.2)
    attn_mask = MASKS[mask]()
    context = {} if attn_mask is None else {"attn_mask": attn_mask}
    x1, x2 = torch.randn(BATCH, TOKENS, DIM), torch.randn(BATCH, TOKENS, DIM)
    data = (x1, x2, torch.randn_like(x1), torch.randn_like(x2))
    expected = run_grads(_plain(seq, context), seq, *data, seed=5)
    for engine in ("sequential", "autograd"):
        seq.engine = engine
        actual = run_grads(lambda a, b: seq(a, b, **context), seq, *data, seed=5)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close_rel(a, e, 1e-5, f"{engine}: output/grad {i}")


def test_fused_steps_agree_with_the_generic_block_on_the_same_modules():
    seq = _stack(2, causal=True, dropout=0.3)
    generic = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(b.f, b.g) for b in seq.blocks])
    x1, x2 = torch.randn(BATCH, TOKENS, DIM), torch.randn(BATCH, TOKENS, DIM)
    data = (x1, x2, torch.randn_like(x1), torch.randn_like(x2))
    mask = _padding()
    fused = run_grads(lambda a, b: seq(a, b, attn_mask=mask), seq, *data, seed=3)
    plain = run_grads(lambda a, b: generic(a, b, attn_mask=mask), seq, *data, seed=3)
    for i, (a, e) in enumerate(zip(fused, plain)):
        assert_close_rel(a, e, 1e-5, f"output/grad {i}")


def test_causal_outputs_ignore_later_tokens():
    seq = _stack(3, causal=True).eval()
    x = torch.randn(BATCH, TOKENS, DIM)
    changed = x.clone()
    changed[:, 4:] = torch.randn(BATCH, TOKENS - 4, DIM)
    with torch.no_grad():
        y, z = seq(x, x), seq(changed, changed)
    for a, b in zip(y, z):
        assert_close_rel(b[:, :4], a[:, :4], 1e-6, "earlier positions")
        assert rel_err(b[:, 4:], a[:, 4:]) > 1e-2


def test_padded_keys_do_not_change_unpadded_outputs():
    seq = _stack(3).eval()
    mask = _padding()
    x = torch.randn(BATCH, TOKENS, DIM)
    changed = torch.where(mask[..., None], x, torch.randn_like(x))
    with torch.no_grad():
        y, z = seq(x, x, attn_mask=mask), seq(changed, changed, attn_mask=mask)
    for a, b in zip(y, z):
        assert_close_rel(b[mask], a[mask], 1e-6, "unpadded positions")


@pytest.mark.parametrize("causal", [False, True])
def test_rebuild_and_reverse_with_a_mask(causal):
    seq = _stack(3, causal=causal).eval()
    mask = _padding()
    x1, x2 = torch.randn(BATCH, TOKENS, DIM), torch.randn(BATCH, TOKENS, DIM)
    assert rk.check_reversibility(seq, x1, x2, attn_mask=mask).max_error < 1e-5
    w1, w2 = torch.randn_like(x1), torch.randn_like(x2)
    expected = run_grads(_plain(seq, {"attn_mask": mask}), seq, x1, x2, w1, w2)
    seq.zero_grad(set_to_none=True)
    r1, r2, dx1, dx2 = seq.reverse(expected[0], expected[1], w1, 2 * expected[1] * w2, attn_mask=mask)
    actual = [r1, r2, dx1, dx2] + [p.grad for p in seq.parameters()]
    for i, (a, e) in enumerate(zip(actual, [x1, x2] + expected[2:])):
        assert_close_rel(a, e, 1e-5, f"reverse output {i}")


def test_autocast_bf16_with_a_causal_mask_follows_the_low_precision_rule():
    seq = _stack(2, causal=True)
    mask = _padding()
    x1, x2 = torch.randn(BATCH, TOKENS, DIM), torch.randn(BATCH, TOKENS, DIM)
    data = (x1, x2, torch.randn_like(x1), torch.randn_like(x2))
    plain = _plain(seq, {"attn_mask": mask})
    exact = run_grads(plain, seq, *data, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        same_dtype = run_grads(plain, seq, *data, seed=0)
        ours = run_grads(lambda a, b: seq(a, b, attn_mask=mask), seq, *data, seed=0)
    for i, (o, s, e) in enumerate(zip(ours, same_dtype, exact)):
        assert rel_err(o, e) <= 2 * rel_err(s, e) + 1e-6, f"output/grad {i}"


def test_rev_vit_block_is_the_non_causal_case():
    block = rk.nn.RevViTBlock(DIM, HEADS)
    assert isinstance(block, rk.nn.RevTransformerBlock) and not block.f.causal and block.f.dropout.p == 0.0


def test_bad_masks_are_named():
    seq = _stack(1)
    x = torch.randn(BATCH, TOKENS, DIM)
    with pytest.raises(ValueError, match=r"2-D attn_mask is a key padding mask of shape \(batch, tokens\)"):
        seq(x, x, attn_mask=torch.ones(TOKENS, TOKENS, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must be"):
        seq(x, x, attn_mask=torch.ones(1, TOKENS, TOKENS, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must not require grad"):
        seq(x, x, attn_mask=torch.zeros(BATCH, TOKENS, requires_grad=True))
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor"):
        seq(x, x, attn_mask=[1, 0])
    # a 4-D mask that does not broadcast raised SDPA's size mismatch, naming no argument
    for shape in ((BATCH, 1, TOKENS, TOKENS + 1), (BATCH + 1, 1, TOKENS, TOKENS)):
        with pytest.raises(ValueError, match=r"attn_mask must be .* broadcastable to \(batch, heads, tokens, tokens\)"):
            seq(x, x, attn_mask=torch.ones(shape, dtype=torch.bool))
    # a tokenizer's 0/1 int64 attention_mask was added to the scores: padded keys attended
    for engine in ("sequential", "autograd"):
        seq.engine = engine
        with pytest.raises(TypeError, match=r"attn_mask must be bool .* got torch.int64: pass attention_mask.bool\(\)"):
            seq(x, x, attn_mask=torch.ones(BATCH, TOKENS, dtype=torch.long))


@pytest.mark.parametrize("engine", ["sequential", "autograd"])
def test_bad_stream_shapes_are_named(engine):
    seq = _stack(1)
    seq.engine = engine
    with pytest.raises(ValueError, match=rf"streams must be \(batch, tokens, dim={DIM}\), got shape \(2, 3, {DIM + 1}\)"):
        seq(torch.randn(2, 3, DIM + 1), torch.randn(2, 3, DIM + 1))  # was layer_norm's normalized_shape error
    with pytest.raises(ValueError, match=r"streams must be \(batch, tokens, dim"):
        seq(torch.randn(3, DIM), torch.randn(3, DIM))


@pytest.mark.parametrize("engine", ["sequential", "autograd"])
def test_a_context_keyword_no_branch_uses_is_named(engine):
    """revkernels' branches take **context only to ignore other branches' keywords: a misspelled
    mask keyword (revtext's own argument is attention_mask) ran the attention unmasked, silently."""
    seq = _stack(2)
    seq.engine = engine
    x = torch.randn(BATCH, TOKENS, DIM)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"no F or G of the run uses the context keyword\(s\) \['attention_mask'\]"):
        seq(x, x, attention_mask=mask)
    with pytest.raises(TypeError, match="no F or G of the run uses"):
        seq.inverse(x, x, attention_mask=mask)
    seq(x, x, attn_mask=mask)

    class Shift(nn.Module):  # a user's branch reading its keywords through **kwargs
        def forward(self, x, **context):
            return x * 0.5 + context["shift"]

    generic = rk.nn.ReversibleSequential(rk.nn.ReversibleBlock(Shift(), Shift()), engine=engine)
    generic(x, x, shift=torch.randn(DIM))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_autocast_with_a_padding_mask(causal):
    seq = _stack(3, causal=causal, dropout=0.1, drop_path=0.1).cuda()
    mask = _padding().cuda()
    x1, x2 = torch.randn(BATCH, TOKENS, DIM, device="cuda"), torch.randn(BATCH, TOKENS, DIM, device="cuda")
    data = (x1, x2, torch.randn_like(x1), torch.randn_like(x2))
    plain = _plain(seq, {"attn_mask": mask})
    exact = run_grads(plain, seq, *data, seed=0)
    for i, (a, e) in enumerate(zip(run_grads(lambda a, b: seq(a, b, attn_mask=mask), seq, *data, seed=0), exact)):
        assert_close_rel(a, e, 1e-5, f"fp32 output/grad {i}")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        same_dtype = run_grads(plain, seq, *data, seed=0)
        ours = run_grads(lambda a, b: seq(a, b, attn_mask=mask), seq, *data, seed=0)
    for i, (o, s, e) in enumerate(zip(ours, same_dtype, exact)):
        assert rel_err(o, e) <= 2 * rel_err(s, e) + 1e-6, f"output/grad {i}"


@pytest.mark.parametrize("engine", ["sequential", "pareprop", "compiled", "autograd"])
def test_a_mask_that_requires_grad_raises_on_every_engine(engine):
    # (the compiled engine's forward detached the context: its pure steps took the mask as one
    # more tensor to differentiate and gave it a grad)
    seq = _stack(2)
    seq.engine, seq.compile_options = engine, {"backend": "aot_eager"}
    x = torch.randn(BATCH, TOKENS, DIM, requires_grad=True)
    mask = torch.zeros(BATCH, TOKENS, requires_grad=True)
    with warnings.catch_warnings(record=True) as warned, pytest.raises(ValueError, match="attn_mask must not require grad"):
        warnings.simplefilter("always")
        seq(x, x, attn_mask=mask)
    assert not [str(w.message) for w in warned if "revkernels" in str(w.message)]  # (no step fell back)
    assert mask.grad is None
    y1, y2 = seq(x, x, attn_mask=mask.detach())  # (and the run goes on)
    assert y1.shape == x.shape
