"""The rows of one training step on every rank: what each rank rolled out, gathered so that the
advantages, the metrics and the update's plan see the whole step as one process would.

A step's prompts are cut into contiguous shares, one per rank in rank order (`World.share`), so a
prompt's group of rollout.n rows never spans ranks and global row g is the row a one-process run
has at g. `gather_step_rows` all-gathers what is small (rewards and their components, uids, each
row's TransitionSpec.group_key and policy version, the engine's batching counters); the tensors
stay on their rank. `StepRows.metrics` are the step's reward and rollout metrics over all rows and
`StepRows.trained` says which rank holds which trained row.

This module knows RolloutBatch's non-tensor columns and the World; nothing of models or engines.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowrl.distributed.trained_rows import TrainedRows
from flowrl.distributed.world import World
from flowrl.engine.output import TransitionSpec


@dataclass
class StepRows:
    """Per global row (N,): rewards, reward components by name, uids, group keys, policy versions,
    the rank holding it (owner) and its row there (index). engine: per rank, its engine's counters
    (num_rows, num_forwards, images_per_second) and batched groups."""

    rewards: np.ndarray
    components: dict[str, np.ndarray]
    uids: list
    group_keys: list
    policy_versions: np.ndarray
    owner: np.ndarray
    index: np.ndarray
    engine: list[dict]
    rank: int
    num_ranks: int

    @property
    def mine(self) -> np.ndarray:
        """The global rows this rank holds, in order (its rollout's rows 0, 1, ...)."""
        return np.flatnonzero(self.owner == self.rank)

    def metrics(self, policy_version: int) -> dict:
        """The step's reward and rollout metrics over every rank's rows. policy_version: the
        trainer's (the lag is measured from it)."""
        finite = self.rewards[np.isfinite(self.rewards)]
        versions = self.policy_versions
        metrics = {
            "reward/mean": float(finite.mean()) if finite.size else float("nan"),
            "reward/std": float(finite.std()) if finite.size else float("nan"),
            "reward/nan_ratio": float(1.0 - finite.size / max(len(self.rewards), 1)),
            "rollout/policy_version": int(versions.min()),
            "rollout/policy_lag": int(policy_version - versions.min()),
        }
        if len(self.components) > 1:
            for name, scores in self.components.items():
                metrics[f"reward/{name}/mean"] = float(np.nanmean(scores))
        if all("num_forwards" in e for e in self.engine):  # engines that count their batching
            forwards = sum(e["num_forwards"] for e in self.engine)
            metrics["rollout/mean_rows_per_forward"] = (
                sum(e["num_rows"] for e in self.engine) / forwards if forwards else 0.0
            )
            metrics["rollout/images_per_second"] = sum(e["images_per_second"] for e in self.engine)
        metrics["rollout/num_batched_groups"] = sum(e["num_batched_groups"] for e in self.engine)
        return metrics

    def staleness(self, start_version: int, optimizer_steps: int) -> dict:
        """How many optimizer steps the weights of each optimizer step of the update are ahead of
        the weights that drew each row (policy versions count optimizer steps): the mean and the
        largest over every (row, optimizer step) pair of the update, which starts from
        `start_version` and takes `optimizer_steps` steps (0: no update, the lag at its start).
        0 on-policy at the first optimizer step; the k-th step after it is k steps ahead."""
        lag = start_version - self.policy_versions.astype(np.float64)
        later = max(optimizer_steps - 1, 0)  # the last optimizer step is this many after the first
        return {
            "rollout/staleness_mean": float(lag.mean() + later / 2),
            "rollout/staleness_max": int(lag.max() + later),
        }

    def trained(self, keep: np.ndarray) -> TrainedRows:
        """The rows `keep` marks, as the update trains them (each weighing 1)."""
        rows = np.flatnonzero(keep)
        return TrainedRows(
            self.owner[rows],
            self.index[rows],
            np.ones(len(rows)),
            [self.group_keys[i] for i in rows],
            self.rank,
            self.num_ranks,
        )


def gather_step_rows(
    world: World, rollout, rewards: np.ndarray, components: dict[str, np.ndarray], engine: dict
) -> StepRows:
    """Every rank's rows of the step, in rank order (a collective). rollout: this rank's
    RolloutBatch; rewards / components: its scores; engine: its engine counters (module
    docstring)."""
    columns = rollout.non_tensor_batch
    local = {
        "rewards": np.asarray(rewards, dtype=np.float64),
        "components": {name: np.asarray(values, dtype=np.float64) for name, values in components.items()},
        "uids": list(columns["uid"]),
        "group_keys": [spec.group_key for spec in TransitionSpec.from_columns(columns)],
        "versions": np.asarray(columns["policy_version"], dtype=np.int64),
        "engine": {**engine, "num_batched_groups": rollout.meta_info.get("num_batched_groups", 0)},
    }
    parts = world.gather(local)
    sizes = [len(part["rewards"]) for part in parts]
    return StepRows(
        rewards=np.concatenate([part["rewards"] for part in parts]),
        components={name: np.concatenate([part["components"][name] for part in parts]) for name in components},
        uids=[uid for part in parts for uid in part["uids"]],
        group_keys=[key for part in parts for key in part["group_keys"]],
        policy_versions=np.concatenate([part["versions"] for part in parts]),
        owner=np.repeat(np.arange(len(parts)), sizes),
        index=np.concatenate([np.arange(size) for size in sizes]),
        engine=[part["engine"] for part in parts],
        rank=world.rank,
        num_ranks=world.size,
    )
