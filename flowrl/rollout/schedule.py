"""When a training step's rollout runs relative to the updates: chosen once, before the loop.

- `SynchronousSchedule`: step k rolls out with the weights of step k - 1, then trains; the new
  weights are published (flowrl.rollout.backends) right after the update, before step
  k + 1's requests.
- `OneStepAheadSchedule` (`trainer.async_rollout`, decoupled only): while step k trains, step
  k + 1's rollout already runs on the rollout servers, with the weights step k started from
  (those of step k - 1). Step k's update is published only when that rollout has returned, so no
  request ever sees two versions, and every sample of step k + 1 is exactly one update stale:
  step k + 1 trains from the weights of step k on samples of step k - 1's weights, with
  decoupled PPO (flowrl.trainer.update). The first step has no earlier rollout to wait for and is
  on-policy.

A schedule calls the trainer's `roll_out(step)` (the step's rows rolled out, each sample handed to
the reward scorer as it finishes) and knows nothing of its insides; the trainer waits for the
rewards itself.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

from flowrl.waiting import run_in_thread


def schedule_for(is_async: bool, backend, roll_out, has_step, data_state):
    """One step ahead (trainer.async_rollout), else synchronous (see the classes)."""
    if is_async:
        return OneStepAheadSchedule(backend, roll_out, has_step, data_state)
    return SynchronousSchedule(backend, roll_out)


class SynchronousSchedule:
    """Roll out, train, publish (module docstring)."""

    is_async = False

    def __init__(self, backend, roll_out: Callable[[int], object]):
        self.backend = backend
        self.roll_out = roll_out

    def collect(self, step: int):
        return self.roll_out(step)

    def after_update(self, version: int) -> None:
        self.backend.publish(version)

    def saved_data_state(self) -> dict | None:
        """The data position a checkpoint must save when it is not the trainer's current one."""
        return None

    def finish(self) -> None:
        """After the last step: every update is published already."""

    def close(self) -> None:
        pass


class OneStepAheadSchedule:
    """Step k + 1's rollout runs while step k trains (module docstring).

    has_step(step): whether the run will train `step` (no rollout is started past the last one).
    data_state(): the trainer's data position, saved before each early rollout draws its rows."""

    is_async = True

    def __init__(
        self,
        backend,
        roll_out: Callable[[int], object],
        has_step: Callable[[int], bool],
        data_state: Callable[[], dict],
    ):
        self.backend = backend
        self.roll_out = roll_out
        self.has_step = has_step
        self.data_state = data_state
        self._pending: tuple[int, Future] | None = None
        self._unpublished: int | None = None
        self._saved_state: dict | None = None
        self.last_wait_s = 0.0

    def collect(self, step: int):
        # 1. this step's rollout: started during the previous step's update, or run now
        if self._pending is not None:
            pending_step, future = self._pending
            assert pending_step == step, f"the early rollout is of step {pending_step}, not {step}"
            self._pending, self._saved_state = None, None
            result = future.result()
        else:
            result = self.roll_out(step)
        # 2. the replicas are idle: the previous update goes live before the next request
        if self._unpublished is not None:
            self.backend.publish(self._unpublished)
            self._unpublished = None
        # 3. the next step's rollout starts now, on those weights, while this step trains
        if self.has_step(step + 1):
            self._saved_state = self.data_state()
            self._pending = (step + 1, run_in_thread(self.roll_out, step + 1))
        return result

    def after_update(self, version: int) -> None:
        self._unpublished = version  # published once the early rollout has returned

    def saved_data_state(self) -> dict | None:
        """While an early rollout is out, a checkpoint saves the data position from before it drew
        its rows: a resumed run draws and rolls them out again (on-policy, with the saved weights)."""
        return self._saved_state

    def finish(self) -> None:
        """After the last step (no rollout pending): the last update goes live, so servers that
        outlive the run serve the final weights."""
        if self._pending is None and self._unpublished is not None:
            self.backend.publish(self._unpublished)
            self._unpublished = None

    def close(self) -> None:
        """Leave a pending early rollout behind (the backend's close ends its requests)."""
        self._pending = None
