"""Waits that a stop request may cut short, without raising from a signal handler.

A signal handler that raises (as Python's own KeyboardInterrupt does) can strike while the main
thread is inside a lock's `__enter__` or `__exit__` (threading.Condition's, a Future's, an
Event's): the lock then stays held, and the next thread that needs it (a reward worker handing
in its scores, the engine completing a sample) waits forever. So a wait the trainer may abort
waits in slices of `POLL_S` seconds and calls `stop_check()` between them and once more at its
end, so a stop requested at any time during the wait ends it; `stop_check` raises
(flowrl.run.interrupts.PhaseAborted) once a stop was requested, from ordinary code that holds
no lock. Main-thread work that a stop should end at once runs on a thread of its own
(`call_abortably`) while the main thread waits for it in that way; a call a stop left behind is
waited for before the process exits (`wait_for_calls_left_behind`). Nothing here knows signals or
trainers.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.05  # how often an abortable wait looks for a stop request

StopCheck = Callable[[], None]


def wait_for_futures(futures: Iterable[concurrent.futures.Future], stop_check: StopCheck | None = None) -> None:
    """Until every future is done (finished, failed or cancelled)."""
    pending = set(futures)
    while pending:
        _, pending = concurrent.futures.wait(pending, timeout=None if stop_check is None else POLL_S)
        if stop_check is not None:
            stop_check()


def wait_for_event(event: threading.Event, stop_check: StopCheck | None = None) -> None:
    """Until `event` is set."""
    if stop_check is None:
        event.wait()
        return
    while not event.wait(POLL_S):
        stop_check()
    stop_check()


def wait_on_condition(
    condition: threading.Condition,
    predicate: Callable[[], bool],
    timeout_s: float | None = None,
    stop_check: StopCheck | None = None,
) -> bool:
    """With `condition` held: until predicate() holds or timeout_s seconds passed (as
    Condition.wait_for, whose answer it returns)."""
    if stop_check is None:
        return condition.wait_for(predicate, timeout_s)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not predicate():
        left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if left <= 0:
            break
        condition.wait(left)
        stop_check()
    stop_check()
    return predicate()


def run_in_thread(function: Callable[..., T], *args) -> concurrent.futures.Future:
    """`function(*args)` on a daemon thread; its result or error in the returned Future (a daemon
    thread never keeps an interrupted process alive)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the result
            future.set_exception(exc)

    threading.Thread(target=run, name=f"flowrl-{getattr(function, '__name__', 'work')}", daemon=True).start()
    return future


# Calls a stop left behind, still running (call_abortably): the process waits for them before it
# exits (wait_for_calls_left_behind), since a thread inside native code (onnxruntime's OCR) when the
# interpreter exits aborts the process ("terminate called without an active exception").
_left_behind: set[concurrent.futures.Future] = set()
_left_behind_lock = threading.Lock()


def _forget(future: concurrent.futures.Future) -> None:
    with _left_behind_lock:
        _left_behind.discard(future)


def call_abortably(function: Callable[..., T], *args, stop_check: StopCheck | None = None) -> T:
    """`function(*args)`; with a stop check, run on a thread of its own while this thread waits
    (`wait_for_futures`), so a stop ends the wait at once; the call, left behind, finishes alone
    (`wait_for_calls_left_behind` waits for it)."""
    if stop_check is None:
        return function(*args)
    future = run_in_thread(function, *args)
    try:
        wait_for_futures([future], stop_check)
    except BaseException:
        with _left_behind_lock:
            _left_behind.add(future)
        future.add_done_callback(_forget)  # at once when it is done already
        raise
    return future.result()


def wait_for_calls_left_behind(timeout_s: float | None = None) -> int:
    """Wait, up to `timeout_s` seconds, for the calls a stop left behind to finish; returns how
    many still run."""
    with _left_behind_lock:
        running = list(_left_behind)
    concurrent.futures.wait(running, timeout=timeout_s)
    return sum(not future.done() for future in running)
