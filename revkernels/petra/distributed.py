r"""PETRA's ``distributed`` runtime: one process per worker (a stage, or a group of stages), torch.distributed
point-to-point messages, exactly the simulator's tick semantics (`revkernels.petra.simulate`).

Launch.
    torchrun --nproc-per-node R -m revkernels.petra.train --runtime distributed [--ranks R] ...
    python -m revkernels.petra.train --runtime distributed --nproc R ...     # starts the R processes itself
From Python: `launch(fn, R, args)` starts R processes on a free local port (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in their environment) and runs ``fn(*args)`` in each; inside, `init()` joins the group and
`PipelineRank(model, ...)` runs this rank's worker with the same `train_step` / `advance` / `flush` calls
as `simulate.Trainer` (every rank makes the same calls with the same, deterministic batch sequence:
rank 0 uses the images, the last rank the labels, every rank the batch's context keywords
(``train_step(images, labels, **context)``, kept until the rank has run the batch's backward); no
labels or contexts cross the wire).

Backend: NCCL when CUDA is available with at least one device per rank (rank r on ``cuda:r``; the
control messages still use a gloo group), else gloo on CPU.

Methods: ``petra`` and ``delayed`` (the delayed-gradient baseline of `simulate`: same step, same
messages; its stages also buffer inputs and parameter copies). The gradient analysis
(``--analyze-every``) is simulator-only.

Checkpoints. `PipelineRank.state_dict()` (every rank, after the same tick) is this rank's share of the
run: its stages' module states, their optimizers (momentum, step and backward counters, partially
accumulated grads), their FIFOs (with parameter copies under delayed), the messages the neighbours sent
it during the tick just run (waited for: what it consumes next tick), the head's labels not used yet,
the contexts of the batches whose backward it has not run yet,
the tick and batch counters and which batch the last 2R ticks fed; its own sends are waited for
first. `load_state_dict` into a fresh `PipelineRank` (same model, grouping, world size and arguments)
continues bit for bit. The trainer CLI adds the data order and RNG state and writes
``<out>/checkpoint/rank{r}.pt``. The format is the simulator's, split by rank: `merge_rank_states`
turns the R rank states into a `simulate.Trainer.state_dict()` (``groups=R``) and `split_trainer_state`
does the reverse, so a run can move between the runtimes at a checkpoint.

Stages and ranks. The model's J stages are split into R contiguous groups (`simulate.split_groups`;
default R = world size, and R = J gives one stage per rank); rank w runs group w as one `simulate.Worker`,
the same per-tick step the simulator runs (``Trainer(..., groups=R)`` simulates the same grouping).
Every rank builds the whole model from the same seed (its own group trains; the others are only read
for shapes and, on the logging rank, receive the trained states for evaluation).

Protocol, per tick t on rank w (0-based, of R). Batch fed at tick s (``train_step``) is forwarded by
rank w at tick s + w and backwarded at tick s + 2(R - 1) - w (the last rank: forward, loss and backward
at s + R - 1), so every rank knows from the shared feed history which messages it gets at each tick:
    1. wait for the receives posted during tick t - 1 (what w - 1 and w + 1 sent at tick t - 1);
    2. post the receives for tick t + 1 into fresh buffers (communication overlaps this tick's compute);
    3. `Worker.step`: forward of the incoming batch, then backward of the pending one (rebuilding the
       input of reversible stages, popping the FIFO of the others), optimizer steps every k backwards;
    4. wait for the sends of tick t - 1 (their buffers are dropped only then), post this tick's sends:
       forward: the output tuple to w + 1; backward: (rebuilt input, input grad) to w - 1.
Under NCCL (which runs a pair's operations in order on one stream) the receives of step 2 are posted
with the sends of step 4, as one `batch_isend_irecv` group, to avoid a send queued behind a receive.
A message is one tensor per stream; tag = ((t mod 4096) * 2 + kind) * 16 + i (kind 0 forward, 1
backward; i the tensor's position: output streams, then for a backward the grads after the inputs).
Shapes are static: each rank computes every boundary's shapes and dtypes once by running the stages'
forwards on the ``meta`` device from the first batch's image shape (deep copies; no real compute).

Faults. The process group's timeout (``timeout`` s, default 30) bounds every wait; receives and sends
are waited on for ``timeout`` + 0.8 s (past the heartbeat's horizon, so that a silent rank is named by
its own stalled heartbeat rather than by a neighbour that waits on it). A failed or timed-out wait, a
dead peer's closed connection, a stalled heartbeat (a watchdog thread in every rank bumps a counter in
the rendezvous store every 0.2 s and watches the others'), or a store that stops answering for
``timeout`` s (rank 0 hung) makes the rank that notices write ``rank r (stages ...) failed: why`` into
the store and exit with status 1 (rank 0, the store's host, two polls later); every other rank's
watchdog sees it within a poll and exits 1 with the same message on stderr; losing the store means rank
0 (its host) died. So every process exits non-zero within ``timeout`` + 1 s of a failure, naming the
failed rank and its stages; never a hang: a killed rank is usually noticed at once (its connections
close), a hung one (alive but silent, e.g. stopped) by its stalled heartbeat after ``timeout`` s.
Test hook: ``REVKERNELS_PETRA_FAULT_AFTER=rank:tick[:STOP]`` SIGKILLs (SIGSTOPs) that rank at the start
of that tick, in the first attempt of a run only.

Restarts. ``torchrun --max-restarts N`` (or the trainer's ``--nproc R --max-restarts N``, which relaunches
the R processes itself) restarts every rank when one fails; `restart_attempt()` is the attempt's number
(``TORCHELASTIC_RESTART_COUNT`` under torchrun, ``REVKERNELS_PETRA_ATTEMPT`` under `launch`), `run_id()`
the id every attempt of the run shares, and the trainer resumes from the last complete set of rank
checkpoints written with that id, so a run that lost a rank ends with the parameters of an uninterrupted one.
"""
import copy
import datetime
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid

import torch
import torch.distributed as dist
from torch import nn

from revkernels.engine.state import NO_CONTEXT
from revkernels.petra.partition import _stage_modules, input_specs
from revkernels.petra.simulate import (PIPELINED, Trainer, check_batch, check_exact_bits, first_batch_size,
                                       kept_stages, restore_kept)

FAULT_ENV = "REVKERNELS_PETRA_FAULT_AFTER"
ATTEMPT_ENV = "REVKERNELS_PETRA_ATTEMPT"
RUN_ENV = "REVKERNELS_PETRA_RUN"
_agent_run_id = None  # under torchrun: the run id kept in its agent's store (`init`)
_PREFIX = "revkernels_petra/"
_FWD, _BWD = 0, 1


def _tag(tick, kind, i):
    return ((tick % 4096) * 2 + kind) * 16 + i


def _stages_str(indices):
    return f"stage {indices[0]}" if len(indices) == 1 else f"stages {indices[0]}-{indices[-1]}"


def _agent_store():
    """True under torchrun, whose agent (not rank 0) hosts the rendezvous store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def restart_attempt():
    """0 for a run's first attempt, n after n restarts (torchrun's or `launch`'s count)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(ATTEMPT_ENV) or 0)


def run_id():
    """The id that every attempt of this run shares and other runs do not (after `init`): ``REVKERNELS_PETRA_RUN``
    (the trainer's ``--nproc`` launcher sets one per command), else under torchrun a random one kept in its
    agent's store, which lives across restarts and ends with the command (torchrun without that store: its
    ``--rdzv-id``, whose default ``none`` every such run shares: give each run an ``--rdzv-id`` of its own, or
    a fresh ``--out``, or a restart may resume an earlier run's rank files); None otherwise."""
    return os.environ.get(RUN_ENV) or _agent_run_id or os.environ.get("TORCHELASTIC_RUN_ID")


def pick_backend(world_size):
    """'nccl' when CUDA has at least `world_size` devices, else 'gloo'."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def init(timeout=30.0, backend=None):
    """Joins the process group from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as set
    by torchrun or `launch`) unless already joined; returns the device this rank computes on."""
    global _agent_run_id
    if not dist.is_initialized():
        world = int(os.environ["WORLD_SIZE"])
        backend = backend or pick_backend(world)
        if _agent_store():
            # torchrun's agent keeps one store across restarts: a restarted group would read the dead attempt's
            # keys (gloo's peer addresses among them), so each attempt gets its own prefix.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout))
            # the first rank of the first attempt to get here sets the run's id; the others read it
            _agent_run_id = store.compare_set(_PREFIX + "run", "", uuid.uuid4().hex).decode()
            dist.init_process_group(backend, store=dist.PrefixStore(f"revkernels_petra/attempt{restart_attempt()}",
                                                                    store),
                                    rank=int(os.environ["RANK"]), world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout))
        else:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def boundary_specs(stages, groups, image_shape, dtype=torch.float32, context=NO_CONTEXT):
    """``specs[w]``: [(shape, dtype, grad dtype)] of worker w's output (the tuple it sends to w + 1; int64
    streams after an exact stage, whose grads come back in a float dtype), from a forward of deep copies of
    the stages on the meta device (with a batch's `context`, its tensors on meta too: `input_specs`)."""
    firsts = [group[0] for group in groups[1:]]
    if not firsts:
        return []
    specs = input_specs(stages[:firsts[-1] + 1], torch.empty(image_shape, dtype=dtype, device="meta"), context)
    return [specs[i] for i in firsts]


def _message(spec, grads=False):
    """The receive buffers' (shape, dtype) of a forward message (`spec`: a `boundary_specs` entry), or of a
    backward one: the inputs as sent forward, then their grads."""
    out = [(shape, dtype) for shape, dtype, _ in spec]
    return out + [(shape, grad) for shape, _, grad in spec] if grads else out


class PipelineRank:
    """This rank's worker of a PETRA pipeline over the initialised process group.

    Args:
        model: the whole model (built identically, same seed, on every rank), or a list of its stage
            modules, as `simulate.Trainer` takes it; trained in place.
        groups: the stage grouping (`simulate.split_groups`); None means as many groups as ranks.
        timeout: seconds before a silent peer counts as failed (also the process group's timeout).
        device: where this rank computes (default: the one `init` picked).
        batched: post each tick's receives and sends as one `batch_isend_irecv` group (default: under
            NCCL only; gloo posts the receives before the compute).
        method: "petra" or "delayed" (the delayed-gradient baseline: the same `Worker.step`, its stages
            buffer inputs and parameter copies; the messages are the same).
        trainer_kwargs: `simulate.Trainer`'s (accum_k, base_lr, warmup_steps, milestones, ...); not
            ``analyze_every`` (the analysis needs the whole model in one process: simulate only).

    `train_step(images, labels, **context)`, `advance()`, `flush()`, `pending()` as `simulate.Trainer`'s (a
    collective sequence: every rank makes the same calls); the loss is reported by the last rank.
    `buffer_stats()` (collective): every stage's FIFO statistics. `collect(dst)` (collective): the
    other ranks' stage states loaded into rank `dst`'s model, and every stage's optimizer step count.
    `state_dict()` / `load_state_dict(state)`: this rank's checkpoint (module docstring, "Checkpoints").
    `close()` (collective): stops the watchdog, waits for all ranks and leaves the group.
    """

    def __init__(self, model, groups=None, timeout=30.0, device=None, batched=None, method="petra", **trainer_kwargs):
        if method not in PIPELINED:
            raise ValueError(f"revkernels: the distributed runtime runs methods {list(PIPELINED)}, got {method!r}")
        if trainer_kwargs.get("analyze_every"):
            raise ValueError("revkernels: the gradient analysis (analyze_every) runs in the simulator only")
        if not dist.is_initialized():
            raise RuntimeError("revkernels: call revkernels.petra.distributed.init() first (or launch with torchrun)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = float(timeout)
        # Waits end past the watchdog's horizon (timeout + 2 polls): a silent rank is named by its stalled
        # heartbeat, not by a neighbour that is waiting on it.
        self._wait_s = self.timeout + 4 * _Watchdog.POLL
        self._meetings = 0  # `meet` calls so far (each meeting's store key)
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu"))
        for module in [model] if isinstance(model, nn.Module) else _stage_modules(model):
            if isinstance(module, nn.Module):  # not a module: `Trainer` names it below
                module.to(self.device)
        groups = self.world_size if groups is None else groups
        self.trainer = Trainer(model, method, groups=groups, **trainer_kwargs)
        self.model = model
        if len(self.trainer.workers) != self.world_size:
            raise ValueError(f"revkernels: {len(self.trainer.workers)} stage groups but {self.world_size} ranks: "
                             f"the number of groups (--ranks) must equal the world size")
        self.num_workers = self.world_size
        self.worker = self.trainer.workers[self.rank]
        self.stages = self.trainer.stages
        self.is_last = self.rank == self.world_size - 1
        self.tick = 0
        self.batches_in = 0
        self._fed = {}  # tick -> batch id fed at that tick, or None (the last 2R ticks)
        self._image_spec = None
        self._last_fed = None  # the last tick that fed a batch
        self._labels = {}
        self._contexts = {}  # batch id -> its context (if any), until this rank ran the batch's backward
        self._specs = None
        self._recvs = {}  # kind -> (batch, peer, [[tensor, work]])
        self._sends = []  # (tensor, peer, work) of the last tick's sends
        # NCCL runs a pair's p2p operations in order on one stream: a receive posted before this tick's
        # send would wait for the peer's send queued behind the peer's own early receive. So under NCCL
        # the next tick's receives are posted with this tick's sends as one group (batch_isend_irecv).
        self._batched = dist.get_backend() == "nccl" if batched is None else bool(batched)
        self._deferred = []  # P2POps (NCCL) of the receives not posted yet
        self._control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout)) \
            if dist.get_backend() != "gloo" else dist.group.WORLD
        fault = os.environ.get(FAULT_ENV)
        self._fault_tick = self._fault_signal = None
        if fault and restart_attempt() == 0:
            r, t, *sig = fault.split(":")
            if int(r) == self.rank:
                self._fault_tick, self._fault_signal = int(t), getattr(signal, "SIG" + (sig[0] if sig else "KILL"))
        self._names = [_stages_str(g) for g in self.trainer.groups]
        self._watchdog = _Watchdog(self)
        self._watchdog.start()

    # --- faults ----------------------------------------------------------------------------------------

    def describe(self, rank):
        return f"rank {rank} ({self._names[rank]})"

    def fail(self, culprit, why):
        """Records `culprit`'s failure in the store (the first report wins), prints it, exits 1."""
        msg = f"{self.describe(culprit)} failed: {why}"
        _abort(self, msg, publish=True)

    # --- the pipeline --------------------------------------------------------------------------------

    def pending(self):
        """True while the first rank has not run the backward of every batch fed so far."""
        return self._last_fed is not None and self.tick <= self._last_fed + 2 * (self.num_workers - 1)

    def train_step(self, images, labels, **context):
        check_batch(images, labels, context)
        batch_size = first_batch_size(images) if self.trainer.batch_size is None else None
        if self._specs is None:
            self._image_spec = (tuple(images.shape), images.dtype)
            self._specs = boundary_specs(self.stages, self.trainer.groups, tuple(images.shape), images.dtype, context)
        elif (tuple(images.shape), images.dtype) != self._image_spec:
            raise ValueError(f"revkernels: the distributed runtime needs every batch of one shape and dtype "
                             f"{self._image_spec}, got {(tuple(images.shape), images.dtype)}"
                             + (" (drop the last batch)" if images.dtype == self._image_spec[1] else ""))
        self._last_fed = self.tick
        if batch_size is not None:
            self.trainer.batch_size = batch_size
        self.trainer.plan_memory(images, context)  # (every rank makes the same plan)
        batch = self.batches_in
        self.batches_in += 1
        # copies of what this rank keeps for later ticks (a caller may refill its tensors meanwhile)
        if self.is_last:
            self._labels[batch] = labels.to(self.device, copy=True)
        if context:
            self._contexts[batch] = _to(context, self.device, copy=True)
        new = (batch, images.to(self.device, copy=True)) if self.rank == 0 else None
        return self._tick(batch, new)

    def advance(self):
        if not self.pending():
            return None
        return self._tick(None, None)

    def flush(self):
        out = []
        while self.pending():
            out.append(self.advance())
        return out

    def _fed_at(self, tick):
        return self._fed.get(tick)

    def _post_recvs(self, tick):
        """Posts the receives of `tick` (what the neighbours send at tick - 1)."""
        w, R = self.rank, self.num_workers
        self._recvs = {}
        if w > 0 and self._fed_at(tick - w) is not None:
            self._recvs[_FWD] = (self._fed_at(tick - w), w - 1,
                                 self._irecv(w - 1, tick - 1, _FWD, _message(self._specs[w - 1])))
        if w < R - 1 and self._fed_at(tick - 2 * (R - 1) + w) is not None:
            specs = _message(self._specs[w], grads=True)
            self._recvs[_BWD] = (self._fed_at(tick - 2 * (R - 1) + w), w + 1, self._irecv(w + 1, tick - 1, _BWD, specs))

    def _irecv(self, peer, tick, kind, specs):
        out = []
        for i, (shape, dtype) in enumerate(specs):
            t = torch.empty(shape, dtype=dtype, device=self.device)
            if self._batched:
                out.append([t, None])
                self._deferred.append((out[-1], dist.P2POp(dist.irecv, t, peer, tag=_tag(tick, kind, i))))
            else:
                try:  # gloo raises at once when the peer's connection has closed
                    out.append([t, dist.irecv(t, src=peer, tag=_tag(tick, kind, i))])
                except Exception as e:  # noqa: BLE001 - the sender is the peer that failed
                    self.fail(peer, f"a receive from it at tick {self.tick} failed ({_short(e)})")
        return out

    def _isend(self, ops, t, peer, tag):
        t = t.contiguous()
        if self._batched:
            ops.append(((t, peer), dist.P2POp(dist.isend, t, peer, tag=tag)))
        else:
            try:
                self._sends.append((t, peer, dist.isend(t, dst=peer, tag=tag)))
            except Exception as e:  # noqa: BLE001 - the receiver is the peer that failed
                self.fail(peer, f"a send to it at tick {self.tick} failed ({_short(e)})")

    def _wait(self, peer, works, what):
        deadline = datetime.timedelta(seconds=self._wait_s)
        try:
            for _, work in works:
                if work is not None and not work.wait(deadline):  # None: restored from a checkpoint
                    raise TimeoutError(f"no message within {self._wait_s:g} s")
        except Exception as e:  # noqa: BLE001 - any failure of a peer ends the run
            self.fail(peer, f"{what} from it at tick {self.tick} did not arrive ({_short(e)})".strip())
        return tuple(t for t, _ in works)

    def _tick(self, batch, new):
        t = self.tick
        if self._fault_tick is not None and t >= self._fault_tick:
            sys.stderr.write(f"revkernels petra: {FAULT_ENV}: {self._fault_signal.name} to rank {self.rank} at tick {t} "
                             f"(time {time.time():.3f})\n")
            sys.stderr.flush()
            self._fault_tick = None
            os.kill(os.getpid(), self._fault_signal)
        self._fed[t] = batch
        for old in [s for s in self._fed if s < t - 2 * self.num_workers]:
            del self._fed[old]
        incoming = pending = None
        if _FWD in self._recvs:
            b, peer, works = self._recvs[_FWD]
            incoming = (b, self._wait(peer, works, "the forward message"))
        if _BWD in self._recvs:
            b, peer, works = self._recvs[_BWD]
            msg = self._wait(peer, works, "the backward message")
            n = len(msg) // 2
            pending = (b, msg[:n], msg[n:])
        if new is not None:
            incoming = new
        self._post_recvs(t + 1)
        out = self.worker.step(incoming, pending, self._labels.pop, lambda b: self._contexts.get(b, NO_CONTEXT))
        for b in self.worker.finished(out["events"]):
            self._contexts.pop(b, None)
        for stage, what, b in out["events"]:
            self.trainer.events.append((t, stage, what, b))
            self.trainer.schedule.setdefault((b, stage), {})[what] = t
        self._wait_sends()
        sends = []
        if out["fwd"] is not None:
            for i, x in enumerate(out["fwd"][1]):
                self._isend(sends, x, self.rank + 1, _tag(t, _FWD, i))
        if out["bwd"] is not None:
            _, x, dx = out["bwd"]
            for i, y in enumerate(tuple(x) + tuple(dx)):
                self._isend(sends, y, self.rank - 1, _tag(t, _BWD, i))
        if self._batched and (self._deferred or sends):
            ops = self._deferred + sends
            works = dist.batch_isend_irecv([op for _, op in ops])
            for (slot, _), work in zip(self._deferred, works):
                slot[1] = work
            self._sends = [(t, peer, work) for ((t, peer), _), work in zip(sends, works[len(self._deferred):])]
            self._deferred = []
        self.tick += 1
        self.trainer.tick = self.tick
        return {"loss": out["loss"], "batch": out["batch"], "tick": t, "stepped": out["stepped"]}

    # --- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self):
        """This rank's share of the run's state at the current tick boundary (module docstring,
        "Checkpoints"). Waits for the receives posted for the next tick and for this tick's sends, so
        call it on every rank after the same tick (not itself a collective: no rank waits for a third)."""
        w, tr = self.rank, self.trainer
        fwd_in = bwd_in = None
        if _FWD in self._recvs:
            b, peer, works = self._recvs[_FWD]
            fwd_in = (b, self._wait(peer, works, "the forward message"))
            self._recvs[_FWD] = (b, peer, [[t, None] for t in fwd_in[1]])
        if _BWD in self._recvs:
            b, peer, works = self._recvs[_BWD]
            msg = self._wait(peer, works, "the backward message")
            n = len(msg) // 2
            bwd_in = (b, msg[:n], msg[n:])
            self._recvs[_BWD] = (b, peer, [[t, None] for t in msg])
        self._wait_sends()
        own = self._own()
        state = {"version": 1, "kind": RANK_STATE_KIND, "rank": w, "world_size": self.world_size,
                 "method": tr.method, "num_stages": tr.num_stages, "groups": tr.groups, "accum_k": tr.accum_k,
                 "tick": self.tick, "batches_in": self.batches_in, "batch_size": tr.batch_size,
                 "image_spec": self._image_spec, "fed": dict(self._fed), "last_fed": self._last_fed,
                 "modules": {i: self.stages[i].module.state_dict() for i in own},
                 "optimizers": {i: tr.optimizers[i].state_dict() for i in own},
                 "fifos": {i: (self.stages[i].fifo_state(), self.stages[i].peak_buffer_bytes,
                               self.stages[i].replay_state()) for i in own},
                 "fwd_in": fwd_in, "bwd_in": bwd_in, "labels": dict(self._labels),
                 "contexts": dict(self._contexts), "exact": tr.exact, "exact_bits": tr.exact_bits,
                 "kept": kept_stages(tr.stages),
                 "memory_budget": tr.memory_budget}
        return _to_cpu(copy.deepcopy(state))

    def load_state_dict(self, state):
        """Restores this rank from its `state_dict()` (a run with the same model, grouping, world size
        and arguments), before any `train_step`. Collective: checks every rank is at the same tick."""
        tr = self.trainer
        if not isinstance(state, dict) or state.get("kind") != RANK_STATE_KIND:
            raise ValueError("revkernels: not a revkernels.petra.distributed rank state")
        for key, mine in (("rank", self.rank), ("world_size", self.world_size), ("method", tr.method),
                          ("num_stages", tr.num_stages), ("groups", tr.groups), ("accum_k", tr.accum_k),
                          ("exact", tr.exact)):
            if state.get(key, False) != mine:  # (exact: False in checkpoints from before it)
                raise ValueError(f"revkernels: the checkpoint's {key} is {state.get(key, False)!r}, this rank's {mine!r}")
        check_exact_bits(state, tr.exact_bits)
        if self.tick or self.batches_in:
            raise RuntimeError("revkernels: load_state_dict into a fresh PipelineRank (before any train_step)")
        ticks = [None] * self.world_size
        dist.all_gather_object(ticks, (state["tick"], state["batches_in"]), group=self._control)
        if len(set(ticks)) != 1:
            raise ValueError(f"revkernels: the ranks' checkpoints are from different ticks (tick, batches) {ticks}: "
                             f"resume from one complete set of rank files")
        dev = self.device
        state = copy.deepcopy(state)
        tr.memory_plan = restore_kept(self.stages, state.get("kept", []), tr.memory_budget, state.get("memory_budget"))
        for i in self._own():
            self.stages[i].module.load_state_dict(state["modules"][i])
            tr.optimizers[i].load_state_dict(state["optimizers"][i])
            fifo, peak, *replays = state["fifos"][i]  # (no replays: an older checkpoint; generator states stay on the host)
            self.stages[i].load_fifo_state(_to(fifo, dev), peak, *replays)
        self.tick = tr.tick = state["tick"]
        self.batches_in, tr.batch_size = state["batches_in"], state["batch_size"]
        self._fed, self._last_fed = dict(state["fed"]), state["last_fed"]
        self._labels = _to(state["labels"], dev)
        self._contexts = _to(state.get("contexts", {}), dev)
        self._image_spec = None if state["image_spec"] is None else tuple(state["image_spec"])
        # The boundary shapes may need a batch's context: a pending one's (every batch has one shape),
        # else the next train_step's (nothing is received before it).
        self._specs = None
        if self._image_spec is not None and self.pending():
            context = next(iter(self._contexts.values()), NO_CONTEXT)
            self._specs = boundary_specs(self.stages, tr.groups, self._image_spec[0], self._image_spec[1], context)
        self._recvs = {}
        if state["fwd_in"] is not None:
            b, xs = _to(state["fwd_in"], dev)
            self._recvs[_FWD] = (b, self.rank - 1, [[t, None] for t in xs])
        if state["bwd_in"] is not None:
            b, xs, dxs = _to(state["bwd_in"], dev)
            self._recvs[_BWD] = (b, self.rank + 1, [[t, None] for t in tuple(xs) + tuple(dxs)])

    # --- collectives ----------------------------------------------------------------------------------

    def _own(self):
        return self.trainer.groups[self.rank]

    def buffer_stats(self):
        """Every stage's FIFO statistics (collective; this rank's stages are measured here)."""
        mine = {i: st for i, st in enumerate(self.trainer.buffer_stats()) if i in self._own()}
        parts = [None] * self.world_size
        dist.all_gather_object(parts, mine, group=self._control)
        merged = {}
        for p in parts:
            merged.update(p)
        return [merged[i] for i in range(len(self.stages))]

    def collect(self, dst=None):
        """Loads the other ranks' stage states into rank `dst`'s model (default the last rank) and returns
        every stage's optimizer step count there (None elsewhere). Collective."""
        dst = self.world_size - 1 if dst is None else dst
        mine = {i: ({k: v.detach().cpu() for k, v in self.stages[i].module.state_dict().items()},
                    self.trainer.optimizers[i].steps) for i in self._own()}
        parts = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(mine, parts, dst=dst, group=self._control)
        if self.rank != dst:
            return None
        steps = {}
        for r, part in enumerate(parts):
            for i, (state, n) in part.items():
                if r != self.rank:
                    self.stages[i].module.load_state_dict(state)
                steps[i] = n
        return [steps[i] for i in range(len(self.stages))]

    def _wait_sends(self):
        """Waits for the previous tick's sends (their tensors are released only then)."""
        deadline = datetime.timedelta(seconds=self._wait_s)
        for _, peer, work in self._sends:
            try:
                work.wait(deadline)
            except Exception as e:  # noqa: BLE001 - the receiver is the peer that failed
                self.fail(peer, f"a send to it at tick {self.tick - 1} failed ({_short(e)})")
        self._sends = []

    def barrier(self):
        """Waits for every rank (collective, on the control group)."""
        dist.barrier(group=self._control)

    def meet(self):
        """Waits for every rank (collective) however long the slowest takes: a rank that is busy (the
        logging rank evaluating the test set at an epoch's end) keeps its heartbeat, and one that dies
        or hangs is caught by the watchdog, so no deadline applies here (a barrier's, or the next
        tick's message wait, `timeout` + 0.8 s, stopped healthy runs whose evaluation took longer)."""
        store = self._watchdog.store
        if store is None:  # (no store, no watchdog: the barrier's deadline stands in)
            self.barrier()
            return
        key = f"{_PREFIX}meet/{self._meetings}"
        self._meetings += 1
        store.add(key, 1)
        while store.add(key, 0) < self.world_size:
            time.sleep(_Watchdog.POLL)

    def close(self):
        """Waits for the last sends, stops the watchdog, meets every rank and leaves the group."""
        self._wait_sends()
        self._watchdog.mark_done()
        self._watchdog.stop()
        try:
            if dist.get_backend(self._control) == "gloo":
                dist.monitored_barrier(group=self._control, timeout=datetime.timedelta(seconds=self.timeout))
            else:
                dist.barrier(group=self._control)
        except Exception as e:  # noqa: BLE001
            _abort(self, f"the final barrier failed: {e}", publish=False)
        dist.destroy_process_group()


RANK_STATE_KIND = "revkernels.petra.distributed rank state"


def _to(obj, device, copy=False):
    """`obj` (nested tuples/lists/dicts) with every tensor moved to `device` (copied with `copy`)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=copy)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(x, device, copy) for x in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device, copy) for k, v in obj.items()}
    return obj


def _to_cpu(obj):
    return _to(obj, "cpu")


def merge_rank_states(states):
    """The `simulate.Trainer.state_dict()` equivalent to every rank's `PipelineRank.state_dict()` (a list
    in rank order, all from the same tick): load it into ``Trainer(model, method, groups=R, ...)`` to
    continue the distributed run in the simulator, bit for bit. The analysis inputs/records start empty."""
    states = sorted(states, key=lambda s: s["rank"])
    first = states[0]
    R = first["world_size"]
    if [s["rank"] for s in states] != list(range(R)) or any(s.get("kind") != RANK_STATE_KIND for s in states):
        raise ValueError(f"revkernels: merge_rank_states needs one rank state per rank 0..{R - 1}")
    for key in ("tick", "batches_in", "method", "groups", "accum_k"):
        if any(s[key] != first[key] for s in states):
            raise ValueError(f"revkernels: the rank states differ in {key}: {[s[key] for s in states]}")
    modules, optimizers, fifos = {}, {}, {}
    fwd, bwd, labels, contexts = {}, {}, {}, {}
    for s in states:
        modules.update(s["modules"])
        optimizers.update(s["optimizers"])
        fifos.update(s["fifos"])
        if s["fwd_in"] is not None:
            fwd[s["rank"] - 1] = s["fwd_in"]
        if s["bwd_in"] is not None:
            bwd[s["rank"] + 1] = s["bwd_in"]
        labels.update(s["labels"])
        contexts.update(s.get("contexts", {}))
    n = first["num_stages"]
    fed = {t: b for t, b in first["fed"].items() if t >= first["tick"] - 2 * R}
    return copy.deepcopy({"version": 1, "method": first["method"], "num_stages": n, "groups": first["groups"],
                          "accum_k": first["accum_k"], "tick": first["tick"], "batches_in": first["batches_in"],
                          "batch_size": first["batch_size"], "modules": [modules[i] for i in range(n)],
                          "optimizers": [optimizers[i] for i in range(n)], "fifos": [fifos[i] for i in range(n)],
                          "fwd_msgs": fwd, "bwd_msgs": bwd, "labels": labels, "contexts": contexts,
                          "inputs": {}, "analysis": [],
                          "fed": fed, "exact": first.get("exact", False), "exact_bits": first.get("exact_bits"),
                          "kept": first.get("kept", []), "memory_budget": first.get("memory_budget")})


def split_trainer_state(state, rank, image_spec=None):
    """Rank `rank`'s `PipelineRank.state_dict()` from a pipelined `simulate.Trainer.state_dict()` made with
    ``groups=R`` (R ranks): the inverse of `merge_rank_states`. `image_spec` ``(shape, dtype)`` of a batch
    of images (needed once a batch has been fed, to size the receives). The gradient analysis records
    are dropped (the distributed runtime has none)."""
    groups = state["groups"]
    R, own = len(groups), groups[rank]
    fed = dict(state.get("fed", {}))
    if not fed and state["tick"]:
        if state["batches_in"] != state["tick"]:
            raise ValueError("revkernels: this simulator checkpoint predates the feed history ('fed'); it can be "
                             "split only if every tick fed a batch")
        fed = {t: t for t in range(max(0, state["tick"] - 2 * R), state["tick"])}
    last = [t for t, b in fed.items() if b is not None]
    if state["batches_in"] and image_spec is None:
        raise ValueError("revkernels: split_trainer_state needs image_spec=(shape, dtype) of the images")
    labels = state["labels"] if rank == R - 1 else {}
    # the contexts of the batches whose backward this rank runs at this tick or later
    pending = {b for t, b in fed.items() if b is not None and t + 2 * (R - 1) - rank >= state["tick"]}
    contexts = {b: c for b, c in state.get("contexts", {}).items() if b in pending}
    out = {"version": 1, "kind": RANK_STATE_KIND, "rank": rank, "world_size": R, "method": state["method"],
           "num_stages": state["num_stages"], "groups": groups, "accum_k": state["accum_k"], "tick": state["tick"],
           "batches_in": state["batches_in"], "batch_size": state["batch_size"],
           "image_spec": None if image_spec is None else (tuple(image_spec[0]), image_spec[1]),
           "fed": fed, "last_fed": max(last) if last else None,
           "modules": {i: state["modules"][i] for i in own}, "optimizers": {i: state["optimizers"][i] for i in own},
           "fifos": {i: state["fifos"][i] for i in own},
           "fwd_in": state["fwd_msgs"].get(rank - 1) if rank > 0 else None,
           "bwd_in": state["bwd_msgs"].get(rank + 1), "labels": labels, "contexts": contexts,
           "exact": state.get("exact", False), "exact_bits": state.get("exact_bits"), "kept": state.get("kept", []),
           "memory_budget": state.get("memory_budget")}
    return _to_cpu(copy.deepcopy(out))


def _short(e):
    """An exception in one line, without gloo's boilerplate."""
    text = str(e).split(". This is typically")[0].strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _store_lost(rank_obj, why):
    """The failure behind a rendezvous store that failed or stopped answering: its host's (rank 0, or torchrun's
    agent)."""
    if _agent_store():
        return f"the torchrun agent's rendezvous store {why}"
    if rank_obj.rank == 0:
        return f"the rendezvous store {why}"
    return f"{rank_obj.describe(0)} failed: the rendezvous store it hosts {why}"


def _abort(rank_obj, msg, publish):
    store = rank_obj._watchdog.store
    if publish and store is not None:
        # a store that stopped answering (its host hung) must not hold this exit up
        timer = threading.Timer(1.0, _abort, (rank_obj, f"{_store_lost(rank_obj, 'did not answer')} (then: {msg})",
                                              False))
        timer.daemon = True
        timer.start()
        try:
            key = _PREFIX + "failed"
            store.compare_set(key, "", msg)
            msg = store.get(key).decode()
        except Exception as e:  # noqa: BLE001 - the store is gone: with rank 0 (its host), or with torchrun's agent
            msg = f"{_store_lost(rank_obj, f'is gone ({_short(e)})')} (then: {msg})"  # the likelier first failure
    if store is not None and rank_obj.rank == 0 and not _agent_store():
        time.sleep(2 * _Watchdog.POLL)  # the store lives in this process: the others' watchdogs read the failure first
    sys.stderr.write(f"revkernels petra: rank {rank_obj.rank} ({rank_obj._names[rank_obj.rank]}) exiting: {msg}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


class _Watchdog(threading.Thread):
    """Heartbeats through the rendezvous store; exits the process when a failure is published, when a
    peer's heartbeat stalls for `timeout` s, or when the store (rank 0) is gone or stops answering for
    `timeout` s (a second thread, `_guard`, watches the store calls)."""

    POLL = 0.2

    def __init__(self, rank_obj):
        super().__init__(daemon=True, name="petra-watchdog")
        self.rank_obj = rank_obj
        self._stop_event = threading.Event()
        self._calling_since = None  # when the current poll's store calls began (None between polls)
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store: no watchdog (the waits' deadlines still apply)
            self.store = None

    def stop(self):
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=5)

    def run(self):
        if self.store is None:
            return
        r = self.rank_obj
        me, world, timeout = r.rank, r.world_size, r.timeout
        last = {p: (-1, time.monotonic()) for p in range(world) if p != me}
        threading.Thread(target=self._guard, daemon=True, name="petra-watchdog-guard").start()
        while not self._stop_event.wait(self.POLL):
            self._calling_since = time.monotonic()
            try:
                self.store.add(f"{_PREFIX}hb/{me}", 1)
                if self.store.check([_PREFIX + "failed"]):
                    _abort(r, self.store.get(_PREFIX + "failed").decode(), publish=False)
                now = time.monotonic()
                for p in last:
                    if self.store.check([f"{_PREFIX}done/{p}"]):
                        continue
                    count = self.store.add(f"{_PREFIX}hb/{p}", 0)
                    if count != last[p][0]:
                        last[p] = (count, now)
                    elif now - last[p][1] > timeout:
                        r.fail(p, f"no heartbeat for {timeout:g} s (hung or killed)")
            except Exception as e:  # noqa: BLE001 - the store lives in rank 0
                if self._stop_event.is_set():
                    return
                _abort(r, _store_lost(r, f"is gone ({_short(e)})"), publish=False)
            self._calling_since = None

    def _guard(self):
        """Exits the process when one poll's store calls have not returned for `timeout` s."""
        timeout = self.rank_obj.timeout
        while not self._stop_event.wait(self.POLL):
            since = self._calling_since
            if since is not None and time.monotonic() - since > timeout:
                _abort(self.rank_obj, _store_lost(self.rank_obj, f"stopped answering for {timeout:g} s (hung)"),
                       publish=False)

    def mark_done(self):
        if self.store is not None:
            try:
                self.store.set(f"{_PREFIX}done/{self.rank_obj.rank}", "1")
            except Exception:  # noqa: BLE001
                pass


# --- launching ---------------------------------------------------------------------------------------

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A forkserver (where the platform has one) starts the ranks: it imports these once (torch with them), and
# each rank is a fork of it, not a fresh interpreter that imports torch and, at its first optimizer,
# torch._dynamo again: a launch or restart of R ranks paid that R times before its first tick. The server
# imports, but runs nothing (no tensor op starts the OpenMP pool a fork would not have).
_PRELOAD = ["torch._dynamo", "revkernels.petra.distributed"]


def _start_context():
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child(rank, world, port, fn, args, log_dir, env, threads):
    # The launcher's environment as of the launch (a forkserver's children inherit the server's).
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if log_dir:
        for fd, name in ((1, "out"), (2, "err")):
            f = os.open(os.path.join(log_dir, f"rank{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
    if threads:
        torch.set_num_threads(threads)
    code = 0
    try:
        result = fn(*args)
        if log_dir and result is not None:
            torch.save(result, os.path.join(log_dir, f"rank{rank}.pt"))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class LaunchError(RuntimeError):
    """A failed `launch`: ``exitcodes`` per rank and ``exit_times``, the wall-clock time (``time.time()``,
    to the launcher's 0.05 s poll) at which each rank was seen to have exited."""

    def __init__(self, msg, exitcodes, exit_times):
        super().__init__(msg)
        self.exitcodes = exitcodes
        self.exit_times = exit_times


def launch(fn, nprocs, args=(), log_dir=None, env=None, threads=1, grace=60.0, timeout=None):
    """Runs ``fn(*args)`` in `nprocs` new processes forming a process group on a free local port: forks of a
    forkserver that has imported torch and revkernels (spawned interpreters where there is no forkserver).

    Each child gets the launcher's environment with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and `env` set, and
    `threads` torch threads. With `log_dir`, rank r's stdout/stderr go to ``rank{r}.out/.err`` there and a
    non-None return value to ``rank{r}.pt``; returns the list of those values (None where absent). If a
    child fails, the others get `grace` s to exit on their own and are then killed; raises `LaunchError`
    (with ``exitcodes``) naming the ranks that failed. `timeout`: seconds for the whole run (None: none).
    """
    ctx = _start_context()
    port = free_port()
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    env = {**os.environ, **(env or {})}
    procs = [ctx.Process(target=_child, args=(r, nprocs, port, fn, args, log_dir, env, threads), daemon=False)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    start, first_fail = time.monotonic(), None
    exit_times = [None] * nprocs
    try:
        while any(p.exitcode is None for p in procs):
            time.sleep(0.05)
            now = time.monotonic()
            for r, p in enumerate(procs):
                if exit_times[r] is None and p.exitcode is not None:
                    exit_times[r] = time.time()
            if first_fail is None and any(p.exitcode not in (None, 0) for p in procs):
                first_fail = now
            if (first_fail is not None and now - first_fail > grace) or (timeout is not None and now - start > timeout):
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
                for p in procs:
                    p.join(5)
                break
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(5)
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        def how(c):
            return f"signal {signal.Signals(-c).name}" if c is not None and c < 0 else f"status {c}"
        bad = ", ".join(f"rank {r} exited with {how(c)}" for r, c in enumerate(codes) if c != 0)
        raise LaunchError(f"revkernels: distributed PETRA run failed: {bad}", codes,
                          [t if t is not None else time.time() for t in exit_times])
    results = []
    for r in range(nprocs):
        path = os.path.join(log_dir, f"rank{r}.pt") if log_dir else None
        results.append(torch.load(path, weights_only=False) if path and os.path.exists(path) else None)
    return results
