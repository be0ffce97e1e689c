"""Group-wise rewards: a reward that sees a prompt's group of images together (e.g. pairwise
preferences turned into win rates, Pref-GRPO).

A group is the rows sharing `metadata["uid"]` (the rollout's group id: the n samples of one
prompt); rows without a uid are grouped by their prompt (flowrl eval, reward-score, a reward
server's caller). A `GroupReward` implements `score_groups`, which gets the batch and its groups;
any batch handed to it holds whole groups: `AsyncRewardScorer` (told the group size) takes a
group only once all its rows are in, and every other caller scores whole batches.
"""

from __future__ import annotations

import numpy as np

from flowrl.rewards.base import Reward


def group_key(prompt: str, metadata: dict) -> str:
    """The group a row belongs to: its uid, else its prompt."""
    uid = metadata.get("uid")
    return f"uid:{uid}" if uid is not None else f"prompt:{prompt}"


def group_rows(prompts: list[str], metadata: list[dict]) -> list[list[int]]:
    """The batch's groups as lists of row indices, in the order their first rows appear."""
    groups: dict[str, list[int]] = {}
    for row, (prompt, meta) in enumerate(zip(prompts, metadata)):
        groups.setdefault(group_key(prompt, meta), []).append(row)
    return list(groups.values())


class GroupReward(Reward):
    """A reward that scores whole groups (module docstring); subclasses implement `score_groups`."""

    scores_groups = True

    def score_groups(
        self, images: np.ndarray, prompts: list[str], metadata: list[dict], groups: list[list[int]]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(total (B,), {component: (B,)}) for the batch, whose rows `groups` partitions."""
        raise NotImplementedError

    def score_batch_with_components(self, images, prompts, metadata):
        return self.score_groups(images, prompts, metadata, group_rows(prompts, metadata))
