"""Models built from revkernels' reversible blocks: RevNet-18/34/50 in PETRA's stage layout, Rev-ViT,
Rev-Swin and the Rev-Text language models."""
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
from revkernels.models.revswin import RevSwin, revswin
from revkernels.models.revtext import RevText, revtext
from revkernels.models.revvit import RevViT, revvit

__all__ = ["RevNet", "RevViT", "revvit", "RevSwin", "revswin", "RevText", "revtext", "revnet18", "revnet34", "revnet50", "ReversibleStage",
           "BasicResidual", "BottleneckResidual", "Stem", "DownBasic", "DownBottleneck", "Head"]
