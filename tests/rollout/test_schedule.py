"""The rollout schedules on fakes: one step ahead, each rollout runs on the weights published
before it started (never on an update made while it ran), no rollout starts past the last step,
and a checkpoint taken while one is out saves the data position from before it drew its rows."""

from __future__ import annotations

import threading

from flowrl.rollout.schedule import OneStepAheadSchedule, SynchronousSchedule


class FakeBackend:
    def __init__(self):
        self.version, self.published = 0, []

    def publish(self, version):
        self.version = version
        self.published.append(version)


def test_one_step_ahead_order_of_rollouts_and_publishes():
    backend, events, position = FakeBackend(), [], {"rows": 0}
    release = threading.Event()

    def roll_out(step):
        if step > 1:
            release.wait(10)  # an early rollout runs while the caller "trains"
        position["rows"] += 8
        events.append((step, backend.version))
        return step

    schedule = OneStepAheadSchedule(
        backend, roll_out, has_step=lambda step: step <= 3, data_state=lambda: dict(position)
    )
    assert schedule.collect(1) == 1
    # step 2's rollout is out: a checkpoint now saves the position from before it drew its rows
    assert schedule.saved_data_state() == {"rows": 8}
    schedule.after_update(1)  # step 1's update: not published while step 2's rollout runs
    assert backend.published == []
    release.set()
    assert schedule.collect(2) == 2 and backend.published == [1]
    schedule.after_update(2)
    assert schedule.collect(3) == 3 and backend.published == [1, 2]
    schedule.after_update(3)
    assert schedule.saved_data_state() is None  # no step 4: nothing started
    schedule.finish()
    assert backend.published == [1, 2, 3]
    # Rollout k ran on the weights of step k - 2 (step 1 on the initial ones).
    assert events == [(1, 0), (2, 0), (3, 1)]


def test_synchronous_publishes_after_each_update():
    backend = FakeBackend()
    schedule = SynchronousSchedule(backend, roll_out=lambda step: step)
    assert schedule.collect(1) == 1
    schedule.after_update(1)
    assert backend.published == [1] and schedule.saved_data_state() is None
