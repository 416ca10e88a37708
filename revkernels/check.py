"""`check_reversibility`: how exactly each block's inverse rebuilds its input, and how the error
grows when a whole run is rebuilt from its output (what the engines' backward does)."""
from dataclasses import dataclass, field

import torch

from revkernels.engine.state import frozen_batchnorm_stats
from revkernels.nn.reversible import ReversibleBlock, ReversibleSequential, check_streams


def _relative_error(rebuilt, exact):
    exact64 = exact.double()
    scale = exact64.abs().max().clamp_min(torch.finfo(exact.dtype).tiny)
    return ((rebuilt.double() - exact64).abs().max() / scale).item()


@dataclass
class ReversibilityReport:
    """Per block, max-abs reconstruction error relative to the input's max-abs, both streams.

    `block_errors[i]`: block i inverted from its own exact output (local error).
    `chained_errors[i]`: the input of block i rebuilt from the run's final output (what a
    memory-saving backward sees; errors compound through the blocks after i).
    """

    dtype: torch.dtype
    block_errors: list = field(default_factory=list)
    chained_errors: list = field(default_factory=list)

    @property
    def max_error(self):
        return max(max(e) for e in self.block_errors + self.chained_errors)

    def __str__(self):
        lines = [f"reversibility ({self.dtype}): relative max-abs error of the rebuilt input",
                 f"{'block':>5}  {'local x1':>10}  {'local x2':>10}  {'chained x1':>10}  {'chained x2':>10}"]
        for i, (local, chained) in enumerate(zip(self.block_errors, self.chained_errors)):
            lines.append(f"{i:>5}  {local[0]:>10.2e}  {local[1]:>10.2e}  {chained[0]:>10.2e}  {chained[1]:>10.2e}")
        return "\n".join(lines)


@torch.no_grad()
def check_reversibility(module, x1, x2):
    """Runs `module` (a ReversibleSequential or ReversibleBlock) forward on (x1, x2), inverts it,
    and reports the reconstruction error per block. Randomness is replayed exactly and BatchNorm
    running statistics are left untouched, so the check changes no module state."""
    if isinstance(module, ReversibleBlock):
        blocks = [module]
    elif isinstance(module, ReversibleSequential):
        blocks = list(module.blocks)
    else:
        raise TypeError(f"revkernels: module must be a ReversibleSequential or ReversibleBlock, got {type(module).__name__}")
    check_streams(x1, x2)
    report = ReversibilityReport(dtype=x1.dtype)
    inputs, states = [], []
    rng_before = torch.get_rng_state()
    with frozen_batchnorm_stats(*blocks):
        for block in blocks:
            inputs.append((x1, x2))
            y1, y2, state = block.forward_with_state(x1, x2, preserve_rng_state=True)
            states.append(state)
            r1, r2 = block.inverse(y1, y2, state)
            report.block_errors.append((_relative_error(r1, x1), _relative_error(r2, x2)))
            x1, x2 = y1, y2
        chained = []
        for block, state, exact in zip(reversed(blocks), reversed(states), reversed(inputs)):
            x1, x2 = block.inverse(x1, x2, state)
            chained.append((_relative_error(x1, exact[0]), _relative_error(x2, exact[1])))
    report.chained_errors = chained[::-1]
    torch.set_rng_state(rng_before)
    return report
