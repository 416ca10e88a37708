"""PETRA (Rivaud et al., ICLR 2025): decoupled stage-parallel training of reversible networks.

    from revkernels.petra import Trainer
    trainer = Trainer(revnet18(num_classes=10, stem="cifar"), method="petra", accum_k=2)
    for images, labels in loader:
        out = trainer.train_step(images, labels)   # one tick; out["loss"] is None while filling
    trainer.flush()                                # drain the pending backwards

`partition` (stages that rebuild or buffer their inputs; ``exact=True``: on int64 fixed-point streams,
rebuilt bit for bit; ``memory_budget``: reversible stages that keep their inputs, `plan_memory`;
``groups=R, balance="time"`` splits them into
R contiguous groups minimising the largest group's per-tick cost, from `stage_costs` or given costs),
`simulate` (the exact one-process, tick-by-tick runtime, with the backprop, reversible-backprop and
delayed-gradient (input + parameter buffers) baselines; ``groups=R`` runs R groups of consecutive stages
as R workers; ``analyze_every=N`` compares each method's applied gradient with the end-to-end one; ``state_dict`` / ``load_state_dict``
checkpoint the whole in-flight pipeline), `distributed` (one process per worker over torch.distributed,
bit-identical to the simulator, petra and delayed, with per-rank checkpoints that resume it exactly and
convert to and from the simulator's: ``torchrun --nproc-per-node R -m revkernels.petra.train
--runtime distributed``, or ``--nproc R``), `data` (digits, synthetic, image folders, CIFAR-10 batches).

The algorithm: "PETRA: Parallel End-to-end Training with Reversible Architectures" (Rivaud et al.,
ICLR 2025, arXiv:2406.02052). The tick-by-tick timing implemented here is written out in the
docstring of `revkernels.petra.simulate`; usage in docs/petra.md.
"""
from revkernels.petra import simulate
from revkernels.petra.partition import (PipelineMemoryPlan, Stage, balanced_sizes, group_sizes, partition, plan_memory,
                                        stage_costs)
from revkernels.petra.simulate import METHODS, PIPELINED, Trainer, Worker, make_optimizer, param_groups, split_groups

__all__ = ["partition", "Stage", "plan_memory", "PipelineMemoryPlan", "balanced_sizes", "group_sizes", "stage_costs", "simulate", "Trainer", "Worker", "METHODS", "PIPELINED", "make_optimizer", "param_groups",
           "split_groups"]
