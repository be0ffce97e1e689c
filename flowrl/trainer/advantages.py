"""Group-relative advantages (FlowGRPO): rewards of the samples of one prompt are compared with
each other.

advantage_i = (r_i - mean_{group(i)}) / (std + std_eps), clamped to [-adv_clip_max, adv_clip_max],
where std is either the std over the whole batch ("global", the Flow-GRPO default) or the std of
the row's own group ("group"). Stds are population stds (ddof 0), as numpy's default.

A group whose rewards are all (nearly) equal carries no learning signal: its rows get advantage
exactly 0 whatever the std mode (the reference code keeps them in the loss, where they contribute
nothing but the KL term). `zero_std_ratio` reports their share of the batch; the trainer may drop
them (`algorithm.zero_std_policy=drop`).

NaN rewards (an optional reward that failed on a row) are excluded from every mean and std and
their rows get advantage 0 and `is_valid=False`, so they never move the policy.

This module is numpy only: it knows nothing about models or tensors on devices (from flowrl it
takes only the `StdMode` choice list of the config).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

import numpy as np

from flowrl.config.sections import StdMode


@dataclass
class Advantages:
    """values (N,) float32 advantages; is_valid (N,) bool (False: NaN reward);
    is_zero_std (N,) bool (the row's group has no reward spread); zero_std_ratio: share of groups
    with no spread; num_groups; mean_group_std: the mean of the per-group stds (a diagnostic)."""

    values: np.ndarray
    is_valid: np.ndarray
    is_zero_std: np.ndarray
    zero_std_ratio: float
    num_groups: int
    mean_group_std: float


def group_rows(uids: Sequence) -> dict:
    """uid -> list of row indices, in first-appearance order."""
    groups: dict = {}
    for row, uid in enumerate(uids):
        groups.setdefault(uid, []).append(row)
    return groups


def compute_group_advantages(
    rewards: Sequence[float] | np.ndarray,
    uids: Sequence,
    std_mode: StdMode = "global",
    std_eps: float = 1e-4,
    adv_clip_max: float = 5.0,
    zero_std_threshold: float = 1e-6,
) -> Advantages:
    """FlowGRPO advantages of a batch of rewards grouped by uid (see the module docstring)."""
    rewards = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if len(uids) != rewards.shape[0]:
        raise ValueError(f"uids has {len(uids)} entries for {rewards.shape[0]} rewards; pass one uid per row")
    if std_mode not in get_args(StdMode):
        raise ValueError(f"algorithm.std_mode={std_mode!r} is unknown; use one of {get_args(StdMode)}")
    if not std_eps > 0 or not adv_clip_max > 0:
        raise ValueError(f"std_eps={std_eps} and adv_clip_max={adv_clip_max} must both be > 0")
    is_valid = np.isfinite(rewards)
    values = np.zeros_like(rewards)
    is_zero_std = np.zeros(rewards.shape[0], dtype=bool)
    groups = group_rows(uids)
    global_std = float(np.std(rewards[is_valid])) if is_valid.any() else 0.0

    group_stds = []
    num_zero_std_groups = 0
    for rows in groups.values():
        rows = np.asarray(rows)
        valid_rows = rows[is_valid[rows]]
        if valid_rows.size == 0:
            continue
        group_rewards = rewards[valid_rows]
        group_std = float(np.std(group_rewards))
        group_stds.append(group_std)
        if group_std <= zero_std_threshold:
            # No spread, no signal: exactly 0 (r - mean can be a rounding error away from 0).
            num_zero_std_groups += 1
            is_zero_std[rows] = True
            continue
        std = global_std if std_mode == "global" else group_std
        values[valid_rows] = (group_rewards - group_rewards.mean()) / (std + std_eps)

    values = np.clip(values, -adv_clip_max, adv_clip_max)
    num_groups = len(groups)
    return Advantages(
        values=values.astype(np.float32),
        is_valid=is_valid,
        is_zero_std=is_zero_std,
        zero_std_ratio=num_zero_std_groups / num_groups if num_groups else 0.0,
        num_groups=num_groups,
        mean_group_std=float(np.mean(group_stds)) if group_stds else 0.0,
    )


def step_advantages(rewards, uids, algorithm_cfg, seed: int, step: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """A training step's advantages as the group-relative algorithms take them: (values (N,),
    keep (N,) the rows trained, metrics). Rows without a valid reward are not trained, nor, with
    algorithm.zero_std_policy=drop, groups without spread; with algorithm.shuffle_advantages (the
    control run) the values are permuted over the trained rows, seeded from (seed, step)."""
    algo = algorithm_cfg
    adv = compute_group_advantages(
        rewards, uids, algo.std_mode, algo.std_eps, algo.adv_clip_max, algo.zero_std_threshold
    )
    keep = adv.is_valid.copy()
    if algo.zero_std_policy == "drop":
        keep &= ~adv.is_zero_std
    if algo.shuffle_advantages:  # the control run: the same advantages, on other rows
        permutation = np.random.default_rng([seed, step, 11]).permutation(int(keep.sum()))
        adv.values[keep] = adv.values[keep][permutation]
    metrics = {
        "adv/zero_std_ratio": adv.zero_std_ratio,
        "adv/mean_group_std": adv.mean_group_std,
        "adv/abs_mean": float(np.abs(adv.values[keep]).mean()) if keep.any() else 0.0,
        "adv/num_rows_trained": int(keep.sum()),
    }
    return adv.values, keep, metrics
