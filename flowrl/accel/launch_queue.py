"""How far the host may run ahead of the GPU in the compiled modules' no-grad calls (rollouts).

A rollout forward at the recipes' sizes gives the GPU tens of milliseconds of work per block and
the host well under one to launch it, so the host runs ahead until the CUDA driver's command
buffer is full and each launch waits for room. Measured on Qwen-Image's recipe (one H200, 64 rows
per forward, the LoRA's low-rank GEMMs launched by cuBLAS): the GPU then went idle about three
times per block, 0.1-10 ms each, 1.6 s of a 19 s rollout, every time right before one of the
cuBLAS GEMMs the host was still waiting to launch in "Command Buffer Full": the room came back
too late for the queue to stay fed.

`QueuedCalls` keeps the host at most `depth` compiled calls ahead: after each call it records a
CUDA event, and once more than `depth` are pending it waits for the oldest (the GIL released).
The buffer then never fills, and the host still has `depth` blocks of GPU work to launch the next
one in. Only calls without grad are bounded (the rollout, the recompute's no-grad passes); the
training graphs' launches, whose backward runs on autograd's own thread, are not. Nothing here
changes what is computed, only when the host launches it.
"""

from __future__ import annotations

import collections
import threading

import torch

DEFAULT_DEPTH = 3  # compiled calls (blocks) the host may be ahead of the GPU; None: unbounded

_depth: int | None = DEFAULT_DEPTH
_per_thread = threading.local()  # each launching thread (the engine's, the trainer's) its own queue


def set_depth(depth: int | None) -> None:
    """Bound the host's lead to `depth` pending compiled calls per thread, or lift it (None)."""
    global _depth
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise ValueError(f"depth={depth!r} must be an integer >= 1, or None for no bound")
    _depth = depth


def depth() -> int | None:
    return _depth


class QueuedCalls:
    """The pending calls of one thread: an event per call, waited for beyond `depth`."""

    def __init__(self, make_event=torch.cuda.Event):
        self.make_event = make_event
        self.pending: collections.deque = collections.deque()

    def after_call(self, depth: int) -> None:
        event = self.make_event()
        event.record()
        self.pending.append(event)
        while len(self.pending) > depth:
            self.pending.popleft().synchronize()


def after_no_grad_call(output) -> None:
    """Called after each compiled no-grad call: bounds this thread's lead when `output` is on a GPU."""
    if _depth is None:
        return
    tensor = _first_tensor(output)
    if tensor is None or tensor.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return  # nothing launched on a GPU, or launches being captured into a graph (no waiting there)
    queue = getattr(_per_thread, "queue", None)
    if queue is None:
        queue = _per_thread.queue = QueuedCalls()
    queue.after_call(_depth)


def _first_tensor(output) -> torch.Tensor | None:
    """A module output's tensor (a tensor, or the first tensor of a tuple or list)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor)), None)
    return None
