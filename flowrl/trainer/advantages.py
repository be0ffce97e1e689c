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

With several reward components, `compute_gdpo_advantages` normalises each one within its group
before the weighted sum (GDPO), so that one high-variance reward does not drown the others.

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


def step_advantages(rows, algorithm_cfg, seed: int, step: int, component_weights: dict | None = None):
    """A training step's advantages as the group-relative algorithms take them: (values (N,),
    keep (N,) the rows trained, metrics), from `rows` (flowrl.distributed.step_rows.StepRows:
    rewards, uids, components). component_weights: {component: weight} with
    algorithm.advantage_aggregation=gdpo (`gdpo_weights`), else None. Rows without a valid reward
    are not trained, nor, with algorithm.zero_std_policy=drop, groups without spread; with
    algorithm.shuffle_advantages (the control run) the values are permuted over the trained rows,
    seeded from (seed, step)."""
    algo = algorithm_cfg
    settings = (algo.std_mode, algo.std_eps, algo.adv_clip_max, algo.zero_std_threshold)
    if component_weights is None:
        adv = compute_group_advantages(rows.rewards, rows.uids, *settings)
    else:
        missing = sorted(set(component_weights) - set(rows.components))
        if missing:
            raise ValueError(f"algorithm.advantage_aggregation=gdpo: the reward returned no scores for {missing}")
        scores = {name: rows.components[name] for name in component_weights}
        adv = compute_gdpo_advantages(scores, component_weights, rows.uids, *settings)
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


def gdpo_weights(cfg) -> dict | None:
    """{component label: weight} of the reward's components with algorithm.advantage_aggregation
    = gdpo, else None."""
    if cfg.algorithm.advantage_aggregation != "gdpo":
        return None
    return {c.get("label") or c["name"]: c["weight"] for c in cfg.reward.resolved_components()}


def compute_gdpo_advantages(
    components: dict[str, np.ndarray],
    weights: dict[str, float],
    uids: Sequence,
    std_mode: StdMode = "global",
    std_eps: float = 1e-4,
    adv_clip_max: float = 5.0,
    zero_std_threshold: float = 1e-6,
) -> Advantages:
    """GDPO's advantages of several rewards (algorithm.advantage_aggregation=gdpo): each component
    k normalised on its own as above (unclamped), A_k = (r_k - group mean) / (std_k + std_eps),
    then summed with the component weights and normalised over the batch,
        A = (sum_k w_k A_k - mean) / (std + std_eps),  clamped to +-adv_clip_max,
    the batch mean and std taken over the rows that carry signal. A row is valid when every
    component scored it; a group has no spread (advantage exactly 0) when no component has.
    mean_group_std is the mean over components of their mean group std."""
    if set(components) != set(weights):
        raise ValueError(f"reward components {sorted(components)} and weights {sorted(weights)} differ")
    parts = {
        name: compute_group_advantages(scores, uids, std_mode, std_eps, np.inf, zero_std_threshold)
        for name, scores in components.items()
    }
    is_valid = np.logical_and.reduce([part.is_valid for part in parts.values()])
    is_zero_std = np.logical_and.reduce([part.is_zero_std for part in parts.values()])
    combined = sum(weights[name] * part.values.astype(np.float64) for name, part in parts.items())
    signal = is_valid & ~is_zero_std
    values = np.zeros(len(is_valid))
    if signal.any():
        values[signal] = (combined[signal] - combined[signal].mean()) / (combined[signal].std() + std_eps)
    groups = group_rows(uids)
    zero_std_groups = sum(bool(is_zero_std[rows].all()) for rows in groups.values())
    return Advantages(
        values=np.clip(values, -adv_clip_max, adv_clip_max).astype(np.float32),
        is_valid=is_valid,
        is_zero_std=is_zero_std,
        zero_std_ratio=zero_std_groups / len(groups) if groups else 0.0,
        num_groups=len(groups),
        mean_group_std=float(np.mean([part.mean_group_std for part in parts.values()])),
    )
