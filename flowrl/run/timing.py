"""The wall seconds of a training step's phases.

`PhaseTimer.phase(name)` times one phase, ending it once the device has finished the work the
phase queued (so a phase's seconds are its own, not the next one's); `metrics()` gives each as
`timing/<name>_s` and the whole step since the timer began as `timing/step_s`.
"""

from __future__ import annotations

import contextlib
import time


class PhaseTimer:
    def __init__(self, world):
        self.world = world
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.world.device_idle_time() - t0

    def metrics(self) -> dict[str, float]:
        metrics = {f"timing/{name}_s": seconds for name, seconds in self.seconds.items()}
        metrics["timing/step_s"] = time.perf_counter() - self.start
        return metrics
