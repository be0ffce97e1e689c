"""Rewards built from other rewards: a weighted sum (`multi`) and routing by `data_source`.

MultiReward: total = sum_i weight_i * score_i over components, each also returned under its own
name so the trainer logs `reward/<name>`. A component marked `optional: true` that fails gives
NaN on the rows it failed, so those rows' totals are NaN and the trainer leaves them out of the
advantages (and counts them); a required component's failure raises RewardError.

DataSourceRouter: rows are grouped by `metadata["data_source"]` and each group is scored by the
reward routed to that source; rows whose source has no route use the default reward.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from flowrl.config.sections import REWARD_COMPONENT_KEYS
from flowrl.rewards.base import Reward, build_reward

logger = logging.getLogger(__name__)

# One home for the component keys: the config section that declares them.
COMPONENT_KEYS = REWARD_COMPONENT_KEYS


def _as_reward(spec_or_reward, where: str) -> Reward:
    if isinstance(spec_or_reward, Reward):
        return spec_or_reward
    try:
        return build_reward(spec_or_reward)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from error


class MultiReward(Reward):
    """Weighted sum of named rewards; see the module docstring for the failure rules."""

    name = "multi"

    def __init__(self, components: list[dict]):
        if not isinstance(components, list) or not components:
            raise ValueError(
                f"multi option components={components!r} must be a non-empty list of "
                "{name, weight, options, optional} dicts"
            )
        self.components: list[tuple[str, float, bool, Reward]] = []
        for index, component in enumerate(components):
            where = f"reward component {index}"
            if not isinstance(component, dict) or "name" not in component:
                raise ValueError(f"{where} is {component!r}; give a dict with at least 'name'")
            unknown = sorted(set(component) - set(COMPONENT_KEYS))
            if unknown:
                raise ValueError(
                    f"{where} ({component['name']!r}) has unknown key(s) {unknown}; allowed: {COMPONENT_KEYS}"
                )
            weight = component.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"{where} ({component['name']!r}) weight={weight!r} must be a finite number")
            label = component.get("label") or component["name"]
            if any(label == existing for existing, *_ in self.components):
                raise ValueError(
                    f"{where}: component name {label!r} is used twice; give one of them a distinct 'label'"
                )
            reward = _as_reward({"name": component["name"], "options": component.get("options") or {}}, where)
            reward.name = label  # failures and logs carry the component's label
            self.components.append((label, float(weight), bool(component.get("optional", False)), reward))

    takes_videos = True  # passes the batch on; each component takes or refuses videos itself

    @property
    def scores_rows_one_by_one(self) -> bool:
        return all(reward.scores_rows_one_by_one for *_, reward in self.components)

    @property
    def scores_groups(self) -> bool:
        return any(reward.scores_groups for *_, reward in self.components)

    def cancel(self) -> None:
        super().cancel()
        for *_, reward in self.components:
            reward.cancel()

    def cannot_score(self, metadata: dict) -> str | None:
        """The first required component's reason (an optional one scores such a row NaN)."""
        for label, _, is_optional, reward in self.components:
            reason = None if is_optional else reward.cannot_score(metadata)
            if reason is not None:
                return f"component {label!r}: {reason}"
        return None

    def score_batch_with_components(self, images, prompts, metadata):
        total = np.zeros(len(prompts), dtype=np.float64)
        components: dict[str, np.ndarray] = {}
        for label, weight, is_optional, reward in self.components:
            if is_optional:
                scores, failures = reward.score_or_nan(images, prompts, metadata)
                if failures:
                    logger.warning(
                        "optional reward %r failed on %d row(s), scored NaN; first: %s",
                        label,
                        int(np.isnan(scores).sum()),
                        failures[0],
                    )
                sub_components = {label: scores}
            else:
                scores, sub_components = reward.score_with_components(images, prompts, metadata)
            components[label] = scores
            for sub_name, sub_scores in sub_components.items():
                if sub_name != label:  # e.g. the components of a remote multi-reward
                    components[f"{label}/{sub_name}"] = sub_scores
            total += weight * scores  # NaN from an optional failure makes the row's total NaN
        return total, components


class DataSourceRouter(Reward):
    """Scores each row with the reward routed to its `metadata[data_source_key]`."""

    name = "route_by_data_source"

    def __init__(self, routes: dict, default=None, data_source_key: str = "data_source"):
        if not isinstance(routes, dict) or not routes:
            raise ValueError(f"route_by_data_source routes={routes!r} must be a non-empty dict data_source -> reward")
        self.routes = {source: _as_reward(spec, f"route for data_source {source!r}") for source, spec in routes.items()}
        self.default = None if default is None else _as_reward(default, "default reward")
        self.data_source_key = data_source_key

    def _reward_for(self, source) -> Reward:
        if source in self.routes:
            return self.routes[source]
        if self.default is None:
            raise ValueError(
                f"no reward is routed for {self.data_source_key}={source!r} and there is no default; "
                f"routed sources: {sorted(self.routes)}"
            )
        return self.default

    def cancel(self) -> None:
        super().cancel()
        for reward in [*self.routes.values(), *([] if self.default is None else [self.default])]:
            reward.cancel()

    def cannot_score(self, metadata: dict) -> str | None:
        try:
            reward = self._reward_for(metadata.get(self.data_source_key))
        except ValueError as error:
            return str(error)
        reason = reward.cannot_score(metadata)
        if reason is None:
            return None
        return f"{self.data_source_key}={metadata.get(self.data_source_key)!r} goes to {reward.name!r}: {reason}"

    takes_videos = True  # passes the batch on; each component takes or refuses videos itself

    @property
    def scores_rows_one_by_one(self) -> bool:
        rewards = [*self.routes.values(), *([] if self.default is None else [self.default])]
        return all(reward.scores_rows_one_by_one for reward in rewards)

    @property
    def scores_groups(self) -> bool:
        rewards = [*self.routes.values(), *([] if self.default is None else [self.default])]
        return any(reward.scores_groups for reward in rewards)

    def score_batch_with_components(self, images, prompts, metadata):
        batch_size = len(prompts)
        groups: dict[int, tuple[Reward, list[int]]] = {}
        for row, meta in enumerate(metadata):
            reward = self._reward_for(meta.get(self.data_source_key))
            groups.setdefault(id(reward), (reward, []))[1].append(row)
        total = np.full(batch_size, np.nan)
        components: dict[str, np.ndarray] = {}
        for reward, rows in groups.values():
            try:
                scores, sub_components = reward.score_with_components(
                    images[rows], [prompts[r] for r in rows], [metadata[r] for r in rows]
                )
            except Exception as error:
                # Re-address the failing row to this batch's numbering before it leaves.
                row = getattr(error, "row_index", None)
                if hasattr(error, "with_row_index"):
                    raise error.with_row_index(None if row is None else rows[row]) from error
                raise
            total[rows] = scores
            for sub_name, sub_scores in sub_components.items():
                # Rows of other sources have no score for this component: NaN, skipped by nanmean.
                components.setdefault(sub_name, np.full(batch_size, np.nan))[rows] = sub_scores
        return total, components


def summarize_rewards(total: np.ndarray, components: dict[str, np.ndarray]) -> dict[str, float]:
    """Metrics to log: `reward/<name>` (nan-mean per component), `reward/total`, NaN-row count."""
    total = np.asarray(total, dtype=np.float64)
    finite = ~np.isnan(total)
    metrics = {
        "reward/total": float(total[finite].mean()) if finite.any() else float("nan"),
        "reward/num_nan_rows": float((~finite).sum()),
    }
    for name, scores in components.items():
        scores = np.asarray(scores, dtype=np.float64)
        scored = scores[~np.isnan(scores)]
        metrics[f"reward/{name}"] = float(scored.mean()) if scored.size else float("nan")
    return metrics
