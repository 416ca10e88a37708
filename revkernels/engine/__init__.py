"""Engines: how a `ReversibleSequential` runs its blocks under autograd.

autograd (the reference), sequential, pareprop, graphs, compiled, and auto (the default, picked
per call by `choose_engine`): what each saves and how it schedules the backward is the docs' page
"Choosing an engine" (docs/engines.md). Blocks sharded one by one by FSDP2 run one autograd node
per block (`revkernels.engine.fsdp`).

An engine is a function ``engine(seq, x1, x2, context=NO_CONTEXT) -> (y1, y2)``; `context` is
the dict of keywords every F and G is called with (``seq(x1, x2, **context)``).
"""
from revkernels.engine.autograd import run_autograd
from revkernels.engine.compiled import run_compiled
from revkernels.engine.opaque import run_opaque  # registers revkernels::reversible_run (torch.compile)
from revkernels.engine.graphs import clear_graphs, eager_reason, run_graphs
from revkernels.engine.pareprop import reverse_blocks_two_streams, run_pareprop
from revkernels.engine.sequential import reverse_blocks, run_sequential

ENGINES = {"autograd": run_autograd, "sequential": run_sequential, "pareprop": run_pareprop, "graphs": run_graphs,
           "compiled": run_compiled}
AUTO = "auto"


def choose_engine(seq, x1, context):
    """The engine ``engine="auto"`` runs this call of `seq` with: "graphs" for CUDA inputs when the
    run can be captured (`revkernels.engine.graphs.eager_reason`), else "sequential". Neither
    compiles anything: "compiled" is faster still once compiled (see the docs' "Choosing an engine")
    and stays a choice of the caller's."""
    if x1.is_cuda and eager_reason(seq, context) is None:
        return "graphs"
    return "sequential"


def get_engine(name):
    """The engine function called `name` (None for "auto", chosen per call by `choose_engine`);
    ValueError naming the choices otherwise."""
    if not isinstance(name, str) or (name not in ENGINES and name != AUTO):
        raise ValueError(f"revkernels: engine must be one of {sorted([*ENGINES, AUTO])}, got {name!r}")
    return ENGINES.get(name)


__all__ = ["ENGINES", "AUTO", "get_engine", "choose_engine", "run_autograd", "run_sequential", "run_pareprop", "run_graphs", "run_compiled",
           "run_opaque", "clear_graphs", "reverse_blocks", "reverse_blocks_two_streams"]
