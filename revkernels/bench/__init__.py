"""`python -m revkernels.bench`: what reversible training costs and saves on this machine.

For now: a train step (forward, backward, SGD) of a stack of reversible MLP blocks with the
`autograd` engine (stores activations) against the `sequential` engine (rebuilds them), at several
depths: median step time, activation memory saved for backward, and peak memory.
"""
