"""flowrl.accel.launch_queue: the host stays at most `depth` compiled no-grad calls ahead of the
GPU; outputs are unchanged, CPU calls and grad calls are left alone."""

from __future__ import annotations

import pytest
import torch

from flowrl.accel import launch_queue
from flowrl.accel.regional_compile import compile_in_place


class _Event:
    log: list[str] = []
    made = 0

    def __init__(self):
        self.name = f"e{_Event.made}"
        _Event.made += 1

    def record(self):
        _Event.log.append(f"record {self.name}")

    def synchronize(self):
        _Event.log.append(f"wait {self.name}")


def test_the_oldest_pending_call_is_waited_for_beyond_the_depth():
    _Event.log, _Event.made = [], 0
    queue = launch_queue.QueuedCalls(make_event=_Event)
    for _ in range(5):
        queue.after_call(depth=2)
    waits = [entry for entry in _Event.log if entry.startswith("wait")]
    assert waits == ["wait e0", "wait e1", "wait e2"]  # the oldest first, once 2 are pending
    assert _Event.log[:4] == ["record e0", "record e1", "record e2", "wait e0"]
    assert len(queue.pending) == 2
    queue.after_call(depth=1)  # a lower bound catches up at once
    assert len(queue.pending) == 1


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_bad_depths_name_the_value(bad):
    with pytest.raises(ValueError, match="depth="):
        launch_queue.set_depth(bad)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x))


def test_cpu_calls_record_nothing(monkeypatch):
    made = []
    monkeypatch.setattr(launch_queue, "QueuedCalls", lambda: made.append(1))
    block = _Block()
    compile_in_place(block, backend="eager")
    with torch.no_grad():
        block(torch.randn(3, 8))
    assert not made


@pytest.mark.gpu
def test_bounded_no_grad_calls_on_cuda_give_the_same_outputs():
    torch._dynamo.reset()
    block = _Block().cuda()
    compile_in_place(block, backend="inductor")
    x = torch.randn(64, 8, device="cuda")
    try:
        launch_queue.set_depth(None)
        with torch.no_grad():
            free = [block(x + i) for i in range(6)]
        launch_queue.set_depth(1)
        with torch.no_grad():
            bounded = [block(x + i) for i in range(6)]
        assert len(launch_queue._per_thread.queue.pending) == 1
    finally:
        launch_queue.set_depth(launch_queue.DEFAULT_DEPTH)
    for a, b in zip(free, bounded):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
