"""Console warnings about a run that trains on nothing.

`ZeroSpreadWatch` looks at each step's `adv/zero_std_ratio` (the share of prompt groups whose
samples all scored alike: their advantages are 0, so they teach nothing). When more than
ZERO_SPREAD_WARN_RATIO of a step's groups have no spread it prints one line naming the likely
causes and the metric to watch; later such steps print nothing (their count is kept), and
`summary()` gives one closing line when any step was affected.

`NoTrainingWatch` looks at each step's `adv/num_rows_trained`: a step that trained no row at all
(every reward NaN, or no group with a reward spread under zero_std_policy=drop) warns at the first
step of such a streak (the zero-spread case is ZeroSpreadWatch's line), and past
`trainer.max_steps_without_trained_rows` steps in a row it raises `TrainingStalled`, which says why.

It knows the metric names of a training step, nothing about how they are computed.
"""

from __future__ import annotations

ZERO_SPREAD_WARN_RATIO = 0.5


class TrainingStalled(RuntimeError):
    """Too many steps in a row trained no row (NoTrainingWatch); the message says why and the fix."""


class ZeroSpreadWatch:
    """See the module docstring. `reward_name` and `group_size` (rollout.n) go into the message."""

    def __init__(self, reward_name: str, group_size: int, write=print):
        self.reward_name = reward_name
        self.group_size = group_size
        self.write = write
        self.num_steps_seen = 0
        self.affected_steps: list[int] = []

    def observe(self, step: int, metrics: dict) -> None:
        ratio = metrics.get("adv/zero_std_ratio")
        if ratio is None:
            return
        self.num_steps_seen += 1
        if ratio <= ZERO_SPREAD_WARN_RATIO:
            return
        self.affected_steps.append(step)
        if len(self.affected_steps) == 1:
            self.write(
                f"warning: step {step}: {ratio:.0%} of the prompt groups got the same reward for all "
                f"{self.group_size} samples, so they teach nothing. Likely causes: reward {self.reward_name!r} is "
                "saturated or constant for this model (e.g. OCR on a model that draws no text scores 0 everywhere), "
                f"rollout.n={self.group_size} is too few samples per group to differ, or the reward has a bug. "
                "Watch adv/zero_std_ratio in metrics.jsonl (reported once; the run's summary counts the steps)."
            )

    def summary(self) -> str | None:
        """One closing line when any step had mostly zero-spread groups, else None."""
        if not self.affected_steps:
            return None
        return (
            f"warning: {len(self.affected_steps)} of {self.num_steps_seen} steps had more than "
            f"{ZERO_SPREAD_WARN_RATIO:.0%} of their groups with zero reward spread (first: step "
            f"{self.affected_steps[0]}); see adv/zero_std_ratio in metrics.jsonl"
        )


class NoTrainingWatch:
    """See the module docstring. `max_steps`: trainer.max_steps_without_trained_rows (0: never stop)."""

    def __init__(self, reward_name: str, max_steps: int, write=print):
        self.reward_name = reward_name
        self.max_steps = max_steps
        self.write = write
        self.num_steps_in_a_row = 0

    def _reason(self, metrics: dict) -> str:
        if metrics.get("reward/nan_ratio", 0.0) >= 1.0:
            return (
                f"every image's reward was NaN (reward/nan_ratio 1.0): reward {self.reward_name!r} returned null or "
                "failed for every row (an HTTP scorer answering null, an optional component failing everywhere)"
            )
        return (
            f"no prompt group's samples differed in reward {self.reward_name!r} (adv/zero_std_ratio "
            f"{metrics.get('adv/zero_std_ratio', float('nan')):.2f}), and algorithm.zero_std_policy=drop leaves "
            "such groups out"
        )

    def observe(self, step: int, metrics: dict) -> None:
        """Count a step; raises TrainingStalled past the bound."""
        if metrics.get("adv/num_rows_trained", 1) > 0:
            self.num_steps_in_a_row = 0
            return
        self.num_steps_in_a_row += 1
        reason = self._reason(metrics)
        bound = self.max_steps
        if bound and self.num_steps_in_a_row >= bound:
            raise TrainingStalled(
                f"stopped after step {step}: {self.num_steps_in_a_row} steps in a row trained no row "
                f"(trainer.max_steps_without_trained_rows={bound}): {reason}; fix the reward (see reward/nan_ratio "
                "and adv/zero_std_ratio in metrics.jsonl), or raise trainer.max_steps_without_trained_rows (0: never "
                "stop); the same command resumes from the latest checkpoint"
            )
        if self.num_steps_in_a_row == 1 and metrics.get("reward/nan_ratio", 0.0) >= 1.0:
            stop = f"the run stops after {bound} such steps in a row" if bound else "the run goes on"
            self.write(
                f"warning: step {step} trained no row: {reason}. {stop} (trainer.max_steps_without_trained_rows)"
            )
