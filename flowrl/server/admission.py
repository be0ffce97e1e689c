"""Admission in front of the engine: the samples a server holds, pausing, and exclusive weight swaps.

Every generation request enters through `admit(num_samples)` (an async context held while its
samples are in the engine). Admission is closed while the admin paused it or while a weight
update swaps weights; requests then wait at the gate (and leave it if their client goes away).
`exclusive()` closes the gate, waits until no admitted sample is left, and yields: a weight swap
inside it never overlaps a forward, so every sample runs on one version of the weights.

All of it runs on the server's event loop (one thread); it knows nothing about HTTP or models.
"""

from __future__ import annotations

import asyncio
import contextlib

from flowrl.server.score_request import BadRequest


class Admission:
    def __init__(self, max_queued_samples: int):
        self.max_queued_samples = max_queued_samples
        self.is_paused = False  # by the admin (POST /v1/admin/pause)
        self._is_swapping = False  # a weight update holds exclusive()
        self.num_in_flight = 0  # samples admitted and not finished
        self.num_waiting = 0  # samples waiting at the closed gate
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._swap_lock = asyncio.Lock()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def _update_gate(self) -> None:
        if self.is_paused or self._is_swapping:
            self._open.clear()
        else:
            self._open.set()

    def pause(self) -> None:
        self.is_paused = True
        self._update_gate()

    def resume(self) -> None:
        self.is_paused = False
        self._update_gate()

    @contextlib.asynccontextmanager
    async def admit(self, num_samples: int):
        """Hold `num_samples` of capacity while the body runs; BadRequest(503) when the server is full."""
        if self.num_in_flight + self.num_waiting + num_samples > self.max_queued_samples:
            raise BadRequest(
                f"the server holds {self.num_in_flight + self.num_waiting} samples, and {num_samples} more would pass "
                f"its limit of {self.max_queued_samples} (--max-queued-samples); retry later",
                503,
            )
        self.num_waiting += num_samples
        try:
            while not self._open.is_set():  # re-checked on waking: the gate may have closed again since
                await self._open.wait()
        finally:
            self.num_waiting -= num_samples
        self.num_in_flight += num_samples
        self._drained.clear()
        try:
            yield
        finally:
            self.num_in_flight -= num_samples
            if self.num_in_flight == 0:
                self._drained.set()

    @contextlib.asynccontextmanager
    async def exclusive(self):
        """Close admission, wait until no admitted sample is left, yield, then reopen (unless paused)."""
        async with self._swap_lock:
            self._is_swapping = True
            self._update_gate()
            try:
                while self.num_in_flight:
                    await self._drained.wait()
                yield
            finally:
                self._is_swapping = False
                self._update_gate()
