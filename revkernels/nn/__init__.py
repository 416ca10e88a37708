"""Drop-in reversible modules."""
from revkernels.nn.reversible import ReversibleBlock, ReversibleSequential

__all__ = ["ReversibleBlock", "ReversibleSequential"]
