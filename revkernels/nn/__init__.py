"""Drop-in reversible modules."""
from revkernels.nn.batch_norm import BatchNormAct2d
from revkernels.nn.drop_path import DropPath
from revkernels.nn.reversible import HalfCouplingBlock, ReversibleBlock, ReversibleSequential
from revkernels.nn.revvit import RevTransformerBlock, RevViTBlock

__all__ = ["ReversibleBlock", "HalfCouplingBlock", "ReversibleSequential", "RevTransformerBlock", "RevViTBlock",
           "DropPath", "BatchNormAct2d"]
