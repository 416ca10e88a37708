"""What RevNet and Rev-Swin share: a model made of `segments`, each a `ReversibleSequential` run or a
non-reversible stage (stem, downsampling/merging, head, each with a `kind`), exposed to PETRA as one
flat stage list and switched between engines as a whole."""
from revkernels.nn.reversible import ReversibleSequential

_LETTER = {"stem": "S", "reversible": "r", "down": "D", "head": "H"}


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
