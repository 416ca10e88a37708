"""Rev-Swin: window helpers against loop references, parameter counts, engines against autograd and
against an independent non-reversible reference of the two-stream model, PETRA's stage list."""
import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

import revkernels as rk
from revkernels.models.revswin import (
    CONFIGS,
    Head,
    PatchEmbed,
    PatchMerging,
    RevSwin,
    WindowAttention,
    relative_position_index,
    revswin,
    shifted_window_mask,
    window_partition,
    window_reverse,
)
from revkernels.petra import Trainer, partition
from tests.helpers import assert_close_rel

# A small model with two shifted stages (grids 16 and 8, window 4), a stage whose grid equals the
# window (4: global attention, no shift) and one smaller than it (2: window clipped to 2).
TINY = dict(embed_dim=8, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4), img_size=64, window_size=4)
CLASSES = 5


def _tiny(drop_path_rate=0.2, engine="sequential", **kwargs):
    model = revswin("swin_t", num_classes=CLASSES, drop_path_rate=drop_path_rate, engine=engine, **{**TINY, **kwargs})
    # Random, far from the identity and from the init (LayerNorm weights and biases, bias tables
    # included), at a trained network's scale: weights of std 1/sqrt(fan_in). (With std 0.5
    # everywhere the activations grow ~8x per layer and plain fp32 autograd itself is 3e-5 off fp64.)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm." in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() > 1 and not name.endswith("relative_position_bias_table"):
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
            else:
                p.copy_(0.5 * torch.randn_like(p))
    return model


# --- window helpers against loops ---------------------------------------------------------------------

def test_window_partition_and_reverse_match_loops():
    b, h, w, c, ws = 2, 8, 12, 3, 4
    x = torch.randn(b, h, w, c)
    windows = window_partition(x, ws)
    assert windows.shape == (b, (h // ws) * (w // ws), ws * ws, c)
    for n in range(b):
        for wr, wc in itertools.product(range(h // ws), range(w // ws)):
            for r, col in itertools.product(range(ws), range(ws)):
                assert torch.equal(windows[n, wr * (w // ws) + wc, r * ws + col], x[n, wr * ws + r, wc * ws + col])
    assert torch.equal(window_reverse(windows, ws, h, w), x)


def test_relative_position_index_matches_loops():
    ws = 3
    index = relative_position_index(ws)
    tokens = [(r, c) for r in range(ws) for c in range(ws)]
    expected = torch.empty(ws * ws, ws * ws, dtype=torch.long)
    for i, (ri, ci) in enumerate(tokens):
        for j, (rj, cj) in enumerate(tokens):
            expected[i, j] = (ri - rj + ws - 1) * (2 * ws - 1) + (ci - cj + ws - 1)
    assert torch.equal(index, expected)
    assert index.min() == 0 and index.max() == (2 * ws - 1) ** 2 - 1


@pytest.mark.parametrize("h,w,ws,shift", [(8, 8, 4, 2), (6, 9, 3, 1)])
def test_shift_mask_matches_region_labels(h, w, ws, shift):
    # The paper's construction: label the rolled grid by (row band, column band), bands
    # [0, n - ws), [n - ws, n - shift), [n - shift, n); a pair attends iff its labels agree.
    def band(v, n):
        return 0 if v < n - ws else 1 if v < n - shift else 2

    label = [[band(r, h) * 3 + band(c, w) for c in range(w)] for r in range(h)]
    mask = shifted_window_mask(h, w, ws, shift)
    assert mask.dtype == torch.bool and mask.shape == ((h // ws) * (w // ws), ws * ws, ws * ws)
    for wr, wc in itertools.product(range(h // ws), range(w // ws)):
        cells = [(wr * ws + r, wc * ws + c) for r in range(ws) for c in range(ws)]
        for i, (ri, ci) in enumerate(cells):
            for j, (rj, cj) in enumerate(cells):
                assert bool(mask[wr * (w // ws) + wc, i, j]) == (label[ri][ci] == label[rj][cj]), (wr, wc, i, j)


# --- parameter counts ---------------------------------------------------------------------------------

def _swin_count(embed_dim, depths, num_heads, window=7, side=56, classes=1000, mlp_ratio=4):
    """Swin's parameters from its definition (linear: in*out + out; LayerNorm: 2 * width)."""
    count = 3 * 16 * embed_dim + embed_dim + 2 * embed_dim  # 4x4 patch conv, LayerNorm
    for i, (depth, heads) in enumerate(zip(depths, num_heads)):
        c, grid = embed_dim * 2 ** i, side // 2 ** i
        w = min(window, grid)
        block = (2 * c + 3 * c * c + 3 * c + (2 * w - 1) ** 2 * heads + c * c + c  # LN, qkv, bias table, proj
                 + 2 * c + mlp_ratio * c * c + mlp_ratio * c + mlp_ratio * c * c + c)  # LN, fc1, fc2
        count += depth * block
        if i < len(depths) - 1:
            count += 2 * 4 * c + 4 * c * 2 * c  # merging: LayerNorm(4c), linear 4c -> 2c without bias
    c = embed_dim * 2 ** (len(depths) - 1)
    return count + 2 * c + c * classes + classes  # final LayerNorm, head


@pytest.mark.parametrize("name,millions", [("swin_t", 28.29), ("swin_s", 49.61), ("swin_b", 87.77)])
def test_parameter_counts_match_swin(name, millions):
    with torch.device("meta"):  # no storage: Swin-B's 88M parameters are never allocated
        model = revswin(name)
    count = sum(p.numel() for p in model.parameters())
    assert count == _swin_count(**CONFIGS[name])  # the same layers as Swin, one for one
    assert abs(count / 1e6 - millions) <= 0.02 * millions


# --- engines, and an independent reference of the model -------------------------------------------------

def _pair_tables(resolution, ws, shift):
    """For the token grid flattened row-major: which pairs attend and their bias-table row, from
    the geometric definition: same window of the grid rolled by (-shift, -shift), and adjacent
    before the roll (no wrap-around: |dr|, |dc| < ws); row (dr + ws - 1) * (2ws - 1) + dc + ws - 1
    (0 for pairs that do not attend)."""
    h, w = resolution
    n = h * w
    allowed = [[False] * n for _ in range(n)]
    row = [[0] * n for _ in range(n)]
    for i, j in itertools.product(range(n), range(n)):
        (ri, ci), (rj, cj) = divmod(i, w), divmod(j, w)
        same = ((ri - shift) % h) // ws == ((rj - shift) % h) // ws and ((ci - shift) % w) // ws == ((cj - shift) % w) // ws
        if same and abs(ri - rj) < ws and abs(ci - cj) < ws:
            allowed[i][j] = True
            row[i][j] = (ri - rj + ws - 1) * (2 * ws - 1) + (ci - cj + ws - 1)
    return torch.tensor(allowed), torch.tensor(row)


def _drop_path(x, p):
    """Stochastic depth as defined: one keep draw per sample from the global generator."""
    if p == 0.0:
        return x
    keep = torch.rand((x.shape[0], 1, 1)) >= p
    return x * keep.to(x.dtype) / (1.0 - p)


def _reference_attention(m, x, tables):
    """Attention over the whole token grid, restricted to the allowed pairs (no window partition)."""
    if (m.resolution, m.window_size, m.shift_size) not in tables:
        tables[m.resolution, m.window_size, m.shift_size] = _pair_tables(m.resolution, m.window_size, m.shift_size)
    allowed, row = tables[m.resolution, m.window_size, m.shift_size]
    b, n, c = x.shape
    hd = c // m.num_heads
    h = F.layer_norm(x, (c,), m.norm.weight, m.norm.bias, m.norm.eps)
    q, k, v = (h @ m.qkv.weight.t() + m.qkv.bias).view(b, n, 3, m.num_heads, hd).permute(2, 0, 3, 1, 4)
    bias = m.relative_position_bias_table[row].permute(2, 0, 1)  # (heads, n, n)
    scores = (q @ k.transpose(-1, -2)) / hd ** 0.5 + bias
    attn = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    o = (attn @ v).transpose(1, 2).reshape(b, n, c)
    return _drop_path(o @ m.proj.weight.t() + m.proj.bias, m.drop_path.p)


def _reference_mlp(g, x):
    h = F.layer_norm(x, (x.shape[-1],), g.norm.weight, g.norm.bias, g.norm.eps)
    h = F.gelu(h @ g.fc1.weight.t() + g.fc1.bias) @ g.fc2.weight.t() + g.fc2.bias
    return _drop_path(h, g.drop_path.p)


def _reference_forward(model, images, tables):
    """The model's two-stream math with plain autograd, from its parameters alone."""
    out = None
    for s in model.stages:
        if isinstance(s, PatchEmbed):
            t = F.conv2d(images, s.proj.weight, s.proj.bias, stride=s.proj.stride).flatten(2).transpose(1, 2)
            t = F.layer_norm(t, (t.shape[-1],), s.norm.weight, s.norm.bias, s.norm.eps)
            out = (t, t)
        elif isinstance(s, rk.nn.ReversibleBlock):
            x1, x2 = out
            x1 = x1 + _reference_attention(s.f, x2, tables)
            out = (x1, x2 + _reference_mlp(s.g, x1))
        elif isinstance(s, PatchMerging):
            (h, w), c = s.resolution, s.dim
            x = (out[0] + out[1]) / 2
            # token (r, c) of the merged grid: tokens (2r, 2c), (2r+1, 2c), (2r, 2c+1), (2r+1, 2c+1)
            idx = [[(2 * r + dr) * w + 2 * cc + dc for dr, dc in ((0, 0), (1, 0), (0, 1), (1, 1))]
                   for r in range(h // 2) for cc in range(w // 2)]
            z = x[:, torch.tensor(idx)].flatten(2)
            z = F.layer_norm(z, (4 * c,), s.norm.weight, s.norm.bias, s.norm.eps) @ s.reduction.weight.t()
            out = (z, z)
        else:
            assert isinstance(s, Head)
            x = F.layer_norm((out[0] + out[1]) / 2, (out[0].shape[-1],), s.norm.weight, s.norm.bias, s.norm.eps)
            return x.mean(dim=1) @ s.fc.weight.t() + s.fc.bias


def _loss_and_grads(model, forward, images, target, seed):
    model.zero_grad(set_to_none=True)
    images = images.clone().requires_grad_()
    torch.manual_seed(seed)
    logits = forward(images)
    F.cross_entropy(logits, target).backward()
    return [logits.detach(), images.grad] + [p.grad.clone() for p in model.parameters()]


# float64 in the two tests below: in fp32 the relative-position bias tables' grads (sums of softmax
# grads, whose rows sum to zero: heavy cancellation) differed from the reference's by up to 0.76e-5
# in 100 random draws, and by 1.12e-5 in a CI run; fp32 accuracy of the engines is tested on the
# blocks (tests/engine). Here a logic error (a shift, a mask, a drop-path replay, a table index)
# shows as an O(1) difference.
def test_forward_and_grads_equal_an_independent_reference():
    model = _tiny().double()
    images, target = torch.randn(2, 3, 64, 64, dtype=torch.float64), torch.randint(0, CLASSES, (2,))
    tables = {}
    want = _loss_and_grads(model, lambda x: _reference_forward(model, x, tables), images, target, seed=7)
    got = _loss_and_grads(model, model, images, target, seed=7)
    names = ["logits", "image grad"] + [n for n, _ in model.named_parameters()]
    for name, a, e in zip(names, got, want):
        assert_close_rel(a, e, 1e-5, name)


@pytest.mark.parametrize("engine", ["sequential", "pareprop"])
def test_engine_grads_equal_autograd(engine):
    model = _tiny(drop_path_rate=0.3, engine="autograd").double()
    images, target = torch.randn(3, 3, 64, 64, dtype=torch.float64), torch.randint(0, CLASSES, (3,))
    want = _loss_and_grads(model, model, images, target, seed=11)
    model.set_engine(engine)
    got = _loss_and_grads(model, model, images, target, seed=11)
    names = ["logits", "image grad"] + [n for n, _ in model.named_parameters()]
    for name, a, e in zip(names, got, want):
        assert_close_rel(a, e, 1e-5, f"{engine}: {name}")


def test_saved_activations_do_not_grow_with_depth():
    # Sequential engine: the stem and merges save their inputs, each run its two outputs, the head
    # its activations: the same bytes for 1 or 3 blocks per stage.
    def saved_bytes(depths):
        model = RevSwin(embed_dim=8, depths=depths, num_heads=(2, 2), num_classes=CLASSES, img_size=32, window_size=4)
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(2, 3, 32, 32))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    assert saved_bytes((1, 1)) == saved_bytes((3, 3))


# --- PETRA's stage list, engines, bad input ------------------------------------------------------------

def test_stages_for_petra():
    model = _tiny(drop_path_rate=0.0, engine="autograd")
    assert model.layout == "S r r D r r D r r D r r H"
    stages = partition(model)
    assert [s.kind for s in stages] == ["stem"] + ["reversible"] * 2 + (["down"] + ["reversible"] * 2) * 3 + ["head"]
    assert [s.module for s in stages] == model.stages
    assert [b for run in model.runs for b in run.blocks] == [s.module for s in stages if s.reversible]
    stage_params = [p for s in stages for p in s.module.parameters()]
    assert sorted(map(id, stage_params)) == sorted(map(id, model.parameters()))
    # One batch through the stage workers (reversible stages rebuild their inputs, the others pop
    # their FIFO) gives the end-to-end grads.
    images, target = torch.randn(2, 3, 64, 64), torch.randint(0, CLASSES, (2,))
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(images), target).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    outs = [images]
    for s in stages[:-1]:
        outs.append(s.forward(outs[-1]))
    *_, dy = stages[-1].forward_backward(outs[-1], target)
    for s, y in zip(reversed(stages[:-1]), reversed(outs[1:])):
        _, dy = s.backward(y, dy)
    for (name, p), e in zip(model.named_parameters(), want):
        assert_close_rel(p.grad, e, 1e-5, f"PETRA stage grad {name}")


def test_petra_trainer_steps():
    model = RevSwin(embed_dim=8, depths=(1, 1), num_heads=(2, 2), num_classes=CLASSES, img_size=16, window_size=2)
    before = copy.deepcopy(model.state_dict())
    trainer = Trainer(model, method="petra", base_lr=0.1)
    for _ in range(2):
        trainer.train_step(torch.randn(4, 3, 16, 16), torch.randint(0, CLASSES, (4,)))
    losses = [o["loss"] for o in trainer.flush() if o["loss"] is not None]
    assert trainer.num_stages == 5 and len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    # Stage j (1-based) ran each batch's backward 2 * (J - j) ticks after its forward.
    assert all(trainer.schedule[b, s]["backward"] - trainer.schedule[b, s]["forward"] == 2 * (4 - s)
               for b in range(2) for s in range(5))
    assert all(not torch.equal(before[k], v) for k, v in model.state_dict().items() if k.endswith("fc.weight"))


def test_set_engine_switches_every_run():
    with torch.device("meta"):
        model = revswin("swin_t", engine="autograd")
    assert model.engine == "autograd" and {run.engine for run in model.runs} == {"autograd"}
    assert model.set_engine("sequential") is model
    assert {run.engine for run in model.runs} == {"sequential"} and len(model.runs) == 4
    with pytest.raises(ValueError, match="engine must be one of"):
        model.set_engine("magic")
    assert model.engine == "sequential" and {run.engine for run in model.runs} == {"sequential"}


def test_structure_of_swin_t():
    with torch.device("meta"):
        model = revswin("swin_t")
    attn = [s.f for s in model.stages if isinstance(s, rk.nn.ReversibleBlock)]
    assert type(model.stages[1]) is rk.nn.ReversibleBlock and all(isinstance(f, WindowAttention) for f in attn)
    assert [(f.resolution[0], f.window_size, f.shift_size) for f in attn] == (
        [(56, 7, 0), (56, 7, 3), (28, 7, 0), (28, 7, 3)] + [(14, 7, 0), (14, 7, 3)] * 3 + [(7, 7, 0)] * 2)
    rates = [f.drop_path.p for f in attn]
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.1)
    assert rates == pytest.approx([0.1 * k / 11 for k in range(12)])


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"name must be one of \['swin_b', 'swin_s', 'swin_t'\], got 'swin_l'"):
        revswin("swin_l")
    with pytest.raises(ValueError, match="img_size"):
        revswin("swin_t", img_size=230)
    with pytest.raises(ValueError, match="window_size"):
        revswin("swin_t", img_size=96, window_size=7)  # grids 24, 12, ...: not multiples of 7
    with pytest.raises(ValueError, match="depths and num_heads"):
        revswin("swin_t", depths=(2, 2), num_heads=(3, 6, 12))
    with pytest.raises(ValueError, match="num_classes must be a positive int"):
        revswin("swin_t", num_classes=0)
    model = RevSwin(embed_dim=8, depths=(1, 1), num_heads=(2, 2), num_classes=CLASSES, img_size=16, window_size=2)
    with pytest.raises(ValueError, match=r"images must be a float tensor \(batch, channels, 16, 16\)"):
        model(torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match=r"images must be a float tensor .* got torch.int64"):
        model(torch.randint(0, 255, (1, 3, 16, 16)))


@pytest.mark.parametrize("engine", ["autograd", "sequential"])
def test_an_empty_batch_gives_an_empty_output(engine):
    """A batch of 0 images (the windows' reshapes inferred a size from it and raised)."""
    model = RevSwin(embed_dim=8, depths=(1, 1), num_heads=(2, 2), num_classes=CLASSES, img_size=16, window_size=2,
                    engine=engine)
    images = torch.randn(0, 3, 16, 16, requires_grad=True)
    out = model(images)
    assert out.shape == (0, CLASSES)
    out.sum().backward()
    assert images.grad.shape == images.shape
