"""The pareprop engine: the sequential engine's backward on two CUDA streams, PaReprop-style.

Each block's recompute and gradient step run on one stream, blocks alternating between two side
streams (block i on stream i % 2). Autograd runs a node's backward on the stream of its forward,
so a block's local graph is built and differentiated on the same stream, and the recompute of
block i-1 (on the other stream) overlaps block i's gradients::

    stream (i % 2):      recompute(i) ─────────┬──► grads(i) ──────────────┐
    stream ((i-1) % 2):                        └──► recompute(i-1) ──┬─────┴──► grads(i-1) ...
                                                  (waits for x of i)   (waits for dx of i)

Dependencies go only through events (`wait_event`) and `record_stream` on every tensor one stream
hands to the other: the host never waits for the device. The side streams wait for the caller's
stream at entry, and the caller's stream waits for both before the results are used. On CPU
the schedule is the sequential engine's.
"""
import contextlib

import torch

from revkernels.engine.sequential import add_param_grads, block_grads, recompute_step, reverse_blocks, run_reversible
from revkernels.engine.state import NO_CONTEXT

_SIDE_STREAMS = {}


def _side_streams(device):
    """Two streams per device, made once (creating streams per backward would leak handles)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _SIDE_STREAMS[device]


def _hand_over(tensors, stream):
    """Tell the caching allocator `stream` uses tensors made on another stream."""
    for t in tensors:
        if t is not None:
            t.record_stream(stream)


def reverse_blocks_two_streams(blocks, states, y1, y2, dy1, dy2, params, autocast_state=None, monitor=None,
                               context=NO_CONTEXT):
    """`reverse_blocks` with block i's steps on stream i % 2 (see the module docstring)."""
    if not y1.is_cuda:
        return reverse_blocks(blocks, states, y1, y2, dy1, dy2, params, autocast_state, monitor=monitor,
                              context=context)
    autocast = contextlib.nullcontext if autocast_state is None or autocast_state.off_then_and_now() else autocast_state.enter
    caller = torch.cuda.current_stream(y1.device)
    streams = _side_streams(y1.device)
    for stream in streams:
        stream.wait_stream(caller)
        _hand_over((y1, y2, dy1, dy2), stream)
    index = {id(p): i for i, p in enumerate(params)}
    param_grads = [None] * len(params)
    n = len(blocks)

    errors = [None] * n

    def recompute(i, a1, a2):
        stream = streams[i % 2]
        with torch.cuda.stream(stream), autocast():
            state = None if states is None else states[i]
            rec = recompute_step(blocks[i], a1, a2, state, context)
            if monitor is not None:
                errors[i] = monitor[0].error(monitor[1][i], rec.x1, rec.x2)
        return (rec, (a1, a2)), stream.record_event()

    (rec, out), rec_ready = recompute(n - 1, y1, y2)
    grads_ready = None
    for i in reversed(range(n)):
        stream, other = streams[i % 2], streams[(i - 1) % 2]
        if i > 0:  # rebuild block i-1's input on the other stream while block i's grads run here
            other.wait_event(rec_ready)
            x1, x2 = rec.x1, rec.x2.detach()
            _hand_over((x1, x2), other)
            next_rec, next_ready = recompute(i - 1, x1, x2)
        if grads_ready is not None:  # dy (and accumulated param grads) came from the other stream
            stream.wait_event(grads_ready)
            _hand_over((dy1, dy2), stream)
            _hand_over(param_grads, stream)
        with torch.cuda.stream(stream):
            grads = block_grads(blocks[i], rec, *out, dy1, dy2)
            add_param_grads(param_grads, index, zip(grads.params, grads.param_grads))
            grads_ready = stream.record_event()
        x1_out, x2_out = rec.x1, rec.x2.detach()
        dy1, dy2 = grads.dx1, grads.dx2
        del grads
        if i > 0:
            (rec, out), rec_ready = next_rec, next_ready
    for stream in streams:
        caller.wait_stream(stream)
    _hand_over((x1_out, x2_out, dy1, dy2), caller)
    _hand_over(param_grads, caller)
    if monitor is not None:
        monitor[0].report(errors)  # after the caller's stream waited for both side streams
    return x1_out, x2_out, dy1, dy2, param_grads


def run_pareprop(seq, x1, x2, context=NO_CONTEXT):
    return run_reversible(seq, x1, x2, reverse_blocks_two_streams, context)
