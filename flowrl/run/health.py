"""Console warnings about a run that trains on nothing.

`ZeroSpreadWatch` looks at each step's `adv/zero_std_ratio` (the share of prompt groups whose
samples all scored alike: their advantages are 0, so they teach nothing). When more than
ZERO_SPREAD_WARN_RATIO of a step's groups have no spread it prints one line naming the likely
causes and the metric to watch; later such steps print nothing (their count is kept), and
`summary()` gives one closing line when any step was affected.

It knows the metric names of a training step, nothing about how they are computed.
"""

from __future__ import annotations

ZERO_SPREAD_WARN_RATIO = 0.5


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
