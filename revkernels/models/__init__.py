"""Models built from revkernels' reversible blocks: RevNet-18/34/50 in PETRA's stage layout and Rev-ViT."""
from revkernels.models.revnet import (
    BasicResidual,
    BottleneckResidual,
    DownBasic,
    DownBottleneck,
    Head,
    ReversibleStage,
    RevNet,
    Stem,
    revnet18,
    revnet34,
    revnet50,
)
from revkernels.models.revvit import RevViT, revvit

__all__ = ["RevNet", "RevViT", "revvit", "revnet18", "revnet34", "revnet50", "ReversibleStage", "BasicResidual",
           "BottleneckResidual", "Stem", "DownBasic", "DownBottleneck", "Head"]
