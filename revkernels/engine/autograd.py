"""The reference engine: ordinary autograd through every block (stores every activation)."""


def run_autograd(seq, x1, x2):
    for block in seq.blocks:
        x1, x2 = block(x1, x2)
    return x1, x2
