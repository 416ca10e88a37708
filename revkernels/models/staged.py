"""What the models share: RevNet and Rev-Swin are made of `segments`, each a `ReversibleSequential`
run or a non-reversible stage (stem, downsampling/merging, head, each with a `kind`), exposed to
PETRA as one flat stage list and switched between engines as a whole (`StagedModel`); Rev-ViT and
Rev-Text hold one run (`OneRunModel`). Argument checks they all use."""
import torch

from revkernels.nn.reversible import ReversibleSequential

_LETTER = {"stem": "S", "reversible": "r", "down": "D", "head": "H"}


def streams_in(dtype, *streams):
    """`streams` in `dtype` (a non-reversible stage's parameter dtype): what the stage hands to the
    next reversible run. Under autocast its convolutions and linears return the low-precision dtype,
    and a run fed low-precision streams rebuilds each block's input only to that precision (docs/numerics.md,
    "Expected drift"); in the parameters' dtype the streams stay fp32 while F and G compute under
    autocast. No copy where a stream already has `dtype`."""
    return tuple(s if s.dtype == dtype else s.to(dtype) for s in streams)


def check_images(images, size=None):
    """Raises ValueError unless `images` is a float tensor (batch, channels, size, size); any height
    and width for size None."""
    shape = "(batch, channels, height, width)" if size is None else f"(batch, channels, {size}, {size})"
    if not (isinstance(images, torch.Tensor) and images.dim() == 4 and images.is_floating_point()
            and (size is None or images.shape[-2:] == (size, size))):
        is_tensor = isinstance(images, torch.Tensor)
        got = f"{images.dtype} of shape {tuple(images.shape)}" if is_tensor else type(images).__name__
        raise ValueError(f"revkernels: images must be a float tensor {shape}, got {got}")


def check_positive_int(value, name):
    """Raises ValueError naming `name` unless `value` is a positive int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"revkernels: {name} must be a positive int, got {value!r}")


class OneRunModel:
    """Mixin for an `nn.Module` whose reversible blocks are one run, ``self.blocks`` (Rev-ViT,
    Rev-Text): the engine as a property and `set_engine`, as `StagedModel` has them."""

    @property
    def engine(self):
        return self.blocks.engine

    @engine.setter
    def engine(self, name):
        self.blocks.engine = name

    def set_engine(self, name):
        """Switches the reversible run to engine `name`; returns the model."""
        self.engine = name
        return self


class StagedModel:
    """Mixin for an `nn.Module` with a `segments` ModuleList and an `_engine` attribute."""

    @property
    def runs(self):
        """The `ReversibleSequential` runs of consecutive reversible stages, in order."""
        return [s for s in self.segments if isinstance(s, ReversibleSequential)]

    @property
    def stages(self):
        """The ordered stage list for PETRA: the same module objects the forward runs."""
        out = []
        for segment in self.segments:
            out.extend(segment.blocks if isinstance(segment, ReversibleSequential) else [segment])
        return out

    @property
    def layout(self):
        """The stage layout as a string, e.g. ``"S r r D r D r D r H"`` (RevNet-18)."""
        return " ".join(_LETTER[getattr(s, "kind", "reversible")] for s in self.stages)

    @property
    def engine(self):
        return self._engine

    @engine.setter
    def engine(self, name):
        for run in self.runs:  # the first run validates the name before anything changes
            run.engine = name
        self._engine = name

    def set_engine(self, name):
        """Switches every reversible run to engine `name`; returns the model."""
        self.engine = name
        return self
