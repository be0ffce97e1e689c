"""Cancellation, shutdown and failures inside the engine loop: cancelled samples leave promptly and
free their rows, every other request completes, the engine serves the next request, and no future
is ever left pending (after shutdown, after the engine thread dies, whatever the caller did to it)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from flowrl.engine import DiffusionEngine, EngineClosedError

LONG = 30  # steps of a request that is still denoising when the test acts on it


class Gate:
    """Wraps adapter.velocity: records each forward's rows and can hold forward `pause_at` until
    the test releases it, so the test acts at a known point between two steps."""

    def __init__(self, engine: DiffusionEngine, pause_at: int | None = None):
        self.inner = engine.adapter.velocity
        self.pause_at = pause_at
        self.rows: list[int] = []
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, latents, *args, **kwargs):
        self.rows.append(latents.shape[0])
        if len(self.rows) == self.pause_at:
            self.reached.set()
            assert self.release.wait(30), "the test never released the gate"
        return self.inner(latents, *args, **kwargs)


@pytest.fixture
def engine(tiny_sd3_path):
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_rows=8)
    yield engine
    engine.shutdown()


@pytest.fixture
def gate(engine):
    gate = Gate(engine, pause_at=2)
    engine.adapter.velocity = gate
    yield gate
    gate.release.set()
    del engine.adapter.velocity


def _served(engine, params):
    return engine.generate("a cat", params.replace(seed=99)).image.shape == (3, 64, 64)


def test_cancelled_future_leaves_between_steps_and_frees_its_rows(engine, gate, params):
    long = engine.submit("a cat", params.replace(num_inference_steps=LONG))
    short = engine.submit_batched("a dog", 2, params)
    assert gate.reached.wait(30)
    assert long.cancel()  # still pending while in flight, so the caller can cancel it
    paused_at = len(gate.rows)
    gate.release.set()
    assert all(f.result(timeout=30).image.shape == (3, 64, 64) for f in short)
    assert engine.wait_until_idle(30)
    assert long.cancelled()
    # Dropped before the next forward: every later forward holds only the two short samples.
    assert set(gate.rows[paused_at:]) == {2}, gate.rows
    stats = engine.stats()
    assert stats["num_samples_cancelled"] == 1 and stats["num_samples_finished"] == 2
    assert stats["num_in_flight"] == 0 and not engine.scheduler.has_work()
    assert _served(engine, params)


def test_asyncio_timeout_and_task_cancel_cancel_the_samples(engine, gate, params):
    long = params.replace(num_inference_steps=LONG)

    async def scenario():
        other = asyncio.ensure_future(engine.generate_batched_async("a dog", 2, params))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.generate_async("a cat", long), timeout=0.2)
        task = asyncio.ensure_future(engine.generate_batched_async("a bird", 3, long))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.release.set()
        return await asyncio.wait_for(other, timeout=30)

    outputs = asyncio.run(scenario())
    assert [o.image.shape for o in outputs] == [(3, 64, 64)] * 2
    assert engine.wait_until_idle(30)
    assert engine.stats()["num_samples_cancelled"] == 4
    assert _served(engine, params)


def test_interrupted_generate_cancels_its_samples(engine, gate, params, monkeypatch):
    from concurrent.futures import Future

    wait = Future.result
    monkeypatch.setattr(Future, "result", lambda self, timeout=None: wait(self, timeout=0.2))
    with pytest.raises(TimeoutError):  # the caller's wait is interrupted (a timeout stands in for Ctrl-C)
        engine.generate_batched("a cat", 2, params.replace(num_inference_steps=LONG))
    monkeypatch.undo()
    gate.release.set()
    assert engine.wait_until_idle(30)
    assert engine.stats()["num_samples_cancelled"] == 2
    assert _served(engine, params)


def test_futures_the_caller_already_resolved_do_not_stop_the_engine(engine, params):
    done_early = engine.submit("a cat", params)
    done_early.set_result("the caller's own value")
    running = engine.submit("a cat", params.replace(seed=5))
    running.set_running_or_notify_cancel()  # a caller marking it running: the engine still resolves it
    assert running.result(timeout=30).image.shape == (3, 64, 64)
    assert engine.wait_until_idle(30)
    assert done_early.result() == "the caller's own value"
    assert engine.stats()["num_samples_cancelled"] == 1  # dropped unrun: nobody waits for it
    assert engine.is_running and _served(engine, params)


def test_shutdown_with_requests_in_flight_leaves_nothing_pending(engine, gate, params):
    futures = engine.submit_batched("a cat", 3, params.replace(num_inference_steps=LONG))
    futures += [engine.submit("a dog", params.replace(num_inference_steps=LONG))]
    assert gate.reached.wait(30)
    stopper = threading.Thread(target=engine.shutdown)
    stopper.start()  # the engine thread is inside a forward; shutdown waits for it
    gate.release.set()
    stopper.join(30)
    assert not stopper.is_alive() and not engine.is_running
    assert all(f.done() for f in futures)
    for f in futures:
        with pytest.raises(EngineClosedError, match="shutdown"):
            f.result()
    with pytest.raises(EngineClosedError, match="new DiffusionEngine"):
        engine.submit("a cat", params)
    engine.shutdown()  # again: nothing to do


def test_an_unexpected_error_in_the_loop_fails_its_samples_and_the_loop_goes_on(engine, params):
    original = engine.scheduler.schedule
    calls = []

    def schedule_once_broken():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("scheduler bug")
        return original()

    engine.scheduler.schedule = schedule_once_broken
    try:
        with pytest.raises(RuntimeError, match="scheduler bug"):
            engine.generate("a cat", params)
        assert _served(engine, params)
    finally:
        del engine.scheduler.schedule
    assert engine.stats()["num_samples_failed"] == 1


class _ThreadKiller(BaseException):
    """Not an Exception: nothing inside the loop handles it, so the engine thread dies."""


def test_a_dead_engine_thread_fails_every_future_and_the_agent_loop_does_not_hang(engine, params):
    from flowrl.config import RolloutConfig
    from flowrl.rollout.agent_loop import AgentLoop
    from flowrl.rollout.batch import RolloutBatch

    def die():
        raise _ThreadKiller("simulated death of the engine thread")

    engine._loop._iterate = die
    loop = AgentLoop(engine, RolloutConfig(n=2, sampling=params.replace(seed=None)))
    batch = RolloutBatch.from_rows([{"raw_prompt": "a cat"}, {"raw_prompt": "a dog"}]).repeat(2, interleave=True)
    errors = []

    def rollout():
        try:
            loop.generate_sequences(batch)
        except RuntimeError as error:
            errors.append(error)

    worker = threading.Thread(target=rollout)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the agent loop waits on a dead engine"
    assert len(errors) == 1 and isinstance(errors[0].__cause__, EngineClosedError)
    assert "died" in str(errors[0])
    engine._loop._thread.join(30)  # it fails the futures as its last act, then ends
    assert not engine.is_running
    with pytest.raises(EngineClosedError, match="died"):
        engine.submit("a cat", params)
