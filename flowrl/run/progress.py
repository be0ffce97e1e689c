"""The training progress bar: steps done, and where the current step is.

One bar (flowrl.console's style) counts training steps; its postfix names the current phase with
its own count, e.g. `rollout 12/32` (samples finished), `validation 3/8`, `update 40 fwd`
(transformer forwards of the PPO update so far), followed by the last step's reward and clip
fraction. With `engine.compile` the first occurrence of each phase says `(compiling)`: that is
where torch.compile spends its time. Counts may advance from the engine's thread; the bar redraws
at most every half second, so a fast phase costs nothing.

It knows phase names and numbers, nothing about how a step computes them.
"""

from __future__ import annotations

import threading
import time

from flowrl.console import progress_bar

_REDRAW_S = 0.5


class StepProgress:
    """See the module docstring. disable=True makes every call a no-op bookkeeping update."""

    def __init__(self, total: int, initial: int = 0, disable: bool = False, is_compiling: bool = False):
        self._bar = progress_bar(total=total, desc="flowrl train", initial=initial, disable=disable, unit="step")
        self._lock = threading.Lock()
        self._phase = ""
        self._count = 0
        self._total: int | None = None
        self._suffix = ""
        self._last_step = ""
        self._compiling = is_compiling
        self._phases_seen: set[str] = set()
        self._drawn_at = 0.0

    def phase(self, name: str, total: int | None = None) -> None:
        """The step is now in phase `name`; `total` items are expected (None: an open count)."""
        with self._lock:
            self._phase, self._count, self._total = name, 0, total
            first_use = self._compiling and name not in self._phases_seen
            self._phases_seen.add(name)
            self._suffix = " (compiling)" if first_use else ""
        self._draw(force=True)

    def advance(self, count: int = 1) -> None:
        """`count` more items of the current phase are done (any thread)."""
        with self._lock:
            self._count += count
        self._draw()

    @property
    def current_phase(self) -> str:
        return self._phase

    def step_done(self, metrics: dict) -> None:
        self._last_step = f"reward={metrics['reward/mean']:.4g} clip={metrics.get('actor/clipfrac', 0):.2f}"
        with self._lock:
            self._phase = ""
        self._bar.update(1)
        self._draw(force=True)

    def _label(self) -> str:
        with self._lock:
            if not self._phase:
                return self._last_step
            unit = f"{self._count}/{self._total}" if self._total is not None else f"{self._count} fwd"
            current = f"{self._phase} {unit}{self._suffix}"
        return f"{current} | {self._last_step}" if self._last_step else current

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._drawn_at >= _REDRAW_S:
            self._drawn_at = now
            self._bar.set_postfix_str(self._label(), refresh=True)

    def close(self) -> None:
        self._bar.close()


class NoProgress:
    """StepProgress's interface doing nothing: a step run outside `fit()`."""

    current_phase = ""

    def phase(self, name: str, total: int | None = None) -> None:
        pass

    def advance(self, count: int = 1) -> None:
        pass

    def step_done(self, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


NO_PROGRESS = NoProgress()
