"""Shared test utilities: error measures, small reversible stacks and their plain-autograd twin."""
import os
import subprocess
import sys

import torch
from torch import nn

import revkernels as rk
from revkernels.nn import DropPath


# Engines whose code differs on CPU. "pareprop" and "graphs" run the sequential engine's walker on
# CPU (tests/engine/test_pareprop.py and test_graphs.py assert that, bitwise), so a CPU test listing
# them would count the sequential code three times; their own code is tested on CUDA (`gpu` marks).
CPU_ENGINES = ["autograd", "sequential"]


def rel_err(actual, expected):
    """max |actual - expected| / max |expected|, in float64."""
    expected = expected.double()
    scale = expected.abs().max().clamp_min(1e-30)
    return ((actual.double() - expected).abs().max() / scale).item()


def assert_close_rel(actual, expected, tol=1e-5, what="tensor"):
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def residual_fn(width, dropout=0.0, drop_path=0.0, norm="layer", act=nn.GELU):
    """A shape-preserving residual function: norm -> linear -> `act` -> linear (-> dropout, drop-path)."""
    layers = [nn.LayerNorm(width) if norm == "layer" else nn.BatchNorm1d(width),
              nn.Linear(width, 2 * width), act(), nn.Linear(2 * width, width)]
    if dropout:
        layers.append(nn.Dropout(dropout))
    if drop_path:
        layers.append(DropPath(drop_path))
    return nn.Sequential(*layers)


def make_seq(depth, width, engine="sequential", **fn_kwargs):
    blocks = [rk.nn.ReversibleBlock(residual_fn(width, **fn_kwargs), residual_fn(width, **fn_kwargs)) for _ in range(depth)]
    return rk.nn.ReversibleSequential(*blocks, engine=engine)


@torch.no_grad()
def scale_branch_outputs(seq, factor):
    """Multiplies the weight of the last `nn.Linear` of every block's F and G in `seq` (a `make_seq`
    run) by `factor`. Returns `seq`."""
    for block in seq.blocks:
        for fn in (block.f, block.g):
            [m for m in fn.modules() if isinstance(m, nn.Linear)][-1].weight.mul_(factor)
    return seq


def plain_forward(seq, x1, x2):
    """The run's function written out with ordinary autograd, independent of revkernels' engines."""
    for block in seq.blocks:
        x1 = x1 + block.f(x2)
        x2 = x2 + block.g(x1)
    return x1, x2


FRACTION_BITS = 32  # exact mode's default grid, 2^-32


class _ValueWithGrad(torch.autograd.Function):
    """`value` forward, the gradient of `like` backward (a straight-through rounding)."""

    @staticmethod
    def forward(ctx, like, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _grid(t):
    # t on the grid as int64: rounded half to even after an exact scaling by a power of two
    return torch.round((t.detach().double() if t.dtype == torch.float64 else t.detach().float())
                       * 2.0 ** FRACTION_BITS).long()


def _view(fixed, dtype):
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (fixed.to(wide) * 2.0 ** -FRACTION_BITS).to(dtype)


def fixed_point_forward(blocks, x1, x2, context=None):
    """Exact mode's network written out with plain autograd: int64 streams on a 2^-32 grid, every
    block's F and G on the streams' float views, their outputs rounded onto the grid and added as
    integers, straight-through gradients. Half-coupling blocks (`HalfCouplingBlock`) swap."""
    context = context or {}
    dtype = x1.dtype
    s1, s2 = _grid(x1), _grid(x2)
    v1, v2 = _ValueWithGrad.apply(x1, _view(s1, dtype)), _ValueWithGrad.apply(x2, _view(s2, dtype))
    for block in blocks:
        f = block.f(v2, **context)
        n1 = s1 + _grid(f)
        nv1 = _ValueWithGrad.apply(v1 + f.to(dtype), _view(n1, dtype))
        if isinstance(block, rk.nn.HalfCouplingBlock):
            (s1, v1), (s2, v2) = (s2, v2), (n1, nv1)
            continue
        g = block.g(nv1, **context)
        n2 = s2 + _grid(g)
        (s1, v1), (s2, v2) = (n1, nv1), (n2, _ValueWithGrad.apply(v2 + g.to(dtype), _view(n2, dtype)))
    return v1, v2


def loss_of(y1, y2, w1, w2):
    """A loss that gives both outputs non-trivial, different gradients."""
    return (y1 * w1).sum() + (y2.square() * w2).sum()


def run_grads(fn, module, x1, x2, w1, w2, seed=None):
    """Runs ``fn(x1, x2)`` on fresh leaf copies of the streams and backpropagates `loss_of`;
    returns ``[y1, y2, dx1, dx2, *param grads of module]`` (grads cleared first)."""
    for p in module.parameters():
        p.grad = None
    a1, a2 = x1.detach().clone().requires_grad_(), x2.detach().clone().requires_grad_()
    if seed is not None:
        torch.manual_seed(seed)
    y1, y2 = fn(a1, a2)
    loss_of(y1, y2, w1, w2).backward()
    return [y1.detach(), y2.detach(), a1.grad, a2.grad] + grads_of(module.parameters())


class CountingBackend:
    """A Dynamo backend that counts the graphs it is given (`graphs`) and the calls of them (`calls`),
    notes the ops of the last graph (`ops`, `count`), and runs them as traced, or compiled by the
    backend named `inner` ("aot_eager": autograd sees the traced graph's own backward)."""

    def __init__(self, inner=None):
        self.graphs = 0
        self.calls = 0
        self.ops = []
        self.inner = inner

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.ops = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
        run = gm.forward if self.inner is None else torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)

        def counted(*args):
            self.calls += 1
            return run(*args)
        return counted

    def count(self, name):
        """How many ops of the last graph have `name` in their name."""
        return sum(name in op for op in self.ops)


def compiled_saved_bytes(seq, x, **context):
    """Bytes autograd saves, parameters and the run's handle (a 0-d int64 input of the opaque ops,
    `revkernels.engine.opaque.new_handle`) aside, in one step of ``seq(x, x, **context)`` under
    ``torch.compile(fullgraph=True)`` (aot_eager backend)."""
    params = {id(p) for p in seq.parameters()} | {id(seq._opaque_handle)}
    total = [0]

    def pack(t):
        if id(t) not in params:
            total[0] += t.numel() * t.element_size()
        return t

    fn = torch.compile(lambda a, b, c: seq(a, b, **c), fullgraph=True, backend="aot_eager")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y1, y2 = fn(x, x, context)
    loss_of(y1, y2, 1.0, 1.0).backward()
    return total[0]


def grads_of(params):
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def run_without_c_extension(body):
    """Runs `body` in a fresh interpreter where `revkernels._C` cannot be imported; it must print
    'ok'. The preamble hides the library before anything imports revkernels, and defines
    ``expect_error(call, message)``: `call()` must raise ValueError or TypeError saying `message`."""
    code = ("import sys, warnings\nsys.modules['revkernels._C'] = None\n"
            "def expect_error(call, message):\n"
            "    try:\n"
            "        call()\n"
            "    except (ValueError, TypeError) as e:\n"
            "        assert message in str(e), e\n"
            "    else:\n"
            "        raise AssertionError(f'no error: {message}')\n" + body)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def triton_device():
    """Where the Triton kernels run in tests: CUDA when present, else the CPU under the Triton
    interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before any kernel module is imported)."""
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
        return "cpu"
    return "cuda"


@torch.no_grad()
def perturb_parameters(module, scale=0.25, buffers=True):
    """Moves every vector parameter of `module` (norm weights and biases, linear and conv biases,
    the parameters initialised to 1 or 0) off its initial value by `scale` * N(0, 1) noise, so no
    LayerNorm/BatchNorm weight is 1, no bias is 0 and F's and G's parameters differ: a fused step
    that reads the wrong parameter (F's LayerNorm for G's, a weight for a bias) gives a wrong result
    instead of the same one. Weight matrices and kernels keep their (random) initialisation: noise
    of this size on them would make the blocks' Jacobians large enough that the fp32 rebuild error
    of a deep reversible run, amplified by them, exceeds the 1e-5 tolerance without any bug (the
    rebuild is as exact as the arithmetic; the conditioning of the function is the test's choice).
    With `buffers`, BatchNorm running statistics move too (means by noise, variances by a factor
    in [0.5, 1.5]), so eval-mode paths read non-trivial statistics. Returns `module`."""
    for p in module.parameters():
        if p.is_floating_point() and p.dim() <= 1:
            p.add_(scale * torch.randn_like(p))
    if buffers:
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.add_(scale * torch.randn_like(m.running_mean))
                m.running_var.mul_(0.5 + torch.rand_like(m.running_var))
    return module


def assert_low_precision_rule(actual, same_dtype_torch, exact, what="tensor"):
    """The rule for bf16/fp16 results (docs/design.md): the error against an exact (float64) reference is at
    most twice the error of the same-dtype PyTorch op (relative to max |exact|)."""
    ours, torch_err = rel_err(actual, exact), rel_err(same_dtype_torch, exact)
    assert ours <= 2 * torch_err, f"{what}: relative error {ours:.3e} > 2 x PyTorch's {torch_err:.3e}"


class TrackingLinear(nn.Module):
    """A linear layer that uses its buffers, then changes them in a training forward: `shift` in
    place (add saves nothing, so plain autograd allows it), `scale` assigned anew (an EMA of the
    input's spread), `steps` counted in place; `late` in place once `change_late` is set."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("shift", torch.randn(width))
        self.register_buffer("scale", torch.rand(()) + 0.5)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("late", torch.randn(width))
        self.change_late = False

    def forward(self, x):
        y = torch.tanh(self.linear(x) / self.scale + self.shift + self.late)
        if self.training:
            with torch.no_grad():
                self.shift.add_(x.mean(0))
                self.scale = 0.9 * self.scale + 0.1 * x.std()
                if self.change_late:
                    self.late.mul_(0.5)
                self.steps += 1
        return y


def record_relu_input_signs(model):
    """Records, per call, the signs of every BatchNorm output that feeds a ReLU inside the
    reversible stages of a RevNet (in F, every BN but the last). A rebuilding engine records each
    twice: forward, then recompute at the rebuilt input (see `relu_kink_crossings`)."""
    records = []
    for stage in model.stages:
        if stage.reversible:
            for bn in [m for m in stage.f.children() if isinstance(m, nn.BatchNorm2d)][:-1]:
                record = []
                bn.register_forward_hook(lambda mod, args, out, record=record: record.append(out.detach() > 0))
                records.append(record)
    return records


def relu_kink_crossings(records):
    """How many ReLU inputs changed sign between the forward and the recompute. A rebuilt input is
    exact to ~1e-6 relative; where that moves a ReLU input across zero, the recompute differentiates
    the other side of the kink (a real fp32 effect of any rebuild), so that draw cannot be compared
    with plain autograd at 1e-5 and the caller draws again."""
    assert records and all(len(r) == 2 for r in records), "each F should run once forward, once in the recompute"
    return sum(int((r[0] != r[1]).sum()) for r in records)
