"""Drop-in reversible modules."""
from revkernels.nn.drop_path import DropPath
from revkernels.nn.reversible import ReversibleBlock, ReversibleSequential

__all__ = ["ReversibleBlock", "ReversibleSequential", "DropPath"]
