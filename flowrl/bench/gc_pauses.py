"""Python's garbage-collector pauses, timed while a benchmark runs.

A collection stops the thread that triggered it, and a full one (generation 2) walks every tracked
object of the process, the compiled graphs' included. When that thread is the one launching GPU
work (the engine's rollout thread, the trainer's update loop), the GPU runs out of queued work and
idles for the rest of the pause. `GcPauses` counts the collections and sums their time per
generation; with `mark_in_profile`, each collection is also a `torch.profiler.record_function`
range named `python gc (generation N)`, so a profiled step (flowrl.bench.step_profile) lists it
among the host ops that ran while the GPU idled.
"""

from __future__ import annotations

import gc
import time

import torch


class GcPauses:
    """A context that times every garbage collection while it is open (any thread)."""

    def __init__(self, mark_in_profile: bool = False):
        self.mark_in_profile = mark_in_profile
        self.collections = [0, 0, 0]  # per generation
        self.seconds = [0.0, 0.0, 0.0]
        # CPython runs one collection at a time (a thread that would start a second one skips it),
        # so one start time and one open profiler range suffice.
        self._started: float | None = None
        self._range = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc_info) -> None:
        gc.callbacks.remove(self._on_collection)
        self._close_range()

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            if self.mark_in_profile:
                self._range = torch.profiler.record_function(f"python gc (generation {info['generation']})")
                self._range.__enter__()
            return
        if self._started is None:  # the context opened while a collection was running
            return
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds[generation] += time.perf_counter() - self._started
        self._started = None
        self._close_range()

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def as_dict(self) -> dict:
        """{"seconds": total, "full_collections": generation-2 count, "by_generation": [{collections, seconds}]}."""
        return {
            "seconds": sum(self.seconds),
            "full_collections": self.collections[2],
            "by_generation": [{"collections": n, "seconds": s} for n, s in zip(self.collections, self.seconds)],
        }
