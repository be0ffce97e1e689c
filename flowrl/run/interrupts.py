"""Ctrl-C and SIGTERM during training: stop at a safe point, never in the middle of a weight update.

`StopSignals` (a context manager, active in the main thread only) replaces the SIGINT and SIGTERM
handlers while a run trains:
- the first signal asks the run to stop. Phases whose work is simply dropped (the rollout, the
  reward wait, validation) end at once: the trainer waits for them calling `check()` every few
  hundredths of a second (flowrl.waiting; raising from the handler there could leave a lock held
  that another thread needs). Only start-up (planning the run, loading the model), which a stop
  abandons whole, runs inside `abortable()`, where the handler itself raises `PhaseAborted`.
  Elsewhere (the update, a checkpoint write) the phase finishes and the loop stops at its next
  `check()`;
- a second signal ends the process at once (`os._exit`, exit code 128 + signal number); a
  checkpoint being written then is never taken for a complete one (checkpoints are renamed into
  place when complete).
`StepRewind` captures what a step changes before its update (the data position, the rollout row
count, the global RNGs), so that a step dropped by a signal leaves no trace and a checkpoint saved
then equals one saved right after the previous step. `TrainingInterrupted` is what
`Trainer.fit` raises after it has stopped cleanly; it says where the run can be resumed
from. The exit code convention is the shell's: 128 + signal number (130 for SIGINT, 143 for SIGTERM).

It knows signals and the pre-update state of a step, nothing about what a step computes.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flowrl.console import note

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class PhaseAborted(BaseException):
    """Raised inside `StopSignals.abortable()` by a stop signal (a BaseException, like KeyboardInterrupt,
    so that `except Exception` blocks on the way do not swallow it)."""


class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped by a signal after a clean shutdown.

    signum: the signal; step: the last completed step; checkpoint: the checkpoint a resume starts
    from (None: no step completed, nothing to resume); saved_now: whether `checkpoint` was written
    at the interrupt.
    """

    def __init__(self, signum: int, step: int, checkpoint: Path | None, saved_now: bool):
        super().__init__(f"training stopped by {signal.Signals(signum).name} after step {step}")
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        self.saved_now = saved_now

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """See the module docstring. `requested` is the first signal received (None before any)."""

    def __init__(self, name: str = "flowrl train"):
        self.name = name
        self.requested: int | None = None
        self._is_abortable = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.requested is not None:
            note(f"{self.name}: second interrupt: exiting now")
            os._exit(128 + signum)
        self.requested = signum
        note(f"{self.name}: {signal.Signals(signum).name} received: stopping at the next safe point (again: exit now)")
        if self._is_abortable:
            raise PhaseAborted()

    @contextlib.contextmanager
    def abortable(self):
        """Main-thread work a stop signal may drop: the signal raises PhaseAborted at once inside
        (never around waits on other threads: module docstring)."""
        self.check()
        self._is_abortable = True
        try:
            yield
        finally:
            self._is_abortable = False

    def check(self) -> None:
        """A safe point: raise PhaseAborted when a stop was requested."""
        if self.requested is not None:
            raise PhaseAborted()


@dataclass
class StepRewind:
    """A step's pre-update state (see the module docstring): `capture` before it, `restore` to drop it."""

    prompts: object  # flowrl.data.prompts.PromptSampler
    agent_loop: object  # flowrl.rollout.agent_loop.AgentLoop
    data: dict
    rows_generated: int
    rng: tuple

    @classmethod
    def capture(cls, prompts, agent_loop) -> StepRewind:
        rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        return cls(prompts, agent_loop, prompts.state_dict(), agent_loop.rows_generated, rng)

    def restore(self) -> None:
        self.prompts.load_state_dict(self.data)
        self.agent_loop.rows_generated = self.rows_generated
        torch.set_rng_state(self.rng[0])
        np.random.set_state(self.rng[1])
        random.setstate(self.rng[2])
