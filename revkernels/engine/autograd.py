"""The reference engine: ordinary autograd through every block (stores every activation)."""
from revkernels.engine.state import NO_CONTEXT
from revkernels.engine.structure import unique_params


def run_autograd(seq, x1, x2, context=NO_CONTEXT):

    unique_params(seq.blocks)  # the structure cache follows swapped-in parameters (fused blocks read it)
    for block in seq.blocks:
        x1, x2 = block(x1, x2, **context)
    return x1, x2
