"""`check_reversibility`: how exactly each block's inverse rebuilds its input, and how the error
grows when a whole run is rebuilt from its output (what the engines' backward does).

`monitor_reconstruction`: the same question asked at training time, opt-in and sampled: the
sequential and pareprop engines compare each rebuilt block input with a small sample of the
forward's and warn past a threshold."""
import contextlib
import functools
import math
import warnings
from dataclasses import dataclass, field

import torch

from revkernels.engine.sequential import forward_step
from revkernels.engine.structure import buffers_kept, check_members, recompute_context
from revkernels.engine.state import check_context
from revkernels.nn.reversible import ReversibleBlock, ReversibleSequential, check_streams


def _max_abs(t):
    """max |t| as a 0-dim tensor; 0 for an empty `t` (an empty batch: torch's max rejects it)."""
    return t.abs().max() if t.numel() else t.new_zeros(())


def _relative_error(rebuilt, exact):
    exact64 = exact.double()
    # (exact mode's int64 streams: the difference is taken exactly, before any rounding)
    diff = rebuilt.double() - exact64 if exact.is_floating_point() else (rebuilt - exact).double()
    scale = _max_abs(exact64).clamp_min(torch.finfo(exact.dtype if exact.is_floating_point() else torch.float64).tiny)
    return (_max_abs(diff) / scale).item()


@dataclass
class ReversibilityReport:
    """Per block, max-abs reconstruction error relative to the input's max-abs, both streams.

    `block_errors[i]`: block i inverted from its own exact output (local error).
    `chained_errors[i]`: the input of block i rebuilt from the run's final output (what a
    memory-saving backward sees; errors compound through the blocks after i).
    `exact`: a run in exact mode (its int64 streams compared: every error is 0.0 unless a branch
    does not recompute its forward's bits).
    """

    dtype: torch.dtype
    block_errors: list = field(default_factory=list)
    chained_errors: list = field(default_factory=list)
    exact: bool = False

    @property
    def max_error(self):
        """The largest error of the report; NaN if any error is NaN (a rebuild that gave NaN)."""
        errors = [e for pair in self.block_errors + self.chained_errors for e in pair]
        return math.nan if any(map(math.isnan, errors)) else max(errors, default=0.0)

    def __str__(self):
        mode = ", exact mode" if self.exact else ""
        lines = [f"reversibility ({self.dtype}{mode}): relative max-abs error of the rebuilt input",
                 f"{'block':>5}  {'local x1':>10}  {'local x2':>10}  {'chained x1':>10}  {'chained x2':>10}"]
        for i, (local, chained) in enumerate(zip(self.block_errors, self.chained_errors)):
            lines.append(f"{i:>5}  {local[0]:>10.2e}  {local[1]:>10.2e}  {chained[0]:>10.2e}  {chained[1]:>10.2e}")
        return "\n".join(lines)


@torch.no_grad()
def check_reversibility(module, x1, x2, **context):
    """Runs `module` (a ReversibleSequential or ReversibleBlock) forward on (x1, x2), inverts it,
    and reports the reconstruction error per block. Randomness is replayed exactly and BatchNorm
    running statistics are left untouched, and buffers a forward changes (an EMA, a counter) are
    put back, so the check changes no module state. `context`: the
    keywords of every F and G, as in ``seq(x1, x2, **context)``.

    A run in exact mode (``exact=True``) is checked on its fixed-point streams: the report's
    errors are 0.0, and a block whose error is not names a branch that does not recompute the
    same bits from the same input (a kernel with atomics, randomness not declared)."""
    if isinstance(module, ReversibleBlock):
        blocks = [module]
    elif isinstance(module, ReversibleSequential):
        blocks = list(module.blocks)
    else:
        raise TypeError(f"revkernels: module must be a ReversibleSequential or ReversibleBlock, got {type(module).__name__}")
    check_streams(x1, x2)
    check_members(module)
    if context:
        check_context(module, blocks, context)
    with_context = {"context": context} if context else {}  # without: the steps' pre-context signature
    streams = module.fixed_point_streams(x1.dtype) if isinstance(module, ReversibleSequential) else None
    report = ReversibilityReport(dtype=x1.dtype, exact=streams is not None)
    if streams is None:
        steps = [None] * len(blocks)
        inverse = [functools.partial(block.inverse, **with_context) for block in blocks]
    else:  # exact mode: the int64 streams, stepped and inverted by the exact steps
        steps = streams.steps(blocks)
        inverse = [functools.partial(step.inverse, context=context) for step in steps]
        (_, x1), (_, x2) = streams.enter(x1), streams.enter(x2)
        streams.raise_on_overflow()
    inputs, states = [], []
    rng_before = torch.get_rng_state()
    # (buffers_kept: the buffers the forwards change are put back after, the same tensors)
    with contextlib.ExitStack() as kept:
        for block in blocks:
            kept.enter_context(buffers_kept(block))
        with recompute_context(*blocks):
            for block, step, invert in zip(blocks, steps, inverse):
                inputs.append((x1, x2))
                # the engines' forward step: it records the buffers the forward changes (an EMA, a
                # counter) in the state, and the inverse rebuilds with their old values
                y1, y2, state = forward_step(block, x1, x2, True, context, step)
                states.append(state)
                r1, r2 = invert(y1, y2, state)
                report.block_errors.append((_relative_error(r1, x1), _relative_error(r2, x2)))
                x1, x2 = y1, y2
            if streams is not None:
                streams.raise_on_overflow()
            chained = []
            for invert, state, exact in zip(reversed(inverse), reversed(states), reversed(inputs)):
                x1, x2 = invert(x1, x2, state)
                chained.append((_relative_error(x1, exact[0]), _relative_error(x2, exact[1])))
    report.chained_errors = chained[::-1]
    torch.set_rng_state(rng_before)
    return report


class ReconstructionMonitor:
    """Opt-in runtime check of the memory-saving engines' rebuild (see `monitor_reconstruction`).

    On every `every`-th forward of the monitored run that records a graph (grad enabled and a stream,
    parameter or context tensor requiring grad; train or eval mode), the forward keeps
    a strided sample of at most `max_samples` elements of each block's input (a few KB per
    block: the exact input is not kept); that step's backward compares the rebuilt inputs at the
    same positions and warns (UserWarning) when the relative error (max-abs difference over the
    sample's max-abs, as `check_reversibility` measures it) passes `threshold`. This catches
    both a block that does not invert (a recompute that differs from the forward) and error
    compounding through a deep run. Costs one gather per block in the forward and one host
    synchronisation at the end of the backward on sampled steps; nothing on the others.

    `errors` holds the last sampled backward's per-block errors (block i: max over both
    streams); `history` the (step, errors) of every sampled backward (bounded by `keep`).
    """

    def __init__(self, threshold=1e-3, every=1, max_samples=4096, keep=100):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
            raise ValueError(f"revkernels: threshold must be a positive number, got {threshold!r}")
        if not (isinstance(keep, int) and keep >= 1):
            raise ValueError(f"revkernels: keep must be a positive int (sampled steps kept in history), got {keep!r}")
        if not (isinstance(every, int) and every >= 1):
            raise ValueError(f"revkernels: every must be a positive int, got {every!r}")
        if not (isinstance(max_samples, int) and max_samples >= 1):
            raise ValueError(f"revkernels: max_samples must be a positive int, got {max_samples!r}")
        self.threshold, self.every, self.max_samples, self.keep = float(threshold), every, max_samples, keep
        self.step = 0  # forwards seen
        self.exact = False  # a run in exact mode was sampled: any error is a rebuild that is not exact
        self.errors = None
        self.history = []

    # -- called by the engines -------------------------------------------------------------

    def begin_forward(self):
        """Counts a forward; True when this step is sampled."""
        self.step += 1
        return (self.step - 1) % self.every == 0

    def sample(self, x1, x2):
        """The strided sample of one block's input kept for the backward."""
        return (self._take(x1), self._take(x2))

    def _take(self, x):
        flat = x.detach().reshape(-1)
        stride = max(1, -(-flat.numel() // self.max_samples))
        return flat[::stride].clone()

    def error(self, sample, x1, x2):
        """Relative error of a rebuilt input at the sampled positions (a 0-dim tensor, no sync).
        Exact mode's int64 streams are compared exactly: any difference counts (`report`)."""
        errs = []
        for kept, rebuilt in zip(sample, (x1, x2)):
            kept32 = kept.float()
            if not kept.is_floating_point():
                self.exact = True
                diff = _max_abs((self._take(rebuilt) - kept).float())
                errs.append(diff / _max_abs(kept32).clamp_min(torch.finfo(torch.float32).tiny))
                continue
            diff = _max_abs(self._take(rebuilt).float() - kept32)
            errs.append(diff / _max_abs(kept32).clamp_min(torch.finfo(torch.float32).tiny))
        return torch.maximum(errs[0], errs[1])

    def report(self, errors):
        """Records one sampled backward's per-block errors (block order) and warns past threshold."""
        values = torch.stack(errors).tolist()
        self.errors = values
        self.history.append((self.step, values))
        del self.history[:-self.keep]
        threshold = 0.0 if self.exact else self.threshold
        bad = [i for i, e in enumerate(values) if not e <= threshold]  # NaN counts as bad
        if bad and self.exact:
            first = bad[-1]
            warnings.warn(
                f"revkernels: reconstruction monitor: exact mode rebuilt block {first}'s input with relative error "
                f"{values[first]:.2e} (blocks not exact: {bad[::-1]}; forward step {self.step}): its F or G does "
                "not recompute the forward's bits from the same input (a kernel with atomics, undeclared "
                "randomness). Check it with revkernels.check_reversibility.", UserWarning, stacklevel=2)
        elif bad:
            first = bad[-1]  # errors compound towards block 0: the last bad block is where it starts
            worst = max(bad, key=lambda i: values[i] if values[i] == values[i] else float("inf"))
            warnings.warn(
                f"revkernels: reconstruction monitor: block {first}'s input was rebuilt with relative error "
                f"{values[first]:.2e} > threshold {self.threshold:.1e} (blocks over it: {bad[::-1]}; worst block "
                f"{worst}: {values[worst]:.2e}; forward step {self.step}). The block may not be invertible "
                "(a recompute that differs from its forward) or the run too deep for its dtype; check it "
                "with revkernels.check_reversibility, or use engine='autograd'.",
                UserWarning, stacklevel=2)


MONITORED_ENGINES = ("sequential", "pareprop")


class monitor_reconstruction:  # noqa: N801 (used like a function / context manager)
    """Attaches a `ReconstructionMonitor` to a `ReversibleSequential` (engines sequential and
    pareprop; the graphs engine and compiled runs are not monitored: attaching it to a run with
    another engine warns)::

        monitor = monitor_reconstruction(seq, threshold=1e-3, every=100)   # stays attached
        ...
        monitor.detach()

        with monitor_reconstruction(seq, threshold=1e-4) as monitor:        # detached on exit
            ...
    """

    def __init__(self, seq, threshold=1e-3, every=1, max_samples=4096):
        if not isinstance(seq, ReversibleSequential):
            raise TypeError(f"revkernels: seq must be a ReversibleSequential, got {type(seq).__name__}")
        self.seq = seq
        self.monitor = ReconstructionMonitor(threshold, every, max_samples)
        seq.reconstruction_monitor = self.monitor
        if seq.engine not in MONITORED_ENGINES + ("auto",):
            warnings.warn(f"revkernels: the reconstruction monitor records nothing with engine={seq.engine!r} (it "
                          f"monitors the engines {MONITORED_ENGINES})", UserWarning, stacklevel=2)

    def __getattr__(self, name):  # errors, history, step, threshold... of the monitor
        return getattr(self.__dict__["monitor"], name)

    def detach(self):
        if getattr(self.seq, "reconstruction_monitor", None) is self.monitor:
            self.seq.reconstruction_monitor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()
        return False
