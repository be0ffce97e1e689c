"""Continuous-batching scheduler: which samples step next. Pure bookkeeping, no tensors.

Policy:
- Admission is FIFO: waiting samples join the running set while their rows (2 per CFG sample)
  fit in `max_batch_rows`; a new request can join between any two engine iterations.
- Each iteration steps one compatible group (same latent shape): the group whose samples were
  stepped least recently, so groups of different shapes take turns and none starves. Every
  running sample of that group steps, whatever step of its schedule it is at.
- A sample leaves when it finishes, fails or is cancelled (`remove`, `take`), freeing its rows.
"""

from __future__ import annotations

from collections import deque

from flowrl.engine.sample import SampleState


class Scheduler:
    def __init__(self, max_batch_rows: int):
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows={max_batch_rows} must be >= 1")
        self.max_batch_rows = max_batch_rows
        self.waiting: deque[SampleState] = deque()
        self.running: list[SampleState] = []
        self._tick = 0

    def add(self, sample: SampleState) -> None:
        assert sample.num_rows <= self.max_batch_rows
        self.waiting.append(sample)

    @property
    def running_rows(self) -> int:
        return sum(s.num_rows for s in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[SampleState]:
        """Move waiting samples into the running set while they fit; return the admitted ones."""
        admitted = []
        rows = self.running_rows
        while self.waiting and rows + self.waiting[0].num_rows <= self.max_batch_rows:
            sample = self.waiting.popleft()
            rows += sample.num_rows
            self.running.append(sample)
            admitted.append(sample)
        return admitted

    def schedule(self) -> list[SampleState]:
        """The samples to step in this iteration (one compatible group), oldest-stepped first."""
        if not self.running:
            return []
        first = min(self.running, key=lambda s: (s.last_stepped_tick, s.sample_id))
        group = [s for s in self.running if s.batch_key == first.batch_key]
        for sample in group:
            sample.last_stepped_tick = self._tick
        self._tick += 1
        assert sum(s.num_rows for s in group) <= self.max_batch_rows
        return group

    def remove(self, samples: list[SampleState]) -> None:
        gone = {id(s) for s in samples}
        self.running = [s for s in self.running if id(s) not in gone]

    def take(self, predicate) -> list[SampleState]:
        """Remove the waiting and running samples for which predicate(sample) holds; return them."""
        taken = [s for s in (*self.waiting, *self.running) if predicate(s)]
        if taken:
            gone = {id(s) for s in taken}
            self.waiting = deque(s for s in self.waiting if id(s) not in gone)
            self.remove(taken)
        return taken
