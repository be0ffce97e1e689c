"""Async scoring: score samples as the engine finishes them, while others are still generating.

The rollout loop calls `submit(row_index, image, prompt, metadata)` in the engine's completion
order. A pool of `num_workers` threads scores what is pending: a worker that becomes free takes
the pending rows of the same image size (up to `max_batch_size`) and scores them as one batch,
so early rows start scoring at once and late bursts are still batched. It takes all of them for
a reward that batches (one model forward, as CLIP's), and its share, 1 / num_workers of them, for
a reward that scores rows one by one (`Reward.scores_rows_one_by_one`, as OCR): the whole group
an engine-batched rollout finishes at once is then scored on every worker, not on one.
`results()` waits for all submitted rows and returns the scores in row order: the update still
waits for the full batch. A group-wise reward (`Reward.scores_groups`) is handed whole groups: a
group's rows wait until `group_size` of them are in (or `results()` is called, which flushes what
is left).

`scoring_workers("auto", ranks_on_this_host)` is the pool size `reward.num_workers: auto` means:
the cores this process may run on, shared by the ranks of its host, less one for the rank's own
thread.

Threads (not processes) suffice: the heavy parts (onnxruntime OCR, torch CLIP, HTTP waits)
release the GIL. Rewards called from several workers must be thread-safe; the built-in ones are
(OCR keeps one engine per thread).

The scorer is reusable: `results()` hands back one batch and clears the state for the next.
Failures follow the reward's policy: a RewardError of a required reward is re-raised by
`results()` with the row index in the submitted numbering.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from flowrl.rewards.base import Reward, RewardError, as_uint8_images
from flowrl.rewards.groups import group_key
from flowrl.waiting import StopCheck, wait_on_condition


@dataclass
class _PendingRow:
    row_index: int
    image: np.ndarray  # (3, H, W) uint8
    prompt: str
    metadata: dict


def scoring_workers(setting: int | str, ranks_on_this_host: int = 1) -> int:
    """The scoring pool's size for reward.num_workers=`setting` (a count, or "auto": module
    docstring)."""
    if setting != "auto":
        return setting
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, ranks_on_this_host) - 1)


class AsyncRewardScorer:
    """A worker pool that scores submitted rows in batches of whatever is pending."""

    def __init__(
        self, reward: Reward, num_workers: int = 2, max_batch_size: int | None = None, group_size: int | None = None
    ):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"reward.num_workers={num_workers!r} must be an integer >= 1")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size={max_batch_size!r} must be None or an integer >= 1")
        if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group_size={group_size!r} must be None or an integer >= 1")
        self.reward = reward
        self.group_size = group_size
        self._is_flushing = False  # results() waits: incomplete groups are scored as they are
        self.num_workers = num_workers
        self.max_batch_size = max_batch_size
        self._condition = threading.Condition()
        self._pending: list[_PendingRow] = []
        self._num_in_flight = 0
        self._submitted: set[int] = set()
        self._scores: dict[int, float] = {}
        self._components: dict[int, dict[str, float]] = {}
        self._errors: list[BaseException] = []
        self._is_closed = False
        self.scored_batch_sizes: list[int] = []  # one entry per scored batch, for metrics
        self._workers = [
            threading.Thread(target=self._work, name=f"reward-worker-{i}", daemon=True) for i in range(num_workers)
        ]
        for worker in self._workers:
            worker.start()

    # -- producer side -----------------------------------------------------------------------
    def submit(self, row_index: int, image, prompt: str, metadata: dict | None = None) -> None:
        """Queue one finished sample; `image` is (3, H, W) uint8 (numpy or torch)."""
        if not isinstance(row_index, int) or row_index < 0:
            raise ValueError(f"row_index={row_index!r} must be an integer >= 0")
        image = as_uint8_images(image[None])[0]
        metadata = {} if metadata is None else metadata
        with self._condition:
            if self._is_closed:
                raise RuntimeError("AsyncRewardScorer is closed; create a new one")
            if row_index in self._submitted:
                raise ValueError(f"row_index {row_index} was submitted twice; each row is scored once per batch")
            self._submitted.add(row_index)
            self._pending.append(_PendingRow(row_index, image, prompt, metadata))
            self._condition.notify()

    # -- worker side -------------------------------------------------------------------------
    def _ready(self) -> list[_PendingRow]:
        """The pending rows a worker may take: all, or for a group-wise reward those of complete
        groups (every group once closing or flushing), in the order they came."""
        if not self.reward.scores_groups or self._is_closed or self._is_flushing:
            return self._pending
        counts = Counter(group_key(row.prompt, row.metadata) for row in self._pending)
        size = self.group_size or math.inf
        return [row for row in self._pending if counts[group_key(row.prompt, row.metadata)] >= size]

    def _take_group_batch(self, ready: list[_PendingRow]) -> list[_PendingRow]:
        """Whole groups of the first ready row's image size, up to max_batch_size rows (one group at least)."""
        groups: dict[str, list[_PendingRow]] = {}
        for row in ready:
            groups.setdefault(group_key(row.prompt, row.metadata), []).append(row)
        shape, batch = ready[0].image.shape, []
        for rows in groups.values():
            if rows[0].image.shape != shape:
                continue
            if batch and self.max_batch_size is not None and len(batch) + len(rows) > self.max_batch_size:
                break
            batch += rows
        return batch

    def _take_batch(self) -> list[_PendingRow]:
        """Pending rows with the first row's image size (one stacked array), oldest first: all of
        them, or this worker's share for a reward that scores rows one by one, or whole groups for
        a group-wise one (module docstring)."""
        if self.reward.scores_groups:
            batch = self._take_group_batch(self._ready())
            taken = {id(row) for row in batch}
            self._pending = [row for row in self._pending if id(row) not in taken]
            return batch
        shape = self._pending[0].image.shape
        batch = [row for row in self._pending if row.image.shape == shape][: self.max_batch_size]
        if self.reward.scores_rows_one_by_one:
            batch = batch[: math.ceil(len(batch) / self.num_workers)]
        taken = {id(row) for row in batch}
        self._pending = [row for row in self._pending if id(row) not in taken]
        return batch

    def _work(self) -> None:
        while True:
            with self._condition:
                while not self._ready() and not self._is_closed:
                    self._condition.wait()
                if not self._pending:  # closed and drained
                    return
                batch = self._take_batch()
                self._num_in_flight += len(batch)
            outcome = self._score(batch)
            with self._condition:
                if isinstance(outcome, BaseException):
                    self._errors.append(outcome)
                else:
                    total, components = outcome
                    for position, row in enumerate(batch):
                        self._scores[row.row_index] = float(total[position])
                        self._components[row.row_index] = {name: float(s[position]) for name, s in components.items()}
                self.scored_batch_sizes.append(len(batch))
                self._num_in_flight -= len(batch)
                self._condition.notify_all()

    def _score(self, batch: list[_PendingRow]):
        rows = [row.row_index for row in batch]
        try:
            return self.reward.score_with_components(
                np.stack([row.image for row in batch]),
                [row.prompt for row in batch],
                [row.metadata for row in batch],
            )
        except RewardError as error:  # re-address the batch-local row to the submitted numbering
            moved = error.with_row_index(None if error.row_index is None else rows[error.row_index])
            moved.__cause__ = error
            return moved
        except BaseException as error:  # handed to results(); a worker thread must not die silently
            return error

    # -- consumer side -----------------------------------------------------------------------
    def is_done(self) -> bool:
        """Whether every submitted row is scored (results_with_components would not wait)."""
        with self._condition:
            return not self._pending and not self._num_in_flight

    def results_with_components(
        self, num_rows: int | None = None, timeout_s: float | None = None, stop_check: StopCheck | None = None
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Wait for every submitted row; (total (N,), {name: (N,)}) in row order; then reset.

        `num_rows` (optional) checks that rows 0..num_rows-1 were all submitted; `timeout_s`
        bounds the wait (TimeoutError, state kept) so a hung reward cannot stall training silently.
        `stop_check` is called while waiting (flowrl.waiting); whatever it raises ends the wait,
        the state kept (`close(drop_pending=True)` drops it).
        """
        with self._condition:
            self._is_flushing = True  # every row is in: incomplete groups are scored as they are
            self._condition.notify_all()
            try:
                is_done = wait_on_condition(
                    self._condition, lambda: not self._pending and not self._num_in_flight, timeout_s, stop_check
                )
            finally:
                self._is_flushing = False
            if not is_done:
                raise TimeoutError(
                    f"reward {self.reward.name!r}: {len(self._pending)} row(s) pending and "
                    f"{self._num_in_flight} in flight after {timeout_s} s"
                )
            errors, submitted = self._errors, sorted(self._submitted)
            scores, per_row_components = self._scores, self._components
            self._errors, self._submitted, self._scores, self._components = [], set(), {}, {}
        if errors:
            raise errors[0]
        expected = len(submitted) if num_rows is None else num_rows
        if submitted != list(range(expected)):
            missing = sorted(set(range(expected)) - set(submitted))[:10]
            extra = [row for row in submitted if row >= expected][:10]
            raise ValueError(
                f"rows submitted to the reward scorer are not 0..{expected - 1}: missing {missing}, "
                f"out of range {extra}; submit every row of the batch exactly once"
            )
        total = np.array([scores[row] for row in range(expected)], dtype=np.float64)
        names = sorted({name for row_components in per_row_components.values() for name in row_components})
        components = {
            name: np.array([per_row_components[row].get(name, np.nan) for row in range(expected)], dtype=np.float64)
            for name in names
        }
        return total, components

    def results(
        self, num_rows: int | None = None, timeout_s: float | None = None, stop_check: StopCheck | None = None
    ) -> np.ndarray:
        return self.results_with_components(num_rows, timeout_s, stop_check)[0]

    def close(self, drop_pending: bool = False, join_timeout_s: float | None = None) -> bool:
        """Stop the workers and join them: after scoring every pending row, or, with drop_pending
        (a run being stopped), after the batches already being scored only. `join_timeout_s`
        bounds the wait for those (a hung reward, an unanswered HTTP request): workers still
        scoring then are left to end with the process (daemon threads), with a warning on stderr.
        Returns whether every worker ended."""
        with self._condition:
            self._is_closed = True
            if drop_pending:
                self._pending.clear()
            self._condition.notify_all()
        deadline = None if join_timeout_s is None else time.monotonic() + join_timeout_s
        for worker in self._workers:
            worker.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        running = sum(worker.is_alive() for worker in self._workers)
        if running:
            print(
                f"flowrl: reward {self.reward.name!r}: {running} scoring worker(s) still busy {join_timeout_s} s "
                "after close; left to end with the process",
                file=sys.stderr,
                flush=True,
            )
        return not running

    def __enter__(self) -> AsyncRewardScorer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
