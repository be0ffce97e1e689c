"""Rewards: map generated images (+ prompts, per-row metadata) to one float64 score per image.

Public API:
- `Reward` (interface), `RewardError` (failure with reward name, row and cause)
- `build_reward(spec)`: `"name"` or `{"name": ..., "options": {...}}` through the registry
- `build_reward_from_config(reward_cfg)`: from the config's reward section (duck-typed
  `RewardConfig`: name, options, components, route_by_data_source, num_workers)
- `register_reward`, `registered_rewards`; `summarize_rewards` for `reward/<name>` metrics
- `AsyncRewardScorer`: score samples as the engine finishes them (flowrl.rewards.async_scoring)

Heavy dependencies (rapidocr, transformers, httpx) load only when a reward that needs them is
built, so importing this package is cheap.
"""

from __future__ import annotations

from flowrl.rewards.base import (
    Reward,
    RewardError,
    RowwiseReward,
    build_reward,
    register_reward,
    registered_rewards,
    unregister_reward,
    validate_batch,
)

__all__ = [
    "AsyncRewardScorer",
    "Reward",
    "RewardError",
    "RowwiseReward",
    "build_reward",
    "build_reward_from_config",
    "register_reward",
    "registered_rewards",
    "summarize_rewards",
    "unregister_reward",
    "validate_batch",
]


# RewardConfig.name's default; with components set it is not a choice the user made.
DEFAULT_REWARD_NAME = "jpeg_compressibility"


def build_reward_from_config(reward_cfg) -> Reward:
    """Build the reward described by a RewardConfig-like object.

    `components` non-empty -> a weighted MultiReward of them (`name` must then be "multi" or
    left at its default, `options` empty); otherwise the reward `name` with `options`.
    `route_by_data_source` non-empty -> rows whose data_source is routed use that reward, the
    others the reward above. `num_workers` is for AsyncRewardScorer and is not used here.
    """
    from flowrl.rewards.multi import DataSourceRouter, MultiReward

    name = getattr(reward_cfg, "name", None)
    options = dict(getattr(reward_cfg, "options", None) or {})
    components = list(getattr(reward_cfg, "components", None) or [])
    routes = dict(getattr(reward_cfg, "route_by_data_source", None) or {})
    if components:
        if name not in (None, "multi", DEFAULT_REWARD_NAME):
            raise ValueError(
                f"reward.name={name!r} is set together with reward.components; set reward.name to 'multi' "
                "(or leave it at its default) and list every reward under components"
            )
        if options:
            raise ValueError(
                f"reward.options={options!r} is set together with reward.components; put per-reward "
                "options inside each component's 'options' and leave reward.options empty"
            )
        main: Reward = MultiReward(_plain(components))
    else:
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"reward.name={name!r} must be a reward name; choose one of: {', '.join(registered_rewards())}"
            )
        main = build_reward({"name": name, "options": _plain(options)})
    if routes:
        return DataSourceRouter(_plain(routes), default=main)
    return main


def _plain(value):
    """OmegaConf containers -> plain dicts/lists, so rewards see ordinary Python values."""
    if hasattr(value, "items"):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(item) for item in value]
    return value


def __getattr__(name: str):
    # Lazy: these pull in threading/numpy helpers only when used.
    if name == "AsyncRewardScorer":
        from flowrl.rewards.async_scoring import AsyncRewardScorer

        return AsyncRewardScorer
    if name == "summarize_rewards":
        from flowrl.rewards.multi import summarize_rewards

        return summarize_rewards
    raise AttributeError(f"module 'flowrl.rewards' has no attribute {name!r}")
