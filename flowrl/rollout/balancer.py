"""Replica choice: least-in-flight balancing over engines (or clients with the same methods).

A replica is anything with `submit(prompt, params) -> Future` and
`submit_batched(prompt, n, params) -> list[Future]` (an in-process DiffusionEngine, or a remote
client). The balancer counts samples handed to each replica and not yet finished, and picks the
replica with the fewest (ties: the lowest index), so work spreads evenly even when replicas run at
different speeds.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future


class LeastInFlightBalancer:
    def __init__(self, replicas: list):
        if not replicas:
            raise ValueError("the agent loop needs at least one engine (got an empty list)")
        self.replicas = list(replicas)
        self.in_flight = [0] * len(self.replicas)
        self.assigned = [0] * len(self.replicas)  # total samples ever assigned, for metrics
        self._lock = threading.Lock()

    def _pick(self, num_samples: int) -> int:
        with self._lock:
            index = min(range(len(self.replicas)), key=lambda i: (self.in_flight[i], i))
            self.in_flight[index] += num_samples
            self.assigned[index] += num_samples
        return index

    def _track(self, index: int, futures: list[Future]) -> list[Future]:
        def done(_):
            with self._lock:
                self.in_flight[index] -= 1

        for f in futures:
            f.add_done_callback(done)
        return futures

    def submit(self, prompt: str, params) -> list[Future]:
        index = self._pick(1)
        try:
            return self._track(index, [self.replicas[index].submit(prompt, params)])
        except BaseException:
            self._release(index, 1)
            raise

    def submit_batched(self, prompt: str, n: int, params) -> list[Future]:
        """A batched group always goes to one replica."""
        index = self._pick(n)
        try:
            return self._track(index, self.replicas[index].submit_batched(prompt, n, params))
        except BaseException:
            self._release(index, n)
            raise

    def _release(self, index: int, count: int) -> None:
        with self._lock:
            self.in_flight[index] -= count
            self.assigned[index] -= count

    @property
    def supports_batched_generation(self) -> bool:
        return all(getattr(r, "supports_batched_generation", False) for r in self.replicas)
