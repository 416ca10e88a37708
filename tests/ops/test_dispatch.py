"""Issue 12: the ops dispatch without Python. Their autograd formulas are C++ (Autograd-key kernels in
csrc/ops/<family>_autograd.cpp) and their argument checks run in the C++ kernels, so a CPU call under
autograd, forward and backward, never enters the interpreter; the entry points `revkernels.ops.<op>`
are the ops themselves. Here: that no Python runs, the C++ formulas' gradients against plain
autograd through the pure-PyTorch references (all and partial requires_grad), the checks reached
through the autograd kernels, and the Python path that remains without the compiled library."""
import sys

import pytest
import torch

import revkernels as rk
from revkernels.ops import (batch_norm_act_reference, bias_gelu_reference, coupling_add_reference,
                            coupling_sub_reference, linear_sub_reference, sub_layer_norm_reference)
from revkernels.ops._library import has_compiled_kernel
from tests.helpers import assert_close_rel, run_without_c_extension

R = torch.ops.revkernels
EPS = 1e-5
DIFFERENTIABLE = ["coupling_sub", "coupling_add", "sub_layer_norm", "bias_gelu", "linear_sub", "batch_norm_act"]


def _randn(*shape, dtype, offset=0.0):
    return (torch.randn(*shape, dtype=torch.float64) + offset).to(dtype)


def _case(name, dtype):
    """(tensor inputs, the op on them, the pure-PyTorch reference on them, number of differentiable
    outputs: the leading ones)."""
    if name in ("coupling_sub", "coupling_add"):
        reference = coupling_sub_reference if name == "coupling_sub" else coupling_add_reference
        return ([_randn(6, 33, dtype=dtype, offset=0.5), _randn(6, 33, dtype=dtype)], getattr(R, name), reference, 1)
    if name == "sub_layer_norm":
        inputs = [_randn(2, 5, 33, dtype=dtype, offset=0.5), _randn(2, 5, 33, dtype=dtype),
                  _randn(33, dtype=dtype, offset=1.0), _randn(33, dtype=dtype)]
        return (inputs, lambda *t: R.sub_layer_norm(*t, EPS), lambda *t: sub_layer_norm_reference(*t, EPS), 2)
    if name == "bias_gelu":
        return ([_randn(7, 40, dtype=dtype), _randn(40, dtype=dtype)], lambda *t: R.bias_gelu(*t, "tanh"),
                lambda *t: bias_gelu_reference(*t, "tanh"), 1)
    if name == "linear_sub":
        inputs = [_randn(3, 4, 24, dtype=dtype), _randn(3, 4, 16, dtype=dtype), _randn(24, 16, dtype=dtype) / 4,
                  _randn(24, dtype=dtype)]
        return inputs, R.linear_sub, linear_sub_reference, 1
    inputs = [_randn(4, 3, 5, 5, dtype=dtype, offset=0.5), _randn(3, dtype=dtype, offset=1.0), _randn(3, dtype=dtype)]
    return (inputs, lambda *t: R.batch_norm_act(*t, EPS, True), lambda *t: batch_norm_act_reference(*t, EPS, True), 1)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _python_code_entered(fn, *args):
    """The code objects of the Python functions that run while `fn(*args)` does."""
    entered = []

    def profile(frame, event, arg):
        if event == "call":
            entered.append(frame.f_code)

    sys.setprofile(profile)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
    return out, entered


# Entry points whose Python scalars (eps, relu) are checked before the op is called: the schema
# parser would turn relu=None into False and eps=True into 1.0 silently.
SCALAR_CHECKED = {"sub_layer_norm", "batch_norm_act", "batch_norm_act_bwd"}


def test_autograd_kernels_are_compiled():
    assert rk.HAS_C_EXTENSION, rk._extension.C_EXTENSION_ERROR
    for name in DIFFERENTIABLE:
        assert has_compiled_kernel(name, "Autograd"), name
        if name in SCALAR_CHECKED:  # a Python scalar check, then the op (tests/ops: scalars rejected)
            assert getattr(rk.ops, name).__name__ == name
        else:
            assert getattr(rk.ops, name) is getattr(R, name), f"revkernels.ops.{name} is not the op itself"


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_no_python_under_autograd(name):
    inputs, _, _, n_diff = _case(name, torch.float32)
    leaves = [t.requires_grad_() for t in inputs]
    op = getattr(R, name)
    extra = {"sub_layer_norm": (EPS,), "bias_gelu": ("tanh",), "batch_norm_act": (EPS, True)}.get(name, ())
    # Forward: the only Python is torch.ops' own call wrapper (OpOverloadPacket.__call__).
    out, entered = _python_code_entered(op, *leaves, *extra)
    assert entered == [type(op).__call__.__code__], [f"{c.co_filename}:{c.co_name}" for c in entered]
    outs = _as_tuple(out)
    assert all(o.requires_grad for o in outs[:n_diff]) and not any(o.requires_grad for o in outs[n_diff:])
    # Backward: the graph node the op made, applied to cotangents of all its outputs, runs no Python.
    grads, entered = _python_code_entered(outs[0].grad_fn, *[torch.randn_like(o) for o in outs])
    assert entered == [], [f"{c.co_filename}:{c.co_name}" for c in entered]
    assert len(grads) == len(leaves) and all(g is not None for g in grads)


@pytest.mark.parametrize("name,args", [
    ("layer_norm_bwd_add", lambda: (torch.randn(4, 9), torch.randn(4, 9), torch.randn(9), torch.randn(4),
                                    torch.rand(4) + 0.5, torch.randn(4, 9))),
    ("bias_gelu_bwd", lambda: (torch.randn(4, 9), torch.randn(4, 9), torch.randn(9))),
    ("batch_norm_act_bwd", lambda: (torch.randn(4, 3, 2), torch.randn(4, 3, 2), torch.randn(3), torch.randn(3),
                                    torch.randn(3), torch.rand(3) + 0.5)),
])
def test_no_python_in_backward_ops(name, args):
    op = getattr(R, name)
    _, entered = _python_code_entered(op, *[t.requires_grad_() for t in args()])
    assert entered == [type(op).__call__.__code__], [f"{c.co_filename}:{c.co_name}" for c in entered]


@pytest.mark.parametrize("name", DIFFERENTIABLE)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_grads_match_plain_autograd(name, dtype, tol):
    """Each input alone requiring grad, then all of them: the C++ formula's grads against autograd
    through the reference in float64."""
    inputs, op, reference, n_diff = _case(name, dtype)
    subsets = [[i] for i in range(len(inputs))] + [list(range(len(inputs)))]
    for subset in subsets:
        leaves = [t.detach().clone().requires_grad_(i in subset) for i, t in enumerate(inputs)]
        exact_leaves = [t.detach().double().requires_grad_(i in subset) for i, t in enumerate(inputs)]
        outs = _as_tuple(op(*leaves))[:n_diff]
        exact_outs = _as_tuple(reference(*exact_leaves))[:n_diff]
        cotangents = [torch.randn(o.shape, dtype=torch.float64) for o in exact_outs]
        # sum(out * cotangent): the cotangents reach the outputs exactly; a reference output that
        # does not depend on the inputs requiring grad drops out.
        loss = sum((o * c.to(dtype)).sum() for o, c in zip(outs, cotangents))
        exact_loss = sum((o * c).sum() for o, c in zip(exact_outs, cotangents) if o.requires_grad)
        got = torch.autograd.grad(loss, [leaves[i] for i in subset])
        want = torch.autograd.grad(exact_loss, [exact_leaves[i] for i in subset])
        for i, g, w in zip(subset, got, want):
            assert g.dtype == dtype and g.shape == inputs[i].shape, f"{name} input {i}"
            assert_close_rel(g, w, tol, f"{name} grad of input {i} (requires_grad: {subset})")
        assert all(leaf.grad is None for leaf in leaves)


@pytest.mark.parametrize("name", DIFFERENTIABLE)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_forward_mode_ad_raises_instead_of_dropping_the_tangent(name, requires_grad):
    import torch.autograd.forward_ad as fwAD

    inputs, op, _, _ = _case(name, torch.float64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(inputs[0].requires_grad_(requires_grad), torch.randn_like(inputs[0]))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            op(dual, *inputs[1:])


def test_linear_sub_without_bias_grads():
    y, a, w = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (y, a, w)]
    exact = [t.clone().requires_grad_() for t in (y, a, w)]
    g = torch.randn(5, 8, dtype=torch.float64)
    got = torch.autograd.grad(R.linear_sub(*leaves), leaves, g)
    want = torch.autograd.grad(linear_sub_reference(*exact), exact, g)
    for gi, wi, what in zip(got, want, ("y", "a", "weight")):
        assert_close_rel(gi, wi, 1e-10, what)


def test_grads_in_the_second_inputs_dtype():
    """Mixed dtypes: the grad of a bf16 f (or g, bias) is the fp32 grad rounded once to bf16."""
    y, f = torch.randn(4, 33, requires_grad=True), torch.randn(4, 33).bfloat16().requires_grad_()
    cot = torch.randn(4, 33)
    dy, df = torch.autograd.grad(R.coupling_sub(y, f), (y, f), cot)
    assert torch.equal(dy, cot) and df.dtype == torch.bfloat16 and torch.equal(df, (-cot).bfloat16())
    da, db = torch.autograd.grad(R.coupling_add(y, f), (y, f), cot)
    assert torch.equal(da, cot) and torch.equal(db, cot.bfloat16())
    w, b = torch.randn(33, requires_grad=True), torch.randn(33).bfloat16().requires_grad_()
    x, ln, _, _ = R.sub_layer_norm(y, f, w, b)
    dy, df, dw, db = torch.autograd.grad((x, ln), (y, f, w, b), (cot, torch.randn(4, 33)))
    assert (dy.dtype, df.dtype, dw.dtype, db.dtype) == (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)
    assert torch.equal(df, (-dy).bfloat16())


def test_unused_outputs_get_zero_grads():
    """Only ln used: the grad of x is taken as zero (as with materialised grads in Python)."""
    y, g = torch.randn(3, 17, requires_grad=True), torch.randn(3, 17, requires_grad=True)
    w, b = torch.randn(17, requires_grad=True), torch.randn(17, requires_grad=True)
    cot = torch.randn(3, 17)
    got = torch.autograd.grad(R.sub_layer_norm(y, g, w, b, EPS)[1], (y, g, w, b), cot)
    exact = [t.detach().double().requires_grad_() for t in (y, g, w, b)]
    want = torch.autograd.grad(sub_layer_norm_reference(*exact, EPS)[1], exact, cot.double())
    for gi, wi in zip(got, want):
        assert_close_rel(gi, wi, 1e-5)


def test_inputs_are_not_mutated():
    for name in DIFFERENTIABLE:
        inputs, op, _, n_diff = _case(name, torch.float32)
        leaves = [t.requires_grad_() for t in inputs]
        before = [t.detach().clone() for t in leaves]
        outs = _as_tuple(op(*leaves))[:n_diff]
        torch.autograd.grad(outs, leaves, [torch.randn_like(o) for o in outs])
        assert all(torch.equal(t.detach(), b) for t, b in zip(leaves, before)), name


def _rg(*shape):
    return torch.randn(*shape, requires_grad=True)


@pytest.mark.parametrize("error,message,call", [
    (ValueError, "f must have the shape of y", lambda: R.coupling_sub(_rg(3, 4), _rg(4, 3))),
    (TypeError, "b must be float32", lambda: R.coupling_add(_rg(3), torch.ones(3, dtype=torch.int64))),
    (ValueError, "f must be on the device of y", lambda: R.coupling_sub(_rg(3), torch.randn(3, device="meta"))),
    (ValueError, r"weight must have shape \(33,\)", lambda: R.sub_layer_norm(_rg(4, 33), _rg(4, 33), _rg(5), _rg(33))),
    (ValueError, "eps must be finite and non-negative", lambda: R.sub_layer_norm(_rg(4, 33), _rg(4, 33), _rg(33), _rg(33), -1.0)),
    (ValueError, "approximate must be 'none' or 'tanh', got 'erf'", lambda: R.bias_gelu(_rg(3, 4), _rg(4), "erf")),
    (TypeError, "x must be float32", lambda: R.bias_gelu(torch.ones(3, 4, dtype=torch.int32), _rg(4))),
    (ValueError, r"bias must have shape \(3,\)", lambda: R.batch_norm_act(_rg(2, 3, 4), _rg(3), _rg(2))),
    (ValueError, "eps must be finite and non-negative", lambda: R.batch_norm_act(_rg(2, 3), _rg(3), _rg(3), float("inf"))),
    (ValueError, r"bias must have shape \(6,\)", lambda: R.linear_sub(_rg(3, 6), _rg(3, 4), _rg(6, 4), _rg(5))),
    (ValueError, "a must have last dim 4", lambda: R.linear_sub(_rg(3, 6), _rg(3, 5), _rg(6, 4))),
    (ValueError, r"y must have shape \[3, 6\]", lambda: R.linear_sub(_rg(3, 5), _rg(3, 4), _rg(6, 4))),
    (ValueError, "weight must be 2-D", lambda: R.linear_sub(_rg(3, 6), _rg(3, 4), _rg(6))),
    (TypeError, "a must be float32, float64, float16 or bfloat16", lambda: R.linear_sub(_rg(3, 6), torch.ones(3, 4, dtype=torch.int64), _rg(6, 4))),
    (ValueError, r"weight must be on the device of y \(cpu\), got meta",
     lambda: R.linear_sub(_rg(3, 6), _rg(3, 4), torch.randn(6, 4, device="meta"))),
    # None for a Tensor argument reaches C++ as an undefined tensor.
    (TypeError, "f must be a torch.Tensor, got None", lambda: R.coupling_sub(_rg(3), None)),
    (TypeError, "y must be a torch.Tensor, got None", lambda: R.sub_layer_norm(None, _rg(2, 3), _rg(3), _rg(3))),
    (TypeError, "bias must be a torch.Tensor, got None", lambda: R.bias_gelu(_rg(2, 3), None)),
    (TypeError, "weight must be a torch.Tensor, got None", lambda: R.batch_norm_act(_rg(2, 3), None, _rg(3))),
    (TypeError, "a must be a torch.Tensor, got None", lambda: R.linear_sub(_rg(3, 6), None, _rg(6, 4))),
    (TypeError, "dy must be a torch.Tensor, got None", lambda: R.bias_gelu_bwd(None, _rg(2, 3), _rg(3))),
    (TypeError, "mean must be a torch.Tensor, got None",
     lambda: R.layer_norm_bwd_add(_rg(2, 3), _rg(2, 3), _rg(3), None, _rg(2), _rg(2, 3))),
])
def test_checks_under_autograd(error, message, call):
    with pytest.raises(error, match=message):
        call()


def test_linear_sub_checks_without_autograd():
    # The composite kernel checks on its own (inference mode skips the autograd kernel).
    with torch.inference_mode(), pytest.raises(ValueError, match=r"bias must have shape \(6,\)"):
        R.linear_sub(torch.randn(3, 6), torch.randn(3, 4), torch.randn(6, 4), torch.randn(5))


def test_python_path_without_the_library():
    # Without revkernels._C: Python entry points with Python checks, formulas registered from Python.
    run_without_c_extension(
        "warnings.simplefilter('ignore')\n"
        "import torch, revkernels as rk\n"
        "R = torch.ops.revkernels\n"
        "assert not rk.HAS_C_EXTENSION\n"
        "for name in ('coupling_sub', 'sub_layer_norm', 'bias_gelu', 'linear_sub', 'batch_norm_act'):\n"
        "    assert getattr(rk.ops, name) is not getattr(R, name)\n"
        "expect_error(lambda: rk.ops.coupling_sub(torch.randn(3), 1.0), 'f must be a torch.Tensor')\n"
        "d = torch.float64\n"
        "y, g, w, b = (torch.randn(4, 9, dtype=d), torch.randn(4, 9, dtype=d), torch.randn(9, dtype=d),\n"
        "              torch.randn(9, dtype=d))\n"
        "a, lw = torch.randn(4, 5, dtype=d), torch.randn(9, 5, dtype=d)\n"
        "for fn, args in [(lambda *t: R.coupling_sub(*t), (y, g)),\n"
        "                 (lambda *t: R.coupling_add(*t), (y, g)),\n"
        "                 (lambda *t: R.sub_layer_norm(*t, 1e-5)[:2], (y, g, w, b)),\n"
        "                 (lambda *t: R.bias_gelu(*t, 'none'), (y, b)),\n"
        "                 (lambda *t: R.linear_sub(*t), (y, a, lw, b)),\n"
        "                 (lambda *t: R.batch_norm_act(*t, 1e-5, True)[0], (y, w, b))]:\n"
        "    assert torch.autograd.gradcheck(fn, [t.clone().requires_grad_() for t in args])\n"
        "print('ok')\n"
    )


def test_forward_mode_ad_raises_without_the_library():
    # torch.library's Python autograd kernel calls the op below autograd when no input requires
    # grad, where the tangent was dropped: the fallback kernels themselves refuse it. Reverse mode
    # still works there.
    run_without_c_extension(
        "warnings.simplefilter('ignore')\n"
        "import torch, revkernels as rk\n"
        "import torch.autograd.forward_ad as fwAD\n"
        "R = torch.ops.revkernels\n"
        "assert not rk.HAS_C_EXTENSION\n"
        "y, g, w, b = (torch.randn(4, 9), torch.randn(4, 9), torch.randn(9), torch.randn(9))\n"
        "a, lw = torch.randn(4, 5), torch.randn(9, 5)\n"
        "calls = [lambda t: R.coupling_sub(t, g), lambda t: R.coupling_add(g, t),\n"
        "         lambda t: R.sub_layer_norm(t, g, w, b, 1e-5), lambda t: R.bias_gelu(t, b, 'none'),\n"
        "         lambda t: R.linear_sub(t, a, lw, b), lambda t: R.batch_norm_act(t, w, b, 1e-5, True),\n"
        "         lambda t: rk.ops.coupling_sub(t, g)]\n"
        "for requires_grad in (False, True):\n"
        "    for i, call in enumerate(calls):\n"
        "        with fwAD.dual_level():\n"
        "            dual = fwAD.make_dual(y.clone().requires_grad_(requires_grad), torch.randn(4, 9))\n"
        "            try:\n"
        "                out = call(dual)\n"
        "            except NotImplementedError as e:\n"
        "                # (requires grad: torch's autograd.Function refuses first, its words)\n"
        "                assert 'forward-mode AD' in str(e) or 'forward mode AD' in str(e), e\n"
        "            else:\n"
        "                raise AssertionError(f'call {i} (requires_grad={requires_grad}) kept no tangent')\n"
        "        out = call(y.clone().requires_grad_())\n"
        "        (out[0] if isinstance(out, tuple) else out).sum().backward()\n"
        "print('ok')\n"
    )


def test_every_public_op_has_a_docstring():
    """help(revkernels.ops.<op>): the public entry is the op packet itself where the compiled
    library is loaded, which has no docstring of its own."""
    for name in rk.ops.__all__:
        assert (getattr(rk.ops, name).__doc__ or "").strip(), name


def test_the_top_level_package_exports_check():
    assert "check" in rk.__all__ and rk.check.monitor_reconstruction is not None


def _cuda_cpp_schemas():
    """{op name: schema} of every CUDA C++ op (``revkernels::cuda_<op>``) as csrc defines it, read
    from the sources: the ops exist only in a CUDA build."""
    import pathlib
    import re

    schemas = {}
    for path in (pathlib.Path(__file__).parents[2] / "csrc" / "ops").glob("*_cuda.c*"):
        for literals in re.findall(r'm\.def\(((?:\s*"(?:[^"\\]|\\.)*")+)\s*\)', path.read_text()):
            text = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', literals)).replace('\\"', '"')
            schemas[text.split("(", 1)[0]] = torch._C.parse_schema(text)
    return schemas


def test_cuda_cpp_ops_take_the_public_ops_arguments_and_defaults():
    # The public op's CUDA kernel (registered in Python) forwards its arguments to cuda_<op>; the
    # dispatcher leaves trailing arguments equal to their defaults out of that call, so a CUDA C++
    # schema without them fails ("missing value for argument 'relu'", found on the H200).
    schemas = _cuda_cpp_schemas()
    assert {"cuda_coupling_sub", "cuda_bias_gelu", "cuda_batch_norm_act"} <= set(schemas), sorted(schemas)
    for name, schema in schemas.items():
        public = getattr(R, name.removeprefix("cuda_")).default._schema
        assert [(a.name, str(a.type), a.default_value) for a in schema.arguments] == \
               [(a.name, str(a.type), a.default_value) for a in public.arguments], name


def test_the_default_cuda_backend_takes_cuda_cpp_below_its_size_and_triton_above(monkeypatch):
    from revkernels.ops import _library

    monkeypatch.delenv("REVKERNELS_CUDA_BACKEND", raising=False)
    assert _library._backend_from_env() == "auto"
    monkeypatch.setenv("REVKERNELS_CUDA_BACKEND", "fastest")
    with pytest.raises(ValueError, match="REVKERNELS_CUDA_BACKEND"):
        _library._backend_from_env()
    below = _library.AUTO_CUDA_CPP_BELOW
    previous = _library.get_cuda_backend()
    try:
        for backend, small, large in [("auto", True, False), ("triton", False, False), ("cuda", True, True)]:
            rk.ops.set_cuda_backend(backend)
            assert rk.ops.get_cuda_backend() == backend
            assert (_library.runs_cuda_cpp(below - 1), _library.runs_cuda_cpp(below)) == (small, large), backend
        with pytest.raises(ValueError, match="backend"):
            rk.ops.set_cuda_backend("fastest")
    finally:
        rk.ops.set_cuda_backend(previous)
