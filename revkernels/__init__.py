"""revkernels: reversible training whose backward rebuilds activations instead of storing them.

    import revkernels as rk
    seq = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(f, g) for f, g in pairs])
    y1, y2 = seq(x1, x2)          # saves only (y1, y2) for backward

The API contract is the documentation (docs/, and its API reference). The math is in
the module docstrings: the reversible backward as a short specification in `revkernels.reference`,
the coupling and each fused op in `revkernels.ops.<family>`, the engines'
schedules in `revkernels.engine.<engine>`, PETRA in `revkernels.petra`.
"""
from revkernels import _extension, check, engine, models, nn, ops, petra, reference
from revkernels._extension import CPU_KERNEL_BUILD, HAS_C_EXTENSION
from revkernels.check import ReversibilityReport, check_reversibility

__version__ = "0.1.0"

__all__ = ["nn", "ops", "engine", "models", "petra", "reference", "check", "check_reversibility", "ReversibilityReport", "HAS_C_EXTENSION", "CPU_KERNEL_BUILD",
           "__version__"]
