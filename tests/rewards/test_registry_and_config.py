"""Registry lookup, option checks, batch validation, RewardError, build_reward_from_config."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from reward_helpers import blank_images

from flowrl.rewards import (
    Reward,
    RewardError,
    build_reward,
    build_reward_from_config,
    registered_rewards,
)
from flowrl.rewards.multi import DataSourceRouter, MultiReward


def test_unknown_reward_name_lists_registry():
    with pytest.raises(ValueError) as caught:
        build_reward("no_such_reward")
    message = str(caught.value)
    assert "no_such_reward" in message
    assert all(name in message for name in ("ocr", "jpeg_compressibility", "clip_score", "http"))


def test_unknown_option_and_spec_key_are_named():
    with pytest.raises(ValueError, match=r"'qualty'.*accepted options: quality"):
        build_reward({"name": "jpeg_compressibility", "options": {"qualty": 90}})
    with pytest.raises(ValueError, match="quality"):
        build_reward({"name": "jpeg_compressibility", "quality": 90})  # options belong under 'options'


@pytest.mark.parametrize(
    "images, match",
    [
        (np.zeros((2, 16, 16, 3), np.uint8), r"\(B, 3, H, W\)"),
        (np.zeros((2, 3, 16, 16), np.float32), "uint8"),
        (torch.zeros((2, 3, 16, 16), dtype=torch.float32), "uint8"),
        ([[0]], "numpy array or torch tensor"),
    ],
)
def test_bad_images_are_rejected_before_scoring(images, match):
    with pytest.raises(ValueError, match=match):
        build_reward("jpeg_compressibility")(images, ["", ""], [{}, {}])


def test_prompt_and_metadata_counts_must_match():
    reward = build_reward("jpeg_compressibility")
    with pytest.raises(ValueError, match="prompts has 1"):
        reward(blank_images(2), [""], [{}, {}])
    with pytest.raises(ValueError, match="metadata has 3"):
        reward(blank_images(2), ["", ""], [{}, {}, {}])


def test_failures_are_reward_errors_with_name_row_and_cause(fake_rewards):
    reward = build_reward({"name": "metadata_value"})
    with pytest.raises(RewardError) as caught:
        reward(blank_images(3), [""] * 3, [{"value": 1}, {"value": 2}, {"fail": True}])
    error = caught.value
    assert (error.reward_name, error.row_index) == ("metadata_value", 2)
    assert isinstance(error.cause, RuntimeError) and "asked to fail" in str(error)

    class BrokenBatchReward(Reward):
        name = "broken"

        def score_batch(self, images, prompts, metadata):
            raise MemoryError("out of memory")

    with pytest.raises(RewardError, match=r"'broken' failed on the whole batch: MemoryError"):
        BrokenBatchReward()(blank_images(1), [""], [{}])


@dataclass
class RewardConfigLike:
    """Mirrors the fields of flowrl.config.RewardConfig (duck typing is what matters)."""

    name: str = "jpeg_compressibility"
    options: dict = field(default_factory=dict)
    components: list = field(default_factory=list)
    route_by_data_source: dict = field(default_factory=dict)
    num_workers: int = 2


def test_build_from_config_single_multi_and_routed(fake_rewards):
    single = build_reward_from_config(RewardConfigLike(options={"quality": 80}))
    assert single.name == "jpeg_compressibility" and single.quality == 80
    multi = build_reward_from_config(RewardConfigLike(components=[{"name": "metadata_value", "weight": 2.0}]))
    assert isinstance(multi, MultiReward)
    routed = build_reward_from_config(RewardConfigLike(route_by_data_source={"ocr": "metadata_value"}))
    assert isinstance(routed, DataSourceRouter) and routed.default.name == "jpeg_compressibility"
    with pytest.raises(ValueError, match="reward.options"):
        build_reward_from_config(RewardConfigLike(options={"quality": 80}, components=[{"name": "metadata_value"}]))
    with pytest.raises(ValueError, match="reward.name='ocr'"):
        build_reward_from_config(RewardConfigLike(name="ocr", components=[{"name": "metadata_value"}]))
    with pytest.raises(ValueError, match="unknown reward name 'nope'"):
        build_reward_from_config(SimpleNamespace(name="nope", options={}, components=[], route_by_data_source={}))


def test_build_from_the_real_reward_config_when_present():
    config = pytest.importorskip("flowrl.config")
    if not hasattr(config, "RewardConfig"):
        pytest.skip("flowrl.config has no RewardConfig yet")
    reward = build_reward_from_config(config.RewardConfig())
    assert reward.name in registered_rewards()
