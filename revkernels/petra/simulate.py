r"""PETRA's exact tick-by-tick simulator (one process) and its baselines, with one optimizer recipe.

Timing (PETRA.md, worker view). Stages j = 1..J (0-based index i = j - 1). Messages sent at tick t
are received at tick t + 1. At every tick, every stage j < J

    forward:  x_in <- image (j = 1) or the output j-1 sent last tick   [non-reversible: fifo.push(x_in)]
              x_out = F_j(x_in; theta_j)            (latest parameters; sent to j+1)
    backward: (y, dy) <- what j+1 sent last tick    (y: j's own output for an older batch)
              x = inverse_j(y; theta_j) if reversible else fifo.pop()
              dx, dtheta = vjp of F_j at x with theta_j, cotangent dy
              acc_j += dtheta;  n_j += 1;  if n_j % k == 0: theta_j <- SGD(theta_j, acc_j / k); acc_j = 0
              send (x, dx) to j-1

and the last stage J runs forward, loss and backward of the batch it receives in the same tick.
Batch b enters stage 1 at tick b, so stage j runs its forward at tick b + j - 1, the head its
forward-and-backward at tick b + J - 1, and stage j its backward at tick b + J - 1 + (J - j):
**2(J - j) ticks after its forward**. With J = 1 this is plain backprop.

Optimizer (paper recipe, `make_optimizer`): SGD, Nesterov momentum 0.9, weight decay on every
parameter except BatchNorm/LayerNorm/GroupNorm parameters and biases, gradients averaged over k
backward steps, one step every k. Learning rate after s optimizer steps (`lr_at`)::

    peak  = base_lr * batch * k / 256                                   (linear scaling)
    lr(s) = peak * (s + 1) / warmup_steps                 for s < warmup_steps
          = peak * gamma ** #{m in milestones : m <= s}   otherwise     (step decay)

Methods (`Trainer(method=...)`):
    petra        the pipeline above; one optimizer per stage, each counting its own steps.
    backprop     end-to-end backprop: the stages called in order under ordinary autograd.
    revbackprop  reversible backprop: each run of consecutive reversible stages in one
                 `ReversibleSequential` on the sequential engine (rebuilds, stores only outputs),
                 no pipelining.
The baselines record forward and backward of batch b at tick b in every stage.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from revkernels.nn.reversible import ReversibleSequential
from revkernels.petra.partition import partition

METHODS = ("petra", "backprop", "revbackprop")
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)


def param_groups(modules, weight_decay):
    """Two SGD parameter groups over `modules`: ``decay`` (weight decay `weight_decay`) and
    ``no_decay`` (BatchNorm and other norm-layer parameters and every bias; weight decay 0).
    Each parameter that requires grad appears once."""
    decay, no_decay, seen = [], [], set()
    for module in modules:
        for m in module.modules():
            for name, p in m.named_parameters(recurse=False):
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                (no_decay if isinstance(m, _NORMS) or name == "bias" else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def make_optimizer(modules, lr, weight_decay, momentum=0.9):
    """SGD with Nesterov momentum over `param_groups(modules, weight_decay)`."""
    return torch.optim.SGD(param_groups(modules, weight_decay), lr=lr, momentum=momentum, nesterov=True)


def _check_number(value, name, minimum=0.0, strict=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (value <= minimum if strict else value < minimum):
        rel = ">" if strict else ">="
        raise ValueError(f"revkernels: {name} must be a finite number {rel} {minimum}, got {value!r}")


def _check_int(value, name, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"revkernels: {name} must be an int >= {minimum}, got {value!r}")


class _StageOptimizer:
    """One optimizer with PETRA's accumulation: grads summed into .grad over k backward steps,
    averaged, one SGD step with the scheduled lr, grads cleared."""

    def __init__(self, trainer, modules):
        self.trainer = trainer
        self.modules = modules
        self.optimizer = make_optimizer(modules, trainer.base_lr, trainer.weight_decay, trainer.momentum)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.backward_steps = 0
        self.steps = 0

    def after_backward(self):
        """Counts one backward step; every k-th one, averages the grads and steps. True if stepped."""
        self.backward_steps += 1
        if self.backward_steps % self.trainer.accum_k:
            return False
        k = self.trainer.accum_k
        lr = self.trainer.lr_at(self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None and k != 1:
                    p.grad.div_(k)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return True


class Trainer:
    """Trains `model` by `method` ("petra", "backprop" or "revbackprop") one batch at a time.

    Args:
        model: a model with ``stages`` (e.g. `revkernels.models.revnet18`), a list of stage
            modules, or any module (one stage). Trained in place, in train mode.
        method: see the module docstring.
        accum_k: backward steps per optimizer step (grads averaged).
        base_lr: lr for a global batch of 256; the peak lr is ``base_lr * batch * accum_k / 256``.
        warmup_steps: optimizer steps of linear warm-up.
        milestones: optimizer-step counts at which the lr is multiplied by `gamma`.
        weight_decay: applied to every parameter but norm-layer parameters and biases.
        gamma, momentum: step-decay factor and Nesterov momentum.
        batch_size: the per-step batch for the lr scaling; None takes the first batch's size.

    `train_step(images, labels)` runs one tick (petra) or one forward/backward (baselines) and
    returns a dict: ``loss`` (float, or None while the pipeline fills: petra's loss is the one its
    head computed this tick, for batch ``batch``), ``batch``, ``tick``, ``stepped`` (stage indices
    that took an optimizer step). `flush()` runs ticks without new input until every pending
    backward is done and returns their dicts. Partially accumulated grads (fewer than k backward
    steps) are left in ``.grad``, unapplied, by every method alike.

    ``schedule[(batch, stage_index)]`` is ``{"forward": tick, "backward": tick}``; ``events`` lists
    ``(tick, stage_index, "forward" | "backward", batch)`` in execution order.
    """

    def __init__(self, model, method="petra", accum_k=1, base_lr=0.1, warmup_steps=0, milestones=(),
                 weight_decay=5e-4, gamma=0.1, momentum=0.9, batch_size=None):
        if not isinstance(method, str) or method not in METHODS:
            raise ValueError(f"revkernels: method must be one of {list(METHODS)}, got {method!r}")
        _check_int(accum_k, "accum_k", 1)
        _check_number(base_lr, "base_lr", 0.0, strict=True)
        _check_int(warmup_steps, "warmup_steps", 0)
        if isinstance(milestones, (str, bytes)) or not hasattr(milestones, "__iter__"):
            raise ValueError(f"revkernels: milestones must be a sequence of ints, got {milestones!r}")
        milestones = tuple(milestones)
        if any(isinstance(m, bool) or not isinstance(m, int) or m < 0 for m in milestones) \
                or list(milestones) != sorted(milestones):
            raise ValueError(f"revkernels: milestones must be increasing non-negative ints, got {milestones!r}")
        _check_number(weight_decay, "weight_decay", 0.0)
        _check_number(gamma, "gamma", 0.0, strict=True)
        _check_number(momentum, "momentum", 0.0)
        if batch_size is not None:
            _check_int(batch_size, "batch_size", 1)
        self.method = method
        self.accum_k = accum_k
        self.base_lr = float(base_lr)
        self.warmup_steps = warmup_steps
        self.milestones = milestones
        self.weight_decay = float(weight_decay)
        self.gamma = float(gamma)
        self.momentum = float(momentum)
        self.batch_size = batch_size

        self.stages = partition(model)
        for stage in self.stages:
            stage.module.train()
        self.num_stages = len(self.stages)
        if method == "petra":
            self.optimizers = [_StageOptimizer(self, [s.module]) for s in self.stages]
        else:
            self.optimizers = [_StageOptimizer(self, [s.module for s in self.stages])]
            self._segments = self._revbackprop_segments() if method == "revbackprop" else None
        self.tick = 0  # ticks run so far (petra) / train steps so far (baselines)
        self.batches_in = 0
        self.schedule = {}
        self.events = []
        self._labels = {}  # batch id -> labels, until the head has used them
        self._fwd_msgs = {}  # stage index -> (batch, output) sent to stage index + 1 last tick
        self._bwd_msgs = {}  # stage index -> (batch, x, dx) sent to stage index - 1 last tick

    # --- schedule ---------------------------------------------------------------------------------

    @property
    def peak_lr(self):
        """``base_lr * batch * accum_k / 256`` (None until the batch size is known)."""
        if self.batch_size is None:
            return None
        return self.base_lr * self.batch_size * self.accum_k / 256

    def lr_at(self, step):
        """The lr of optimizer step `step` (0-based): linear warm-up, then step decay."""
        peak = self.peak_lr
        if peak is None:
            raise RuntimeError("revkernels: the batch size is not known yet (pass batch_size or run a train_step)")
        if step < self.warmup_steps:
            return peak * (step + 1) / self.warmup_steps
        return peak * self.gamma ** sum(1 for m in self.milestones if m <= step)

    def buffer_stats(self):
        """Per stage: ``{"index", "kind", "reversible", "inputs", "tensors", "bytes", "peak_bytes"}``
        of its input FIFO right now."""
        return [{"index": s.index, "kind": s.kind, "reversible": s.reversible, "inputs": s.buffered_inputs,
                 "tensors": s.buffer_tensors, "bytes": s.buffer_bytes, "peak_bytes": s.peak_buffer_bytes}
                for s in self.stages]

    def _record(self, stage, what, batch):
        self.events.append((self.tick, stage, what, batch))
        self.schedule.setdefault((batch, stage), {})[what] = self.tick

    # --- training ---------------------------------------------------------------------------------

    def train_step(self, images, labels):
        """Feeds one batch: one tick of the pipeline (petra) or one forward/backward (baselines)."""
        if not isinstance(images, torch.Tensor):
            raise TypeError(f"revkernels: images must be a torch.Tensor, got {type(images).__name__}")
        if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.shape[0] != images.shape[0]:
            raise ValueError("revkernels: labels must be a 1-D tensor with one label per image, got "
                             f"{getattr(labels, 'shape', type(labels).__name__)} for {images.shape[0]} images")
        if self.batch_size is None:
            self.batch_size = int(images.shape[0])
        batch = self.batches_in
        self.batches_in += 1
        if self.method == "petra":
            self._labels[batch] = labels
            return self._tick((batch, images))
        return self._baseline_step(batch, images, labels)

    def pending(self):
        """True while some batch's backward has not run everywhere (petra)."""
        return self.method == "petra" and bool(self._fwd_msgs or self._bwd_msgs)

    def advance(self):
        """One tick without new input (draining the pipeline); its dict, or None if nothing is pending."""
        if self.method != "petra" or not self.pending():
            return None
        return self._tick(None)

    def flush(self):
        """Runs ticks without new input until the pipeline is empty; returns each tick's dict."""
        out = []
        while self.pending():
            out.append(self.advance())
        return out

    def _tick(self, new_input):
        t = self.tick
        fwd_msgs, bwd_msgs = {}, {}
        result = {"loss": None, "batch": None, "tick": t, "stepped": []}
        for i, stage in enumerate(self.stages):
            incoming = new_input if i == 0 else self._fwd_msgs.get(i - 1)
            if stage.is_last:
                if incoming is None:
                    continue
                batch, x = incoming
                self._record(i, "forward", batch)
                loss, _, x, dx = stage.forward_backward(x, self._labels.pop(batch))
                self._record(i, "backward", batch)
                result.update(loss=loss.item(), batch=batch)
                if i > 0:
                    bwd_msgs[i] = (batch, x, dx)
                if self.optimizers[i].after_backward():
                    result["stepped"].append(i)
                continue
            if incoming is not None:  # forward of the newest batch, latest parameters
                batch, x = incoming
                self._record(i, "forward", batch)
                fwd_msgs[i] = (batch, stage.forward(x, batch))
            pending = self._bwd_msgs.get(i + 1)
            if pending is not None:  # backward of the pending batch: (y, dy) from stage i + 1
                batch, y, dy = pending
                self._record(i, "backward", batch)
                x, dx = stage.backward(y, dy, batch)
                if i > 0:
                    bwd_msgs[i] = (batch, x, dx)
                if self.optimizers[i].after_backward():
                    result["stepped"].append(i)
        self._fwd_msgs, self._bwd_msgs = fwd_msgs, bwd_msgs
        self.tick += 1
        return result

    def _revbackprop_segments(self):
        segments, run = [], []
        for stage in self.stages:
            if stage.reversible:
                run.append(stage.module)
                continue
            if run:
                segments.append(ReversibleSequential(*run, engine="sequential"))
                run = []
            segments.append(stage.module)
        return segments

    def _baseline_step(self, batch, images, labels):
        modules = self._segments if self.method == "revbackprop" else [s.module for s in self.stages]
        for i in range(self.num_stages):
            self._record(i, "forward", batch)
        out = modules[0](images)
        for module in modules[1:]:
            out = module(*(out if isinstance(out, tuple) else (out,)))
        loss = F.cross_entropy(out, labels)
        loss.backward()
        for i in reversed(range(self.num_stages)):
            self._record(i, "backward", batch)
        stepped = self.optimizers[0].after_backward()
        result = {"loss": loss.item(), "batch": batch, "tick": self.tick,
                  "stepped": list(range(self.num_stages)) if stepped else []}
        self.tick += 1
        return result
