"""Replica choice and failover: least-in-flight balancing over engines or remote clients.

A replica is anything with `submit(prompt, params) -> Future` and, for groups,
`submit_batched(prompt, n, params) -> list[Future]` (an in-process DiffusionEngine, or a
`flowrl.client.RemoteEngine`, or a `flowrl.rollout.ray_engine.RayEngine`). The balancer counts samples handed to each
replica and not yet finished, and gives each request to the live replica with the fewest (ties:
the lowest index), so work spreads evenly even when replicas run at different speeds. A batched
request (one prompt's group) always goes to one replica as one call, and so do the prompts of a
`submit_many` call (N samples each): the replica queues them together.

Failover: a replica is down when its call or one of its futures raises `ReplicaDownError` (the
remote client raises it once its own bounded retries are spent; any other error belongs to the
request and is passed on). The request's samples that had not finished are re-sent, as the same
request (same prompt, seeds and settings, so the same samples), to another live replica; the
caller's futures never see the failure. A replica that is down `max_failures` times in a row is
dropped with a warning; when no replica is left, every unfinished request fails with
`NoReplicaLeftError` naming each replica and its last error.

This module knows nothing about HTTP, models or training.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from flowrl.client.errors import ReplicaDownError

logger = logging.getLogger(__name__)


class NoReplicaLeftError(RuntimeError):
    """Every replica was dropped: nothing can serve the rollout."""


def replica_name(replica, index: int) -> str:
    """How messages name a replica: a remote client's URL or an engine actor's name, else its index."""
    label = getattr(replica, "url", None) or getattr(replica, "name", None)
    return f"replica {index} ({label})" if label else f"replica {index}"


@dataclass
class _Request:
    """One caller request: its arguments and the futures the caller holds (one per sample).
    `prompt`: one prompt (num_samples samples of it, sample j with seed + j), or a list of prompts
    (`num_outputs_per_prompt` samples each, prompt i's sample j with seed + i * N + j: `submit_many`)."""

    prompt: str | list[str]
    num_samples: int
    params: object
    futures: list[Future]
    num_outputs_per_prompt: int = 1
    num_attempts: int = 0
    tried: set[int] = field(default_factory=set)


class LeastInFlightBalancer:
    """Balances requests over `replicas`, re-sending those of a replica that goes down.

    max_failures: how many times in a row a replica may be down before it is dropped."""

    def __init__(self, replicas: list, max_failures: int = 2):
        if not replicas:
            raise ValueError("the agent loop needs at least one engine (got an empty list)")
        if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 1:
            raise ValueError(f"max_failures={max_failures!r} must be an integer >= 1")
        self.replicas = list(replicas)
        self.max_failures = max_failures
        self.in_flight = [0] * len(self.replicas)
        self.assigned = [0] * len(self.replicas)  # samples ever assigned to each replica, for metrics
        self.num_resent = 0  # requests re-sent after their replica went down
        self.failures_in_a_row = [0] * len(self.replicas)
        self.last_error: list[str | None] = [None] * len(self.replicas)
        self.is_dropped = [False] * len(self.replicas)
        self._lock = threading.Lock()

    # --- public API ---------------------------------------------------------------------------------
    def submit(self, prompt: str, params) -> list[Future]:
        return self.submit_batched(prompt, 1, params)

    def submit_batched(self, prompt: str, n: int, params) -> list[Future]:
        """N samples of `prompt` from one replica; the futures outlive that replica going down."""
        request = _Request(prompt, n, params, [Future() for _ in range(n)])
        self._dispatch(request)
        return list(request.futures)

    def submit_many(self, prompts: list[str], params, n: int = 1) -> list[Future]:
        """N samples per prompt (prompt i's sample j with seed + i * N + j) from one replica, queued
        there as one call; the futures outlive that replica going down. Every replica needs
        `submit_many` (`supports_submit_many`)."""
        num_samples = len(prompts) * n
        request = _Request(list(prompts), num_samples, params, [Future() for _ in range(num_samples)], n)
        self._dispatch(request)
        return list(request.futures)

    @property
    def supports_submit_many(self) -> bool:
        return all(callable(getattr(r, "submit_many", None)) for r in self.live_replicas)

    @property
    def is_in_process(self) -> bool:
        """Whether every live replica is an engine of this process (`is_in_process`)."""
        return all(getattr(r, "is_in_process", False) for r in self.live_replicas)

    @property
    def live_replicas(self) -> list:
        with self._lock:
            return [r for r, dropped in zip(self.replicas, self.is_dropped) if not dropped]

    @property
    def supports_batched_generation(self) -> bool:
        return all(getattr(r, "supports_batched_generation", False) for r in self.live_replicas)

    # --- dispatch --------------------------------------------------------------------------------------
    def _pick(self, request: _Request) -> int | None:
        """The live replica for this attempt (one this request has not tried first), or None."""
        with self._lock:
            live = [i for i in range(len(self.replicas)) if not self.is_dropped[i]]
            if not live:
                return None
            index = min(live, key=lambda i: (i in request.tried, self.in_flight[i], i))
            self.in_flight[index] += request.num_samples
            self.assigned[index] += request.num_samples
            return index

    def _dispatch(self, request: _Request) -> None:
        """Send `request` to a live replica; with none left, fail its unfinished futures."""
        while True:
            index = self._pick(request)
            if index is None:
                self._fail(request, NoReplicaLeftError(self._none_left_message()))
                return
            request.num_attempts += 1
            request.tried.add(index)
            try:
                inner = _send(self.replicas[index], request)
            except ReplicaDownError as exc:
                self._release(index, request.num_samples)
                self._replica_down(index, exc)
                continue
            except BaseException as exc:
                self._release(index, request.num_samples)
                if request.num_attempts == 1:
                    raise  # bad input: the caller's own call raises, as with one engine
                self._fail(request, exc)
                return
            self._track(index, request, inner)
            return

    def _track(self, index: int, request: _Request, inner: list[Future]) -> None:
        """Resolve the caller's futures from `inner`; re-send the request once every inner future
        is done if any of them found the replica down."""
        state = {"pending": len(inner), "down": None}
        lock = threading.Lock()

        def done(j: int, future: Future) -> None:
            self._release(index, 1, count_assigned=False)
            error = None if future.cancelled() else future.exception()
            if future.cancelled():
                request.futures[j].cancel()
            elif error is None:
                self._replica_ok(index)
                _set_result(request.futures[j], future.result())
            elif isinstance(error, ReplicaDownError):
                with lock:
                    state["down"] = error
            else:
                _set_exception(request.futures[j], error)
            with lock:
                state["pending"] -= 1
                last, down = state["pending"] == 0, state["down"]
            if last and down is not None:
                self._replica_down(index, down)
                self._resend(request)

        for j, future in enumerate(inner):
            future.add_done_callback(lambda f, j=j: done(j, f))
            # A caller that cancels its sample (an interrupted wait) cancels it on the replica too.
            request.futures[j].add_done_callback(lambda f, inner_future=future: f.cancelled() and inner_future.cancel())

    def _resend(self, request: _Request) -> None:
        if all(f.done() for f in request.futures):
            return
        with self._lock:
            self.num_resent += 1
        if request.num_attempts >= len(self.replicas) * self.max_failures:
            self._fail(request, NoReplicaLeftError(f"gave up after {request.num_attempts} attempts: " + self.summary()))
            return
        try:
            self._dispatch(request)
        except BaseException as exc:  # noqa: BLE001 - runs in a done-callback: the error goes to the caller
            self._fail(request, exc)

    def drop(self, index: int, reason: str) -> None:
        """Drop replica `index` for good (its owner found it unusable), with a warning."""
        with self._lock:
            already = self.is_dropped[index]
            self.is_dropped[index] = True
            self.last_error[index] = reason
            num_live = self.is_dropped.count(False)
        if not already:
            name = replica_name(self.replicas[index], index)
            logger.warning("rollout %s dropped: %s; %d replica(s) left", name, reason, num_live)

    # --- replica health ------------------------------------------------------------------------------
    def _replica_ok(self, index: int) -> None:
        with self._lock:
            self.failures_in_a_row[index] = 0

    def _replica_down(self, index: int, error: BaseException) -> None:
        with self._lock:
            self.failures_in_a_row[index] += 1
            self.last_error[index] = str(error)
            drop = not self.is_dropped[index] and self.failures_in_a_row[index] >= self.max_failures
            if drop:
                self.is_dropped[index] = True
            num_live = self.is_dropped.count(False)
        name = replica_name(self.replicas[index], index)
        if drop:
            logger.warning(
                "rollout %s dropped: down %d times in a row (last error: %s); %d replica(s) left",
                name,
                self.max_failures,
                error,
                num_live,
            )
        else:
            logger.warning("rollout %s is down (%s); its unfinished requests go to another replica", name, error)

    def _release(self, index: int, count: int, count_assigned: bool = True) -> None:
        with self._lock:
            self.in_flight[index] -= count
            if count_assigned:
                self.assigned[index] -= count

    def summary(self) -> str:
        with self._lock:
            errors = list(self.last_error)
        return "; ".join(f"{replica_name(r, i)}: {errors[i] or 'no error'}" for i, r in enumerate(self.replicas))

    def _none_left_message(self) -> str:
        return (
            f"every rollout replica was dropped ({self.summary()}); start the servers again (or check "
            "rollout.servers / rollout.num_replicas) and resume the run from its last checkpoint"
        )

    @staticmethod
    def _fail(request: _Request, error: BaseException) -> None:
        for f in request.futures:
            _set_exception(f, error)


def _send(replica, request: _Request) -> list[Future]:
    """A single sample goes through `submit` (which every replica has), a group through
    `submit_batched`, a list of prompts through `submit_many`."""
    if isinstance(request.prompt, list):
        return replica.submit_many(request.prompt, request.params, request.num_outputs_per_prompt)
    if request.num_samples == 1:
        return [replica.submit(request.prompt, request.params)]
    return replica.submit_batched(request.prompt, request.num_samples, request.params)


def _set_result(future: Future, value) -> None:
    if not future.done():
        try:
            future.set_result(value)
        except Exception:  # noqa: BLE001 - resolved by another thread in between
            pass


def _set_exception(future: Future, error: BaseException) -> None:
    if not future.done():
        try:
            future.set_exception(error)
        except Exception:  # noqa: BLE001 - resolved by another thread in between
            pass
