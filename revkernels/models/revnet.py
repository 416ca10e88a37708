r"""RevNet-18/34/50 in PETRA's stage layout (Rivaud et al., ICLR 2025).

Two streams, each with the standard ResNet widths (64/128/256/512 for basic blocks, x4 for
bottlenecks). Stages, in order::

    RevNet18   S r r D r D r D r H                    (10 stages)
    RevNet34   S rrr D rrr D rrrrr D rr H             (18 stages)
    RevNet50   S D rr D rrr D rrrrr D rr H            (18 stages)

    S  stem        image -> conv (3 -> 2*64) - BN - ReLU [- max-pool], split into (x1, x2)
                   ImageNet: 7x7 stride 2 + 3x3/2 max-pool; CIFAR: 3x3 stride 1, no pool
    r  reversible  ReversibleStage(F):  (y1, y2) = (x2, x1 + F(x2))     (HalfCouplingBlock)
                   F = BasicResidual:      conv3x3-BN-ReLU-conv3x3-BN             (C -> C)
                   F = BottleneckResidual: conv1x1-BN-ReLU-conv3x3-BN-ReLU-conv1x1-BN (4C -> C -> 4C)
                   each BN(-ReLU) of F one fused op (`revkernels.nn.BatchNormAct2d`), in the
                   forward and the recompute alike (so the recompute is bitwise the forward)
    D  down        one ResNet downsampling residual block spread over the two streams
                   (non-reversible: ordinary autograd):
                   basic       h = BN(conv3x3_s2(x2));   (y1, y2) = (h, P(x1) + BN(conv3x3(relu(h))))
                   bottleneck  (y1, y2) = (Q(x2), P(x1) + F(x2)),  F a strided bottleneck
                   P, Q: 1x1 strided conv + BN projections (Cin -> Cout)
    H  head        global average pool of cat(x1, x2) (2*512 or 2*2048 channels) -> linear

A basic D is the ResNet basic downsampling block with its residual branch on x2 and its projection
shortcut on x1; the new carried stream is the branch's first conv output (the downsampled x2), so it
costs exactly the parameters of ResNet's block. A bottleneck's first conv does not change the
width, so the carried stream needs its own projection Q. This is the design of the authors' code
(github.com/stephane-rivaud/PETRA, async_torch/models/models_RevNet.py), with three differences:
our F omits the ReLU that code applies after F's last BN, our ImageNet stem pools 3x3/2
(torchvision's) where it pools 2x2/2, and by default our convolutions have no bias (as in
torchvision's ResNets: a bias right before a BatchNorm is cancelled by it in training, its gradient
is zero); ``conv_bias=True`` restores the biases and the paper's exact counts.

Parameter counts (ImageNet stem, 1000 classes), derived from torchvision's ResNets
(11,689,512 / 21,797,672 / 25,557,032 parameters):

    + stem: 128 output channels instead of 64       +9,408 conv + 128 BN          = +9,536
    + head: linear on 2*512 (2*2048) features        +512,000 (RevNet50: +2,048,000)
    + RevNet50 only: the four Q projections          64*256 + 256*512 + 512*1024 + 1024*2048
                                                     + BN (2*(256+512+1024+2048)) = +2,776,576
    RevNet18  11,689,512 + 9,536 + 512,000              = 12,211,048   (paper 12.22M: -0.07%)
    RevNet34  21,797,672 + 9,536 + 512,000              = 22,319,208   (paper 22.33M: -0.05%)
    RevNet50  25,557,032 + 9,536 + 2,048,000 + 2,776,576 = 30,391,144   (paper 30.42M: -0.10%)

With ``conv_bias=True`` the counts are 12,215,912 / 22,327,784 / 30,421,608: the paper's 12.22M /
22.33M / 30.42M to the last digit given.

PETRA's view of a model is `RevNet.stages` (the list above, in order); each stage module has
``reversible`` and ``kind`` ("stem" | "reversible" | "down" | "head") attributes and is called as
``stem(image) -> (x1, x2)``, ``stage(x1, x2) -> (y1, y2)``, ``head(x1, x2) -> logits``. The model's
forward runs the same modules, with each maximal run of consecutive reversible stages grouped into
one `ReversibleSequential` (engine chosen by the user), so the activation memory saved for a run is
its two outputs, whatever its depth. With a memory-saving engine the stem and the D stages keep only
their inputs and recompute in the backward (`revkernels.engine.recompute.run_recomputed`); the head,
and every stage under the autograd engine, store their activations as ordinary autograd.
"""
import torch
from torch import nn

from revkernels.engine.recompute import run_recomputed
from revkernels.nn.batch_norm import BatchNormAct2d
from revkernels.models.staged import StagedModel, check_images, check_positive_int, streams_in
from revkernels.nn.reversible import HalfCouplingBlock, ReversibleSequential, check_streams

STEMS = ("cifar", "imagenet")
KINDS = ("stem", "reversible", "down", "head")


def _conv(cin, cout, kernel, stride=1, bias=False):
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=bias)


def _projection(cin, cout, stride, bias=False):
    """1x1 strided convolution + BatchNorm (ResNet's projection shortcut)."""
    return nn.Sequential(_conv(cin, cout, 1, stride, bias), nn.BatchNorm2d(cout))


class BasicResidual(nn.Module):
    """ResNet basic residual function ``conv3x3-BN-ReLU-conv3x3-BN`` on one stream (C -> C).

    Each BN(+ReLU) is one fused `BatchNormAct2d` (a drop-in nn.BatchNorm2d: same parameters and
    state_dict keys), the convolutions go through cuDNN."""

    def __init__(self, channels, conv_bias=False):
        super().__init__()
        self.conv1 = _conv(channels, channels, 3, bias=conv_bias)
        self.bn1 = BatchNormAct2d(channels, relu=True)
        self.conv2 = _conv(channels, channels, 3, bias=conv_bias)
        self.bn2 = BatchNormAct2d(channels, relu=False)

    def forward(self, x):
        return self.bn2(self.conv2(self.bn1(self.conv1(x))))


class BottleneckResidual(nn.Module):
    """ResNet bottleneck ``conv1x1-BN-ReLU-conv3x3-BN-ReLU-conv1x1-BN`` (cin -> mid -> cout), the
    stride on the 3x3 convolution. Each BN(+ReLU) is one fused `BatchNormAct2d`."""

    def __init__(self, cin, mid, cout, stride=1, conv_bias=False):
        super().__init__()
        self.conv1 = _conv(cin, mid, 1, bias=conv_bias)
        self.bn1 = BatchNormAct2d(mid, relu=True)
        self.conv2 = _conv(mid, mid, 3, stride, bias=conv_bias)
        self.bn2 = BatchNormAct2d(mid, relu=True)
        self.conv3 = _conv(mid, cout, 1, bias=conv_bias)
        self.bn3 = BatchNormAct2d(cout, relu=False)

    def forward(self, x):
        x = self.bn1(self.conv1(x))
        x = self.bn2(self.conv2(x))
        return self.bn3(self.conv3(x))


class ReversibleStage(HalfCouplingBlock):
    """A reversible stage: ``(y1, y2) = (x2, x1 + f(x2))``, inverse ``(x1, x2) = (y2 - f(y1), y1)``."""

    reversible = True
    kind = "reversible"


class Stem(nn.Module):
    """image -> conv - BN - ReLU [- max-pool] with 2*`channels` outputs, split into two streams."""

    reversible = False
    kind = "stem"

    def __init__(self, stem="imagenet", channels=64, conv_bias=False):
        super().__init__()
        if stem not in STEMS:
            raise ValueError(f"revkernels: stem must be one of {STEMS}, got {stem!r}")
        if stem == "imagenet":
            self.conv = nn.Conv2d(3, 2 * channels, 7, stride=2, padding=3, bias=conv_bias)
            self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        else:
            self.conv = nn.Conv2d(3, 2 * channels, 3, stride=1, padding=1, bias=conv_bias)
            self.pool = nn.Identity()
        self.bn = nn.BatchNorm2d(2 * channels)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn(self.conv(x))))
        return streams_in(self.conv.weight.dtype, *x.chunk(2, dim=1))


class DownBasic(nn.Module):
    """Non-reversible downsampling stage from a ResNet basic block (cin -> cout per stream)::

        h = BN(conv3x3_stride(x2));    y1 = h;    y2 = P(x1) + BN(conv3x3(relu(h)))
    """

    reversible = False
    kind = "down"

    def __init__(self, cin, cout, stride=2, conv_bias=False):
        super().__init__()
        self.conv1 = _conv(cin, cout, 3, stride, bias=conv_bias)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = _conv(cout, cout, 3, bias=conv_bias)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = _projection(cin, cout, stride, conv_bias)

    def forward(self, x1, x2):
        check_streams(x1, x2)
        h = self.bn1(self.conv1(x2))
        return streams_in(self.conv1.weight.dtype, h, self.shortcut(x1) + self.bn2(self.conv2(torch.relu(h))))


class DownBottleneck(nn.Module):
    """Non-reversible stage from a ResNet bottleneck that changes width (and maybe resolution)::

        y1 = Q(x2);    y2 = P(x1) + F(x2)        F: cin -> mid -> cout, strided
    """

    reversible = False
    kind = "down"

    def __init__(self, cin, mid, cout, stride=2, conv_bias=False):
        super().__init__()
        self.f = BottleneckResidual(cin, mid, cout, stride, conv_bias)
        self.carry = _projection(cin, cout, stride, conv_bias)
        self.shortcut = _projection(cin, cout, stride, conv_bias)

    def forward(self, x1, x2):
        check_streams(x1, x2)
        return streams_in(self.carry[0].weight.dtype, self.carry(x2), self.shortcut(x1) + self.f(x2))


class Head(nn.Module):
    """(x1, x2) -> linear(global-average-pool(cat(x1, x2)))."""

    reversible = False
    kind = "head"

    def __init__(self, channels, num_classes):
        super().__init__()
        self.fc = nn.Linear(2 * channels, num_classes)

    def forward(self, x1, x2):
        check_streams(x1, x2)
        z = torch.nn.functional.adaptive_avg_pool2d(torch.cat([x1, x2], dim=1), 1)
        return self.fc(z.flatten(1))


class RevNet(StagedModel, nn.Module):
    """A two-stream reversible ResNet in PETRA's stage layout (see the module docstring).

    Args:
        block: "basic" (RevNet18/34) or "bottleneck" (RevNet50).
        layers: blocks per resolution, as in ResNet ((2, 2, 2, 2), (3, 4, 6, 3)).
        num_classes: outputs of the linear head.
        stem: "imagenet" (7x7/2 conv + max-pool) or "cifar" (3x3/1 conv, no pool).
        engine: engine of every reversible run ("auto", the default, "sequential", "autograd", ...); see
            `set_engine`.
        conv_bias: give every convolution a bias (the authors' code; inert before BatchNorm).
        recompute_nonreversible: with a memory-saving engine, the stem and downsampling stages keep
            only their input and recompute in the backward (`revkernels.engine.recompute`).
        exact: every reversible run in exact mode (fixed-point streams; see
            `revkernels.nn.ReversibleSequential`).

    Attributes:
        segments: the modules the forward runs, in order: the stem, `ReversibleSequential` runs,
            down stages and the head.
        stages: the flat stage list (the runs' blocks in place of the runs), same module objects.
    """

    def __init__(self, block="basic", layers=(2, 2, 2, 2), num_classes=1000, stem="imagenet",
                 engine="auto", conv_bias=False, recompute_nonreversible=True, exact=False):
        super().__init__()
        self.recompute_nonreversible = bool(recompute_nonreversible)
        if block not in ("basic", "bottleneck"):
            raise ValueError(f"revkernels: block must be 'basic' or 'bottleneck', got {block!r}")
        if stem not in STEMS:
            raise ValueError(f"revkernels: stem must be one of {STEMS}, got {stem!r}")
        check_positive_int(num_classes, "num_classes")
        if len(layers) != 4 or any(not isinstance(n, int) or n < 1 for n in layers):
            raise ValueError(f"revkernels: layers must be 4 positive ints, got {layers!r}")
        expansion = 4 if block == "bottleneck" else 1
        stages = [Stem(stem, 64, conv_bias)]
        cin = 64
        for i, (n, width) in enumerate(zip(layers, (64, 128, 256, 512))):
            cout = width * expansion
            for j in range(n):
                if cin != cout:
                    stride = 1 if i == 0 else 2
                    if block == "basic":
                        stages.append(DownBasic(cin, cout, stride, conv_bias))
                    else:
                        stages.append(DownBottleneck(cin, width, cout, stride, conv_bias))
                elif block == "basic":
                    stages.append(ReversibleStage(BasicResidual(cout, conv_bias)))
                else:
                    stages.append(ReversibleStage(BottleneckResidual(cout, width, cout, 1, conv_bias)))
                cin = cout
        stages.append(Head(cin, num_classes))

        segments, run = [], []
        for stage in stages:
            if stage.reversible:
                run.append(stage)
                continue
            if run:
                segments.append(ReversibleSequential(*run, engine=engine, exact=exact))
                run = []
            segments.append(stage)
        self.segments = nn.ModuleList(segments)
        self._engine = engine
        self._init_weights()

    def _init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        check_images(x)
        # With a memory-saving engine the stem and downsampling blocks keep only their input and
        # recompute in the backward, so no high-resolution activation is stored anywhere.
        recompute = self.recompute_nonreversible and self.engine != "autograd"
        out = (x,)
        for segment in self.segments:
            if isinstance(segment, ReversibleSequential) or not recompute or isinstance(segment, Head):
                out = segment(*out)
            else:
                out = run_recomputed(segment, *out)
        return out


def revnet18(num_classes=1000, stem="imagenet", engine="auto", conv_bias=False, exact=False):
    """RevNet18: ``S r r D r D r D r H``; 12,211,048 parameters (ImageNet, 1000 classes)."""
    return RevNet("basic", (2, 2, 2, 2), num_classes, stem, engine, conv_bias, exact=exact)


def revnet34(num_classes=1000, stem="imagenet", engine="auto", conv_bias=False, exact=False):
    """RevNet34: ``S rrr D rrr D rrrrr D rr H``; 22,319,208 parameters (ImageNet, 1000 classes)."""
    return RevNet("basic", (3, 4, 6, 3), num_classes, stem, engine, conv_bias, exact=exact)


def revnet50(num_classes=1000, stem="imagenet", engine="auto", conv_bias=False, exact=False):
    """RevNet50: ``S D rr D rrr D rrrrr D rr H``; 30,391,144 parameters (ImageNet, 1000 classes)."""
    return RevNet("bottleneck", (3, 4, 6, 3), num_classes, stem, engine, conv_bias, exact=exact)
