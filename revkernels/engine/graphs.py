"""The graphs engine: a reversible run's forward and backward replayed from CUDA graphs.

Eager reversible training is bound by the host on a fast GPU: every block's rebuild and gradient
step is dozens of small launches plus Python, so at small batches the GPU idles between them.
This engine captures the whole run once per input signature and replays it, so a step costs two
graph launches and a few copies:

- capture (first call with a signature): two warm-up iterations of forward + backward on a side
  stream (lazy initialisation, Triton compilation and cuBLAS/cuDNN plan choice stay out of the
  graphs; buffers such as BatchNorm running statistics are restored afterwards, so warm-up counts
  no batch), then the forward and the backward are captured into one memory pool. The backward
  is the pareprop walker (two streams inside the graph); if that cannot be captured, the
  single-stream walker is used (with a warning).
- replay: the inputs are copied into the static inputs, the forward graph replays and the outputs
  are returned as copies; the backward copies the output grads in, replays, and returns copies of
  the input and parameter grads. Parameters are inputs of the autograd node, so their grads reach
  ``.grad`` through autograd's accumulation, as in the other engines: gradient accumulation,
  tensor hooks and DDP behave the same.

A signature is the inputs' shapes, dtypes, device and requires_grad, the autocast mode, every
module's plain constant attributes (training flags, LayerNorm's eps, a block's causal flag, GELU's
approximate, dropout rates: `hyperparameters`) and the identity and storage of every parameter and
buffer; a new one
is captured (the last ``MAX_GRAPHS`` are kept). The parameters are read in place at each replay,
so optimizer steps are seen; replacing a parameter's storage triggers a new capture.

Where a graph cannot be used the call runs the pareprop engine eagerly, silently or with a
warning once per run and reason (`eager_reason`, `_captured`; the list: docs/engines.md).

Forward hooks of the blocks run during warm-up and capture only, not at replay.
"""
import collections
import contextlib
import gc
import warnings
import weakref

import torch

from revkernels.engine.fsdp import block_units
from revkernels.engine.pareprop import reverse_blocks_two_streams, run_pareprop
from revkernels.engine.sequential import reverse_blocks, run_reversible
from revkernels.engine.state import NO_CONTEXT, check_param_versions, differentiated_once, param_versions, records_graph
from revkernels.engine.structure import LRU, cached, unique_grad_params

MAX_GRAPHS = 4  # captured signatures kept per run (each holds its memory pool)
WARMUP_ITERS = 2


def random_blocks(seq):
    """Indices of the blocks of `seq` that draw random numbers in their current mode: each block's
    ``draws_random()``, the rule every engine uses to decide what to replay."""
    return [i for i, block in enumerate(seq.blocks) if block.draws_random()]


def eager_reason(seq, context):
    """Why a run of `seq` with these context keywords cannot be captured (warned once per run and
    reason), or None when it can be tried. A plain function of the run, so it is tested on CPU."""
    if block_units(seq) is not None:
        return "its blocks are sharded by FSDP2 (collectives cannot be captured)"
    if seq.exact:
        return "exact mode is not captured (its overflow check reads the flags on the host)"
    if context:
        return f"context keywords {sorted(context)} are not captured"
    if seq.preserve_rng_state:
        random = random_blocks(seq)
        if random:
            return (f"blocks {random[:3]} draw random numbers in training mode, and a captured recompute "
                    "cannot replay them (use eval mode, p=0, or the pareprop engine)")
    return None


def _is_constant(value):
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return True
    return isinstance(value, tuple) and all(map(_is_constant, value))


def _constant_slots(seq):
    # (module, names of its attributes holding plain constants): eps, normalized_shape, causal,
    # approximate, dropout rates, ... Which attributes those are is read once per structure; their
    # values are read at every call.
    return [(m, tuple(k for k, v in vars(m).items() if _is_constant(v))) for m in seq.modules()]


def hyperparameters(seq):
    """The plain constant attributes of every module of `seq` (LayerNorm's eps, a block's causal
    flag, GELU's approximate, ...), in module order: a captured graph baked them in, so a change
    must make a new signature."""
    return tuple(tuple(m.__dict__.get(k) for k in names) for m, names in cached(seq, "constant_slots", _constant_slots))


def _signature(seq, x1, x2):
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    tensors = tuple((id(t), t.data_ptr(), t.requires_grad) for t in seq.parameters()) + \
        tuple((id(t), t.data_ptr()) for t in seq.buffers())
    return (tuple(x1.shape), tuple(x2.shape), x1.dtype, x2.dtype, x1.device, x1.requires_grad, x2.requires_grad,
            autocast, hyperparameters(seq), tensors)


@contextlib.contextmanager
def _uncached_autocast():
    # Autocast's cast cache would keep low-precision copies of the weights made during warm-up,
    # and a graph captured with them would read stale weights after an optimizer step.
    cached = torch.is_autocast_cache_enabled()
    torch.clear_autocast_cache()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cached)


@contextlib.contextmanager
def _without_rng_replay(seq):
    # Nothing to replay (checked before capture), and reading generator states is not allowed
    # while a graph is being captured.
    preserve = seq.preserve_rng_state
    seq.preserve_rng_state = False
    try:
        yield
    finally:
        seq.preserve_rng_state = preserve


class _PendingToken:
    """Lives as long as the autograd graph of one replayed forward."""


@contextlib.contextmanager
def _capturing(graph, pool, stream):
    """Captures the body's work on `stream` into `graph`. Unlike torch.cuda.graph, an error in the
    body still ends the capture and restores the current stream, so a failed capture leaves the
    process usable (a stream left capturing breaks every later launch on it)."""
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                graph.capture_end()
            raise
        graph.capture_end()


@contextlib.contextmanager
def _sync_is_an_error():
    # A host synchronisation inside a capture invalidates it; finding it during warm-up (an error
    # instead of a sync) means no capture is attempted for such a run.
    previous = torch.cuda.get_sync_debug_mode()
    try:
        _set_sync_debug_mode("error")
        yield
    finally:
        _set_sync_debug_mode(previous)


def _set_sync_debug_mode(mode):
    # torch warns that the mode is a prototype: under an "error" warnings filter that warning raised
    # after the mode was set, and "error" stayed set for the whole process.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode(mode)


def forward_with_aliases(seq, x1, x2, params, walker):
    """``(y1, y2, aliases)``: `seq` run as one `ReversibleRun` whose parameter inputs are detached
    aliases of `params` (the same storage). Differentiating the outputs with respect to the aliases
    gives the parameter grads without running the parameters' own tensor hooks: warm-up and capture
    are not a backward of the caller's (at replay the grads reach the parameters through
    `GraphedRun`, and their hooks fire once)."""
    aliases = [p.detach().requires_grad_() for p in params]
    y1, y2 = run_reversible(seq, x1, x2, walker, param_inputs=aliases)
    return y1, y2, aliases


class HostSyncError(RuntimeError):
    """A block synchronised with the host during the graphs engine's warm-up."""


class CapturedRun:
    """The forward and backward graphs of one run for one input signature."""

    def __init__(self, seq, x1, x2, params, walker):
        self.params, self.walker = params, walker
        self.x1 = x1.detach().clone().requires_grad_(x1.requires_grad)
        self.x2 = x2.detach().clone().requires_grad_(x2.requires_grad)
        self.input_slots = [t.requires_grad for t in (self.x1, self.x2)]
        needed = [t for t in (self.x1, self.x2) if t.requires_grad]
        saved_buffers = [b.detach().clone() for b in seq.buffers()]
        caller = torch.cuda.current_stream(x1.device)
        side = torch.cuda.Stream(x1.device)
        side.wait_stream(caller)

        def forward_backward():
            y1, y2, aliases = forward_with_aliases(seq, self.x1, self.x2, params, walker)
            torch.autograd.grad((y1, y2), needed + aliases, (torch.ones_like(y1), torch.ones_like(y2)),
                                allow_unused=True)

        with _uncached_autocast(), _without_rng_replay(seq):
            with torch.cuda.stream(side):
                for i in range(WARMUP_ITERS):
                    if i == 0:  # lazy initialisation may synchronise once
                        forward_backward()
                        continue
                    try:
                        with _sync_is_an_error():
                            forward_backward()
                    except RuntimeError as error:
                        if "synchronizing" not in str(error):
                            raise
                        raise HostSyncError(f"a block synchronises with the host ({str(error).splitlines()[0]})") \
                            from error
            caller.wait_stream(side)
            with torch.no_grad():
                for buffer, saved in zip(seq.buffers(), saved_buffers):
                    buffer.copy_(saved)
            torch.cuda.synchronize(x1.device)
            gc.collect()
            self.pool = torch.cuda.graph_pool_handle()
            self.forward_graph = torch.cuda.CUDAGraph()
            with _capturing(self.forward_graph, self.pool, side):
                self.y1, self.y2, aliases = forward_with_aliases(seq, self.x1, self.x2, params, walker)
            self.dy1, self.dy2 = torch.empty_like(self.y1), torch.empty_like(self.y2)
            self.backward_graph = torch.cuda.CUDAGraph()
            with _capturing(self.backward_graph, self.pool, side):
                grads = torch.autograd.grad((self.y1, self.y2), needed + aliases, (self.dy1, self.dy2),
                                            allow_unused=True)
            caller.wait_stream(side)
        grads = list(grads)
        self.dx = [grads.pop(0) if needed else None for needed in self.input_slots]
        self.param_grads = grads
        self.y1, self.y2 = self.y1.detach(), self.y2.detach()
        self._pending = None

    def busy(self):
        """Whether a replayed forward still awaits its backward (static buffers in use)."""
        return self._pending is not None and self._pending() is not None

    def forward(self, x1, x2):
        self.x1.copy_(x1)
        self.x2.copy_(x2)
        self.forward_graph.replay()
        token = _PendingToken()
        self._pending = weakref.ref(token)
        return self.y1.clone(), self.y2.clone(), token

    def backward(self, dy1, dy2):
        self.dy1.copy_(dy1)
        self.dy2.copy_(dy2)
        self.backward_graph.replay()
        self._pending = None
        copy = lambda t: None if t is None else t.clone()  # noqa: E731
        return [copy(t) for t in self.dx], [copy(t) for t in self.param_grads]


class GraphedRun(torch.autograd.Function):
    """One autograd node replaying a `CapturedRun`; parameters are its inputs."""

    @staticmethod
    def forward(ctx, captured, x1, x2, *params):
        y1, y2, ctx.token = captured.forward(x1, x2)
        ctx.captured, ctx.params, ctx.param_versions = captured, params, param_versions(params)
        return y1, y2

    @staticmethod
    @differentiated_once
    def backward(ctx, dy1, dy2):
        check_param_versions(ctx.params, ctx.param_versions)
        (dx1, dx2), param_grads = ctx.captured.backward(dy1, dy2)
        ctx.token = None
        return (None, dx1, dx2, *param_grads)


class _RunGraphs:
    """What the engine keeps per run (outside the module, so copying or pickling it is unaffected)."""

    def __init__(self):
        self.captured = collections.OrderedDict()  # signature -> CapturedRun, oldest first
        self.failed = LRU(MAX_GRAPHS * 4)  # signature -> reason (the most recent ones)
        self.warned = set()


_RUNS = weakref.WeakKeyDictionary()


def _graphs_of(seq):
    if seq not in _RUNS:
        _RUNS[seq] = _RunGraphs()
    return _RUNS[seq]


def _warn_once(seq, reason):
    warned = _graphs_of(seq).warned
    if reason not in warned:
        warned.add(reason)
        warnings.warn(f"revkernels: engine='graphs' runs this call eagerly (pareprop engine): {reason}", stacklevel=4)


def _captured(seq, x1, x2, params):
    """The `CapturedRun` for this call's signature (capturing it if new), or a reason it cannot be."""
    graphs = _graphs_of(seq)
    cache, failed = graphs.captured, graphs.failed
    key = _signature(seq, x1, x2)
    if key in failed:
        return None, failed[key]
    if key in cache:
        cache.move_to_end(key)
        captured = cache[key]
        if captured.busy():
            return None, ("the previous forward of this input signature still awaits its backward "
                          "(two forwards before one backward)")
        return captured, None
    errors = []
    for walker in (reverse_blocks_two_streams, reverse_blocks):
        try:
            captured = CapturedRun(seq, x1, x2, params, walker)
        except HostSyncError as error:
            failed[key] = str(error)
            return None, failed[key]
        except Exception as error:  # capture can fail in any op; the message says which
            errors.append(f"{walker.__name__}: {type(error).__name__}: {str(error).splitlines()[0]}")
            continue
        if errors:
            _warn_once(seq, f"the two-stream backward could not be captured, the single-stream one is used ({errors[0]})")
        cache[key] = captured
        while len(cache) > MAX_GRAPHS:
            cache.popitem(last=False)
        return captured, None
    failed[key] = "capture failed: " + "; ".join(errors)
    return None, failed[key]


def run_graphs(seq, x1, x2, context=NO_CONTEXT):
    params = unique_grad_params(seq.blocks)
    if not (x1.is_cuda and records_graph(x1, x2, params, ())):
        return run_pareprop(seq, x1, x2, context)
    reason = eager_reason(seq, context)
    captured = None
    if reason is None:
        captured, reason = _captured(seq, x1, x2, params)
    if captured is None:
        _warn_once(seq, reason)
        return run_pareprop(seq, x1, x2, context)
    return GraphedRun.apply(captured, x1, x2, *params)


def clear_graphs(seq):
    """Frees the graphs (and their memory pools) captured for `seq`."""
    _RUNS.pop(seq, None)
