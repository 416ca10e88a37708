"""The reference engine: ordinary autograd through every block (stores every activation)."""
from revkernels.engine.state import NO_CONTEXT
from revkernels.engine.structure import unique_params


def run_autograd(seq, x1, x2, context=NO_CONTEXT):
    """Every block under autograd; in exact mode on fixed-point streams with straight-through
    gradients (``revkernels.nn.exact.run_exact_autograd``, the exact mode's reference)."""
    unique_params(seq.blocks)  # the structure cache follows swapped-in parameters (fused blocks read it)
    streams = seq.fixed_point_streams(x1.dtype)
    if streams is not None:
        return streams.run_autograd(seq.blocks, x1, x2, context)
    for block in seq.blocks:
        x1, x2 = block(x1, x2, **context)
    return x1, x2
