r"""PETRA's exact tick-by-tick simulator (one process) and its baselines, with one optimizer recipe.

Timing (the worker view of PETRA: Rivaud et al., ICLR 2025, arXiv:2406.02052). Stages j = 1..J
(0-based index i = j - 1). Messages sent at tick t are received at tick t + 1. At every tick,
every stage j < J

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
    delayed      delayed gradients with input and parameter buffers (PipeDream-like "weight
                 stashing"): the same pipeline and timing as petra, but every stage j < J, reversible
                 or not, pushes (x_in, a copy of theta_j) at its forward and its backward pops them and
                 takes the vjp at the stored input with the *stored* parameters; the gradient is then
                 applied to the current parameters. Stage j holds 2(J - j) inputs and parameter copies
                 between ticks (`buffer_stats`: ``input_bytes`` + ``param_bytes``). Runs on the
                 distributed runtime too (the same `Worker.step`).
    backprop     end-to-end backprop: the stages called in order under ordinary autograd.
    revbackprop  reversible backprop: each run of consecutive reversible stages in one
                 `ReversibleSequential` on the sequential engine (rebuilds, stores only outputs),
                 no pipelining.
The baselines record forward and backward of batch b at tick b in every stage.

Gradient analysis (``analyze_every=N``). At every N-th optimizer step of each optimizer (its steps
N, 2N, ...; one per stage for petra/delayed, one for the whole model for the baselines), just before
the step, and for each stage i it covers: g = the averaged gradient about to be applied (``.grad / k``,
before weight decay and momentum) and g* = the end-to-end backprop gradient of the *same* k batches
(the optimizer's accumulation window) at the model's parameters at that moment (every stage's current
parameters, in the simulator's in-tick order), averaged alike. g* is computed with the run's grads set
aside, BatchNorm running statistics frozen (buffers restored) and under `torch.random.fork_rng`, so no
parameter, grad, BatchNorm running statistic or RNG state of the run changes. ``analysis`` gets one
record per stage: ``{"method", "stage", "step" (the optimizer's step count after this step, 1-based),
"tick", "batches", "cosine" = <g, g*>/(|g||g*|), "norm_ratio" = |g|/|g*|, "grad_norm", "e2e_norm"}``
(float64 reductions). For backprop, and for petra/delayed with J = 1, g = g* (cosine 1, ratio 1).
Costs one end-to-end forward/backward of k batches per stage analysed (simulate only).

Checkpoints. `state_dict()` holds everything a run needs to continue bit for bit: the stages' module
states, every optimizer's state (momentum), step counters and partially accumulated ``.grad``, the
in-flight pipeline (messages between workers, labels not yet used, every stage's FIFO with its
parameter copies), the analysis inputs and records, tick and batch counters, and which batch each of
the last 2R ticks fed (``fed``; what the distributed runtime needs to know which messages arrive),
and for the baselines (backprop, revbackprop), whose stages draw from the global generators, those
generators' states (loaded back by `load_state_dict`).
`load_state_dict` into a `Trainer` built with the same model and arguments. (``events``/``schedule``
restart empty.) A pipelined tick (petra, delayed) that raises (a label out of the head's range, a
BatchNorm stage given one value per channel) has run part of its workers' steps: the trainer then
raises on `train_step`, `advance` and `state_dict` until `load_state_dict` restores a checkpoint.
`revkernels.petra.distributed.merge_rank_states` / `split_trainer_state` convert
between this format (pipelined methods) and the distributed runtime's per-rank checkpoints.

Context. ``train_step(images, labels, **context)``: keywords of that batch (an attention mask, a
conditioning tensor, plain values) that every stage's module gets in the batch's forward, backward
(rebuild or recompute) and, for the head, forward-and-backward, with every method. A stage runs
different batches at one tick, so the trainer keeps each batch's context until the first worker
has run its backward (checkpoints hold them). Context tensors must not require grad (PETRA's
stages return no context grads); every stage module must accept the keywords (``**kwargs``).

Workers and groups. A tick is run by `Worker`s: by default one per stage; ``groups=R`` (or a list of
group sizes) puts R contiguous groups of stages on R workers, each running its group as one stage
(the forwards of its stages in order, then their backwards in reverse; a group holding the head
runs its whole forward, loss and backward in one tick), and the timing above applies to the workers:
worker w (1-based, of R) runs a batch's backward 2(R - w) ticks after its forward. `Worker.step` is
the per-tick step that every runtime runs (`revkernels.petra.distributed` runs one worker per process);
the messages it returns are contiguous tensors, so both runtimes compute on identical inputs.
"""
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from revkernels.engine.state import NO_CONTEXT
from revkernels.engine.structure import recompute_context
from revkernels.nn.reversible import ReversibleSequential
from revkernels.petra.partition import check_constant_context, check_stage_budget, count_sizes, partition, plan_memory

METHODS = ("petra", "delayed", "backprop", "revbackprop")
PIPELINED = ("petra", "delayed")  # the methods that run the tick-by-tick pipeline (workers, groups)
BASELINES = ("backprop", "revbackprop")  # whole-network steps: their stages draw from the global generators
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)


def _global_rng():
    """(the CPU generator's state, the CUDA generators' states where CUDA is initialized)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []


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
    """SGD with Nesterov momentum over `param_groups(modules, weight_decay)` (plain SGD for momentum 0)."""
    return torch.optim.SGD(param_groups(modules, weight_decay), lr=lr, momentum=momentum, nesterov=momentum > 0)


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
        self.window = []  # batch ids of the backward steps accumulated since the last step

    @property
    def stage_indices(self):
        ids = {id(m) for m in self.modules}
        return [s.index for s in self.trainer.stages if id(s.module) in ids]

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "backward_steps": self.backward_steps, "steps": self.steps,
                "window": list(self.window),
                "grads": [None if p.grad is None else p.grad.detach().clone() for p in self.params]}

    def load_state_dict(self, state):
        if len(state["grads"]) != len(self.params):
            raise ValueError("revkernels: the checkpoint's optimizer has a different number of parameters")
        self.optimizer.load_state_dict(state["optimizer"])
        self.backward_steps, self.steps = int(state["backward_steps"]), int(state["steps"])
        self.window = list(state["window"])
        for p, g in zip(self.params, state["grads"]):
            p.grad = None if g is None else g.detach().clone().to(p.device)

    def after_backward(self, batch=None):
        """Counts one backward step (of batch id `batch`); every k-th one, averages the grads and steps
        (analysing them first when due). True if stepped."""
        self.backward_steps += 1
        self.window.append(batch)
        if self.backward_steps % self.trainer.accum_k:
            return False
        k = self.trainer.accum_k
        n = self.trainer.analyze_every
        if n and (self.steps + 1) % n == 0:
            self.trainer._analyze(self)
        self.window = []
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


def split_groups(num_stages, groups=None):
    """Stage indices per worker: `groups` None (one stage per worker), an int R (R contiguous groups,
    sizes differing by at most one, the larger first) or a sequence of positive group sizes summing to
    `num_stages`."""
    if groups is None:
        return [[i] for i in range(num_stages)]
    if isinstance(groups, int) and not isinstance(groups, bool):
        if not 1 <= groups <= num_stages:
            raise ValueError(f"revkernels: groups must be an int in [1, {num_stages}] (the number of stages), got {groups}")
        sizes = count_sizes(num_stages, groups)
    else:
        sizes = list(groups) if hasattr(groups, "__iter__") and not isinstance(groups, (str, bytes)) else None
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes) \
                or sum(sizes) != num_stages:
            raise ValueError(f"revkernels: groups must be an int or positive group sizes summing to {num_stages}, "
                             f"got {groups!r}")
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


def first_batch_size(images):
    """The batch size a trainer given none takes from its first batch; an empty one raises (the
    peak learning rate scales with it: 0 would train nothing)."""
    if images.shape[0] == 0:
        raise ValueError("revkernels: the first batch is empty, so the batch size (which scales the learning rate) "
                         "cannot be taken from it: pass batch_size=... to the Trainer (or PipelineRank)")
    return int(images.shape[0])


def check_batch(images, labels, context):
    """Raises TypeError/ValueError naming the argument unless `images` is a tensor, `labels` one
    class index (int64, as cross-entropy takes) per image and `context` holds no tensor that requires
    grad. (Checked when the batch is fed: a pipelined run reaches its labels ticks later.)"""
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"revkernels: images must be a torch.Tensor, got {type(images).__name__}")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError("revkernels: labels must be a 1-D tensor with one label per image, got "
                         f"{getattr(labels, 'shape', type(labels).__name__)} for {images.shape[0]} images")
    if labels.dtype != torch.int64:
        raise TypeError(f"revkernels: labels must be int64 class indices, got {labels.dtype}")
    check_constant_context(context)


def own_batch(images, labels, context):
    """Copies of `images`, `labels` and `context`'s tensors: the pipeline holds a batch for ticks
    after `train_step` returns (the first stage's recompute, the head's labels), and a caller may
    refill its tensors for the next batch meanwhile (a reused prefetch buffer)."""
    return (images.detach().clone(), labels.clone(),
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in context.items()})


def kept_stages(stages):
    """Indices of the stages that keep their inputs for a memory budget (for checkpoints)."""
    return [s.index for s in stages if s.keeps_input]


def restore_kept(stages, kept, budget, saved_budget=None):
    """Sets the stages' ``keeps_input`` as a checkpoint's `kept_stages` says (its pending batches
    are in the FIFOs those stages had); ValueError where this run's `budget` is not the checkpoint's
    `saved_budget` (None: a checkpoint from before it was saved), whose plan the next batch would
    make again, or has none but the checkpoint kept some. Returns the plan to use: None (made again
    at the next batch, as the same plan)."""
    if saved_budget is not None and saved_budget != budget:
        raise ValueError(f"revkernels: the checkpoint was made with memory_budget={saved_budget!r}, this run has "
                         f"memory_budget={budget!r}: resume with the checkpoint's (the kept stages' FIFOs hold its "
                         "pending batches)")
    if kept and not budget:
        raise ValueError(f"revkernels: the checkpoint's stages {list(kept)} keep their inputs for a memory_budget, "
                         "but this run has none")
    for s in stages:  # (the FIFOs are replaced as a whole: no pending batch to keep consistent)
        s.memory_plan = None
        s._keeps_input = s.reversible and s.index in kept
    return None


def _contiguous(xs):
    return None if xs is None else tuple(None if t is None else t.contiguous() for t in xs)


class Worker:
    """A pipeline worker: consecutive stages (one by default) run as one stage, with their optimizers.

    `step` is one tick of the worker view (module docstring), shared by every runtime. ``index``
    is the worker's position (0-based), ``stages`` its `Stage`s, ``optimizers`` one `_StageOptimizer` per stage.
    """

    def __init__(self, index, stages, optimizers):
        self.index = index
        self.stages = list(stages)
        self.optimizers = list(optimizers)
        self.is_first = self.stages[0].is_first
        self.is_last = self.stages[-1].is_last

    @property
    def stage_indices(self):
        return [s.index for s in self.stages]

    def __repr__(self):
        return f"Worker({self.index}, stages={self.stage_indices})"

    def step(self, incoming, pending, labels, contexts=None):
        """One tick. `incoming`: ``(batch, x)`` to run forward (the image for the first worker) or None;
        `pending`: ``(batch, y, dy)`` from the next worker to run backward, or None; `labels`: a callable
        batch -> labels (used by the last worker); `contexts`: None or a callable batch -> its context
        (a dict of keywords for every stage module). Returns ``{"fwd": (batch, out) | None, "bwd":
        (batch, x, dx) | None (never for the first worker), "loss": float | None, "batch", "stepped":
        stage indices that took an optimizer step, "events": [(stage index, "forward" | "backward", batch)]}``.
        """
        res = {"fwd": None, "bwd": None, "loss": None, "batch": None, "stepped": [], "events": []}
        events = res["events"]
        context_of = contexts or (lambda _: NO_CONTEXT)

        def backward_through(stages, batch, y, dy):
            context = context_of(batch)
            for s, opt in reversed(stages):
                events.append((s.index, "backward", batch))
                y, dy = s.backward(y, dy, batch, **context)
                if opt.after_backward(batch):
                    res["stepped"].append(s.index)
            return y, dy

        pairs = list(zip(self.stages, self.optimizers))
        if self.is_last:
            if incoming is None:
                return res
            batch, x = incoming
            context = context_of(batch)
            for s in self.stages[:-1]:
                events.append((s.index, "forward", batch))
                x = s.forward(x, batch, **context)
            head, head_opt = pairs[-1]
            events.append((head.index, "forward", batch))
            loss, _, x, dx = head.forward_backward(x, labels(batch), **context)
            events.append((head.index, "backward", batch))
            if head_opt.after_backward(batch):
                res["stepped"].append(head.index)
            if len(pairs) > 1:
                x, dx = backward_through(pairs[:-1], batch, x, dx)
            res.update(loss=loss.item(), batch=batch)
            if not self.is_first:
                res["bwd"] = (batch, _contiguous(x), _contiguous(dx))
            res["stepped"].sort()
            return res
        if incoming is not None:  # forward of the newest batch, latest parameters
            batch, x = incoming
            context = context_of(batch)
            for s in self.stages:
                events.append((s.index, "forward", batch))
                x = s.forward(x, batch, **context)
            res["fwd"] = (batch, _contiguous(x))
        if pending is not None:  # backward of the pending batch: (y, dy) from the next worker
            batch, y, dy = pending
            x, dx = backward_through(pairs, batch, y, dy)
            if not self.is_first:
                res["bwd"] = (batch, _contiguous(x), _contiguous(dx))
        res["stepped"].sort()
        return res

    def finished(self, events):
        """The batches whose backward `events` (a step's) ran through this worker's first stage:
        the worker is done with them (their contexts may go)."""
        first = self.stages[0].index
        return [batch for stage, what, batch in events if stage == first and what == "backward"]


def check_exact_bits(state, bits):
    """ValueError naming exact_bits where checkpoint `state` holds int64 streams on another grid than
    `bits` (checkpoints from before exact_bits was saved, None, are not checked)."""
    if state.get("exact_bits") not in (None, bits):
        raise ValueError(f"revkernels: the checkpoint's exact_bits is {state['exact_bits']!r}, this run's {bits!r}: its "
                         f"in-flight int64 streams are on that grid; resume with exact_bits={state['exact_bits']!r}")


class Trainer:
    """Trains `model` by `method` ("petra", "delayed", "backprop" or "revbackprop") one batch at a time.

    Args:
        model: a model with ``stages`` (e.g. `revkernels.models.revnet18`), a list of stage
            modules, or any module (one stage). Trained in place, in train mode.
        method: see the module docstring.
        accum_k: backward steps per optimizer step (grads averaged).
        base_lr: lr for a global batch of 256; the peak lr is ``base_lr * batch * accum_k / 256``.
        warmup_steps: optimizer steps of linear warm-up.
        milestones: optimizer-step counts at which the lr is multiplied by `gamma`.
        weight_decay: applied to every parameter but norm-layer parameters and biases.
        gamma, momentum: step-decay factor and Nesterov momentum (0: plain SGD).
        batch_size: the per-step batch for the lr scaling; None takes the first batch's size.
        groups: petra/delayed only: None (one worker per stage) or the stage grouping of `split_groups`
            (an int R or a list of group sizes); each group runs as one worker (``workers``).
        analyze_every: None, or N: the gradient analysis at every N-th optimizer step (module
            docstring); records in ``analysis``.
        exact, exact_bits: `partition`'s (None: the model's runs' setting): reversible stages on
            int64 fixed-point streams (petra and delayed).
        memory_budget: petra only: `partition`'s; the plan (``memory_plan``, stages'
            ``keeps_input``) is made at the first batch, from its shapes and the worker grouping.

    `train_step(images, labels, **context)` runs one tick (petra) or one forward/backward (baselines) and
    returns a dict: ``loss`` (float, or None while the pipeline fills: petra's loss is the one its
    head computed this tick, for batch ``batch``), ``batch``, ``tick``, ``stepped`` (stage indices
    that took an optimizer step). `flush()` runs ticks without new input until every pending
    backward is done and returns their dicts. Partially accumulated grads (fewer than k backward
    steps) are left in ``.grad``, unapplied, by every method alike. `context`: keywords of this
    batch for every stage module (module docstring, "Context").

    ``schedule[(batch, stage_index)]`` is ``{"forward": tick, "backward": tick}``; ``events`` lists
    ``(tick, stage_index, "forward" | "backward", batch)`` in execution order.
    """

    def __init__(self, model, method="petra", accum_k=1, base_lr=0.1, warmup_steps=0, milestones=(),
                 weight_decay=5e-4, gamma=0.1, momentum=0.9, batch_size=None, groups=None, analyze_every=None,
                 exact=None, exact_bits=None, memory_budget=0):
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
        if analyze_every is not None:
            _check_int(analyze_every, "analyze_every", 1)
        self.analyze_every = analyze_every
        self.analysis = []  # gradient-analysis records
        self._inputs = {}  # batch id -> (images, labels), kept for the analysis while some window needs it
        self.method = method
        self.accum_k = accum_k
        self.base_lr = float(base_lr)
        self.warmup_steps = warmup_steps
        self.milestones = milestones
        self.weight_decay = float(weight_decay)
        self.gamma = float(gamma)
        self.momentum = float(momentum)
        self.batch_size = batch_size

        self.stages = partition(model, delayed=method == "delayed", exact=exact, exact_bits=exact_bits)
        self.exact = any(s.exact for s in self.stages)
        self.exact_bits = next((s.exact_bits for s in self.stages if s.exact), None)  # (the streams' grid)
        self.memory_budget = check_stage_budget(memory_budget, method == "delayed")
        if self.memory_budget and method not in PIPELINED:
            raise ValueError(f"revkernels: memory_budget applies to method 'petra' only, got method {method!r}")
        self.memory_plan = None  # made at the first batch (`plan_memory`)
        for stage in self.stages:
            stage.module.train()
        self.num_stages = len(self.stages)
        if groups is not None and method not in PIPELINED:
            raise ValueError(f"revkernels: groups applies to methods {list(PIPELINED)} only, got method {method!r}")
        self.groups = split_groups(self.num_stages, groups)
        if method in PIPELINED:
            self.optimizers = [_StageOptimizer(self, [s.module]) for s in self.stages]
            self.workers = [Worker(w, [self.stages[i] for i in g], [self.optimizers[i] for i in g])
                            for w, g in enumerate(self.groups)]
        else:
            self.optimizers = [_StageOptimizer(self, [s.module for s in self.stages])]
            self._segments = self._revbackprop_segments() if method == "revbackprop" else None
        self.tick = 0  # ticks run so far (petra) / train steps so far (baselines)
        self.batches_in = 0
        self.schedule = {}
        self.events = []
        self._labels = {}  # batch id -> labels, until the head has used them
        self._contexts = {}  # batch id -> its context (if any), until the first worker ran its backward
        self._fwd_msgs = {}  # worker index -> (batch, output) sent to worker index + 1 last tick
        self._bwd_msgs = {}  # worker index -> (batch, x, dx) sent to worker index - 1 last tick
        self._fed = {}  # tick -> batch id fed at that tick or None, for the last 2 * workers ticks (checkpoints)
        self._failed_tick = None  # what an exception inside a tick interrupted (see `_check_usable`)

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
        """Per stage: ``{"index", "kind", "reversible", "inputs", "tensors", "bytes", "input_bytes",
        "param_bytes", "peak_bytes"}`` of its FIFO right now (``bytes`` = inputs + parameter copies; the
        latter only under delayed gradients)."""
        return [{"index": s.index, "kind": s.kind, "reversible": s.reversible, "inputs": s.buffered_inputs,
                 "tensors": s.buffer_tensors, "bytes": s.buffer_bytes, "input_bytes": s.input_bytes,
                 "param_bytes": s.param_bytes, "peak_bytes": s.peak_buffer_bytes}
                for s in self.stages]

    def _record(self, stage, what, batch):
        self.events.append((self.tick, stage, what, batch))
        self.schedule.setdefault((batch, stage), {})[what] = self.tick

    # --- training ---------------------------------------------------------------------------------

    def train_step(self, images, labels, **context):
        """Feeds one batch (with its `context` keywords): one tick of the pipeline (petra) or one
        forward/backward (baselines)."""
        self._check_usable()
        check_batch(images, labels, context)
        if self.method in PIPELINED or self.analyze_every:
            images, labels, context = own_batch(images, labels, context)
        if self.batch_size is None:
            self.batch_size = first_batch_size(images)
        self.plan_memory(images, context)
        batch = self.batches_in
        self.batches_in += 1
        if self.analyze_every:
            self._inputs[batch] = (images, labels, context)
        if self.method in PIPELINED:
            self._labels[batch] = labels
            if context:
                self._contexts[batch] = context
            out = self._tick((batch, images))
        else:
            out = self._baseline_step(batch, images, labels, context)
        self._prune_inputs()
        return out

    def plan_memory(self, images, context=NO_CONTEXT):
        """Makes the ``memory_budget``'s plan from a batch's shapes (`partition.plan_memory`, with
        this trainer's worker groups) unless there is no budget or a plan was made; returns it."""
        if self.memory_budget and self.memory_plan is None:
            self.memory_plan = plan_memory(self.stages, self.memory_budget, images, context,
                                           [len(g) for g in self.groups])
        return self.memory_plan

    def pending(self):
        """True while some batch's backward has not run everywhere (petra, delayed)."""
        return self.method in PIPELINED and bool(self._fwd_msgs or self._bwd_msgs)

    def advance(self):
        """One tick without new input (draining the pipeline); its dict, or None if nothing is pending."""
        self._check_usable()
        if self.method not in PIPELINED or not self.pending():
            return None
        out = self._tick(None)
        self._prune_inputs()
        return out

    # --- gradient analysis ------------------------------------------------------------------------

    def _prune_inputs(self):
        """Drops the analysis inputs no optimizer can need any more (every stage sees batches in order:
        an optimizer needs its window and the batches it has not run backward on yet)."""
        if not self._inputs:
            return
        low = min((opt.window[0] if opt.window and opt.window[0] is not None else opt.backward_steps)
                  for opt in self.optimizers)
        for b in [b for b in self._inputs if b < low]:
            del self._inputs[b]

    def end_to_end_grads(self, batch_ids):
        """Per stage, the list of its parameters' end-to-end backprop gradients (zeros where unused)
        averaged over `batch_ids` (kept inputs) at the current parameters. Runs the stage modules in place with their grads set
        aside, BatchNorm running statistics frozen (and every buffer restored), under
        `torch.random.fork_rng`: the run's parameters, grads, buffers and RNG are untouched."""
        modules = [s.module for s in self.stages]
        params = [[p for p in m.parameters() if p.requires_grad] for m in modules]
        saved_grads = [[p.grad for p in ps] for ps in params]
        buffers = [(b, b.clone()) for m in modules for b in m.buffers()]
        for ps in params:
            for p in ps:
                p.grad = None
        try:
            with torch.random.fork_rng(devices=[]), torch.enable_grad(), recompute_context(*modules):
                for b in batch_ids:
                    images, labels, context = self._inputs[b]
                    out = modules[0](images, **context)
                    for m in modules[1:]:
                        out = m(*(out if isinstance(out, tuple) else (out,)), **context)
                    F.cross_entropy(out, labels).backward()
            n = len(batch_ids)
            return [[(p.grad if p.grad is not None else torch.zeros_like(p)) / n for p in ps] for ps in params]
        finally:
            for ps, gs in zip(params, saved_grads):
                for p, g in zip(ps, gs):
                    p.grad = g
            with torch.no_grad():
                for buf, old in buffers:
                    buf.copy_(old)

    def _analyze(self, opt):
        """Compares `opt`'s about-to-be-applied gradient with the end-to-end one (module docstring)."""
        if any(b is None or b not in self._inputs for b in opt.window):
            raise RuntimeError("revkernels: the gradient analysis lost the inputs of an accumulation window")
        e2e = self.end_to_end_grads(opt.window)
        k = self.accum_k
        for i in opt.stage_indices:
            dot = gg = rr = 0.0
            for p, ref in zip(self.stages[i].parameters(), e2e[i]):
                if p.grad is None:
                    rr += ref.double().square().sum().item()
                    continue
                g, r = p.grad.double() / k, ref.double()
                dot, gg, rr = dot + (g * r).sum().item(), gg + g.square().sum().item(), rr + r.square().sum().item()
            gn, rn = math.sqrt(gg), math.sqrt(rr)
            cos = dot / (gn * rn) if gn > 0 and rn > 0 else float("nan")
            self.analysis.append({"method": self.method, "stage": i, "step": opt.steps + 1, "tick": self.tick,
                                  "batches": list(opt.window), "cosine": cos,
                                  "norm_ratio": gn / rn if rn > 0 else float("nan"), "grad_norm": gn,
                                  "e2e_norm": rn})

    # --- checkpoints ------------------------------------------------------------------------------

    def state_dict(self):
        """Everything needed to continue this run exactly (module docstring); a deep copy."""
        self._check_usable()
        state = {"version": 1, "method": self.method, "num_stages": self.num_stages, "groups": self.groups,
                 "accum_k": self.accum_k, "tick": self.tick, "batches_in": self.batches_in,
                 "batch_size": self.batch_size,
                 "modules": [s.module.state_dict() for s in self.stages],
                 "optimizers": [opt.state_dict() for opt in self.optimizers],
                 "fifos": [(s.fifo_state(), s.peak_buffer_bytes, s.replay_state()) for s in self.stages],
                 "fwd_msgs": self._fwd_msgs, "bwd_msgs": self._bwd_msgs, "labels": self._labels,
                 "contexts": self._contexts, "inputs": self._inputs, "analysis": self.analysis, "fed": self._fed,
                 "exact": self.exact, "exact_bits": self.exact_bits, "kept": kept_stages(self.stages),
                 "memory_budget": self.memory_budget, "global_rng": _global_rng() if self.method in BASELINES else None}
        return copy.deepcopy(state)

    def load_state_dict(self, state):
        """Restores `state_dict()`'s output into this trainer (same model architecture and arguments)."""
        for key in ("method", "num_stages", "groups", "accum_k", "exact"):
            if state.get(key, False) != getattr(self, key):  # (exact: False in checkpoints from before it)
                raise ValueError(f"revkernels: the checkpoint's {key} is {state.get(key, False)!r}, this trainer's "
                                 f"{getattr(self, key)!r}")
        check_exact_bits(state, self.exact_bits)
        state = copy.deepcopy(state)
        self.memory_plan = restore_kept(self.stages, state.get("kept", []), self.memory_budget,
                                        state.get("memory_budget"))
        for s, module_state in zip(self.stages, state["modules"]):
            s.module.load_state_dict(module_state)
        for opt, opt_state in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(opt_state)
        for s, (fifo, peak, *replays) in zip(self.stages, state["fifos"]):  # (no replays: an older checkpoint)
            s.load_fifo_state(fifo, peak, *replays)
        self.tick, self.batches_in, self.batch_size = state["tick"], state["batches_in"], state["batch_size"]
        self._fwd_msgs, self._bwd_msgs = state["fwd_msgs"], state["bwd_msgs"]
        self._labels, self._inputs, self.analysis = state["labels"], state["inputs"], state["analysis"]
        # (checkpoints from before contexts: none, and analysis inputs without one)
        self._contexts = state.get("contexts", {})
        self._inputs = {b: (x, y, *rest) if rest else (x, y, {}) for b, (x, y, *rest) in self._inputs.items()}
        self._fed = state.get("fed", {})
        if state.get("global_rng") is not None:
            cpu, cuda = state["global_rng"]
            torch.set_rng_state(cpu)
            if cuda:
                torch.cuda.set_rng_state_all(cuda)
        self._failed_tick = None

    def _check_usable(self):
        """Raises once a tick of this trainer raised: its workers ran part of that tick (some
        stages stepped, messages and FIFOs half updated), so another tick would feed them wrong
        inputs. `load_state_dict` (a checkpoint from before) makes the trainer usable again."""
        if self._failed_tick is not None:
            raise RuntimeError(f"revkernels: {self._failed_tick} raised and left the pipeline part-way through "
                               "that tick; load_state_dict a checkpoint taken before it (or build a new Trainer) "
                               "to go on")

    def flush(self):
        """Runs ticks without new input until the pipeline is empty; returns each tick's dict."""
        out = []
        while self.pending():
            out.append(self.advance())
        return out

    def _tick(self, new_input):
        try:
            return self._run_tick(new_input)
        except BaseException as error:
            first_line = (str(error).splitlines() or [""])[0]
            self._failed_tick = f"tick {self.tick} ({type(error).__name__}: {first_line})"
            raise

    def _run_tick(self, new_input):
        fwd_msgs, bwd_msgs = {}, {}
        result = {"loss": None, "batch": None, "tick": self.tick, "stepped": []}
        for w, worker in enumerate(self.workers):
            incoming = new_input if w == 0 else self._fwd_msgs.get(w - 1)
            out = worker.step(incoming, self._bwd_msgs.get(w + 1), self._labels.pop, self._context_of)
            if w == 0:  # the last worker to use a batch
                for batch in worker.finished(out["events"]):
                    self._contexts.pop(batch, None)
            for stage, what, batch in out["events"]:
                self._record(stage, what, batch)
            if out["fwd"] is not None:
                fwd_msgs[w] = out["fwd"]
            if out["bwd"] is not None:
                bwd_msgs[w] = out["bwd"]
            if out["loss"] is not None:
                result.update(loss=out["loss"], batch=out["batch"])
            result["stepped"].extend(out["stepped"])
        self._fwd_msgs, self._bwd_msgs = fwd_msgs, bwd_msgs
        self._fed[self.tick] = None if new_input is None else new_input[0]
        for t in [t for t in self._fed if t < self.tick - 2 * len(self.workers)]:
            del self._fed[t]
        self.tick += 1
        return result

    def _context_of(self, batch):
        return self._contexts.get(batch, NO_CONTEXT)

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

    def _baseline_step(self, batch, images, labels, context):
        modules = self._segments if self.method == "revbackprop" else [s.module for s in self.stages]
        for i in range(self.num_stages):
            self._record(i, "forward", batch)
        out = modules[0](images, **context)
        for module in modules[1:]:
            out = module(*(out if isinstance(out, tuple) else (out,)), **context)
        loss = F.cross_entropy(out, labels)
        loss.backward()
        for i in reversed(range(self.num_stages)):
            self._record(i, "backward", batch)
        stepped = self.optimizers[0].after_backward(batch)
        result = {"loss": loss.item(), "batch": batch, "tick": self.tick,
                  "stepped": list(range(self.num_stages)) if stepped else []}
        self.tick += 1
        return result
