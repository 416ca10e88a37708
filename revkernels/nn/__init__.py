"""Drop-in reversible modules."""
from revkernels.nn.drop_path import DropPath
from revkernels.nn.reversible import HalfCouplingBlock, ReversibleBlock, ReversibleSequential

__all__ = ["ReversibleBlock", "HalfCouplingBlock", "ReversibleSequential", "DropPath"]
