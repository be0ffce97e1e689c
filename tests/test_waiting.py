"""Abortable waits (flowrl.waiting): they return once their futures or event are done, and a stop
check that raises ends them within a poll slice, from ordinary code, with no lock held; a call
made abortably returns its result or raises its error, or ends at a stop."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from flowrl.rewards import AsyncRewardScorer, Reward
from flowrl.run.interrupts import PhaseAborted, StopSignals
from flowrl.waiting import (
    POLL_S,
    call_abortably,
    wait_for_calls_left_behind,
    wait_for_event,
    wait_for_futures,
    wait_on_condition,
)


class _Stop:
    """A stop check that raises once `requested` is set, counting its calls."""

    def __init__(self):
        self.requested = False
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.requested:
            raise PhaseAborted()


def _later(seconds: float, fn) -> None:
    threading.Timer(seconds, fn).start()


def test_the_waits_return_when_done_and_check_for_a_stop_meanwhile():
    done, failed = Future(), Future()
    stop = _Stop()
    _later(0.2, lambda: (done.set_result(1), failed.set_exception(TimeoutError("a sample's own timeout"))))
    wait_for_futures([done, failed], stop)  # a failed future is done too: its error is the caller's
    assert stop.calls >= 2 and failed.exception() is not None
    event = threading.Event()
    _later(0.2, event.set)
    wait_for_event(event, stop)
    assert event.is_set()


def test_a_stop_ends_the_waits_within_a_poll_slice():
    stop = _Stop()
    _later(0.1, lambda: setattr(stop, "requested", True))
    start = time.perf_counter()
    with pytest.raises(PhaseAborted):
        wait_for_futures([Future()], stop)  # never done
    assert time.perf_counter() - start < 0.1 + 10 * POLL_S
    with pytest.raises(PhaseAborted):
        wait_for_event(threading.Event(), stop)


def test_a_sliced_condition_wait_answers_as_wait_for_does():
    condition, state, stop = threading.Condition(), {"ready": False}, _Stop()

    def ready():
        with condition:
            state["ready"] = True
            condition.notify_all()

    with condition:
        start = time.perf_counter()
        assert wait_on_condition(condition, lambda: state["ready"], 0.2, stop) is False  # timed out
        assert 0.2 <= time.perf_counter() - start < 0.2 + 10 * POLL_S
        _later(0.1, ready)
        assert wait_on_condition(condition, lambda: state["ready"], None, stop) is True
    assert stop.calls >= 4


def test_a_call_made_abortably_returns_raises_or_ends_at_a_stop():
    assert call_abortably(max, 1, 2) == 2  # no stop check: called right here
    stop = _Stop()
    assert call_abortably(sorted, [3, 1, 2], stop_check=stop) == [1, 2, 3]
    with pytest.raises(ZeroDivisionError):
        call_abortably(lambda: 1 / 0, stop_check=stop)
    _later(0.1, lambda: setattr(stop, "requested", True))
    start = time.perf_counter()
    with pytest.raises(PhaseAborted):
        call_abortably(time.sleep, 5, stop_check=stop)
    assert time.perf_counter() - start < 1.0


def test_a_stop_during_the_reward_wait_leaves_a_scorer_that_closes():
    class Blocked(Reward):
        name = "blocked"
        gate = threading.Event()

        def score_batch(self, images, prompts, metadata):
            assert self.gate.wait(10)
            return np.zeros(len(images))

    before = set(threading.enumerate())
    scorer = AsyncRewardScorer(Blocked(), num_workers=1)
    for row in range(3):
        scorer.submit(row, np.zeros((3, 8, 8), np.uint8), "", {})
    stop = _Stop()
    stop.requested = True
    with pytest.raises(PhaseAborted):
        scorer.results(stop_check=stop)
    Blocked.gate.set()
    scorer.close(drop_pending=True)  # the condition's lock is free: the worker hands in and exits
    assert set(threading.enumerate()) <= before


def test_a_signal_outside_abortable_work_only_asks_for_a_stop():
    """The handler raises inside `abortable()` alone; during a wait it sets `requested`, which the
    wait's check turns into PhaseAborted."""
    import signal

    with StopSignals("test") as signals:
        signal.raise_signal(signal.SIGINT)  # no exception here: nothing abortable is running
        assert signals.requested == signal.SIGINT
        with pytest.raises(PhaseAborted):
            wait_for_event(threading.Event(), signals.check)


def test_a_call_a_stop_left_behind_is_waited_for_before_the_exit():
    """The trainer waits for it on its way out: a thread still inside native code (onnxruntime's
    OCR) when the interpreter exits aborts the process (issue 52)."""
    release = threading.Event()
    stop = _Stop()
    _later(0.1, lambda: setattr(stop, "requested", True))
    with pytest.raises(PhaseAborted):
        call_abortably(release.wait, 30, stop_check=stop)
    start = time.perf_counter()
    assert wait_for_calls_left_behind(0.2) >= 1  # still running (other tests' may be too): reported
    assert time.perf_counter() - start < 2  # not waited for past the bound
    _later(0.1, release.set)
    assert wait_for_calls_left_behind(10) == 0  # done: every call left behind is waited for
    assert wait_for_calls_left_behind(0) == 0


def test_a_cancelled_rowwise_reward_ends_its_batch_at_the_next_row():
    from flowrl.rewards import RewardError, RowwiseReward, build_reward

    class Slow(RowwiseReward):
        name = "slow"
        rows_scored = 0

        def score_row(self, image, prompt, metadata):
            Slow.rows_scored += 1
            if Slow.rows_scored == 2:
                self.cancel()  # as the trainer does from another thread when the run stops
            return 1.0

    images = np.zeros((10, 3, 8, 8), np.uint8)
    with pytest.raises(RewardError, match="row 2: scoring was cancelled"):
        Slow()(images, [""] * 10, [{}] * 10)
    assert Slow.rows_scored == 2
    # Combined rewards pass the cancel on to every reward they hold.
    multi = build_reward({"name": "multi", "options": {"components": [{"name": "ocr"}, {"name": "image_flatness"}]}})
    routed = build_reward({"name": "route_by_data_source", "options": {"routes": {"ocr": "ocr"}, "default": "ocr"}})
    for reward in (multi, routed):
        reward.cancel()
        held = [r for *_, r in reward.components] if reward is multi else [*reward.routes.values(), reward.default]
        assert reward.is_cancelled and all(r.is_cancelled for r in held)
