"""`python -m revkernels.bench`: what reversible training costs and saves on this machine.

The benchmark suite (`__main__`) runs these parts, each also a module with its own command line
(``python -m revkernels.bench.<part>``) and a ``run(args) -> rows`` beside its ``main``:

    memory   train step of reversible MLP stacks, autograd engine vs sequential engine: time,
             activation memory saved for backward, peak memory (`train_step`, `report` do the work)
    kernels  every fused op against the eager composition it replaces
    train    transformer and RevNet train steps: standard backprop vs reversible training
    overhead host-bound and compute-bound train steps against standard, checkpointed and minREV-style
             reversible training (`revkernels.reference`), and each fused op's per-call cost
    petra    the PETRA distributed runtime vs single-process reversible backprop

`benchmarks/bench_{kernels,train,petra,overhead}.py` in a checkout are thin entry points over the
modules; the development diagnostics and experiments (profiles, the engine floor, attention kernel
choice, compiler stances, the project's targets) are scripts of `benchmarks/` only.
"""
