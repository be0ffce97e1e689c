"""Multi-reward weighting, per-component metrics, optional/required failures, data_source routing."""

from __future__ import annotations

import numpy as np
import pytest
from reward_helpers import blank_images

from flowrl.rewards import RewardError, build_reward, summarize_rewards


def _multi(components):
    return build_reward({"name": "multi", "options": {"components": components}})


def test_weighted_sum_and_components(fake_rewards):
    reward = _multi(
        [
            {"name": "metadata_value", "weight": 0.5},
            {"name": "metadata_value", "label": "doubled", "weight": -2.0, "options": {"scale": 2.0}},
            {"name": "jpeg_incompressibility", "weight": 0.1},
        ]
    )
    values = np.array([1.0, -3.0, 0.25])
    images = np.random.default_rng(0).integers(0, 256, (3, 3, 16, 16), dtype=np.uint8)
    meta = [{"value": v} for v in values]
    total, components = reward.score_with_components(images, [""] * 3, meta)
    jpeg = build_reward("jpeg_incompressibility")(images, [""] * 3, meta)
    assert set(components) == {"metadata_value", "doubled", "jpeg_incompressibility"}
    np.testing.assert_allclose(components["doubled"], 2 * values)
    np.testing.assert_allclose(total, 0.5 * values - 2.0 * 2 * values + 0.1 * jpeg)
    np.testing.assert_array_equal(reward(images, [""] * 3, meta), total)
    metrics = summarize_rewards(total, components)
    assert metrics["reward/doubled"] == pytest.approx(2 * values.mean())
    assert metrics["reward/num_nan_rows"] == 0


def test_optional_failure_makes_only_those_rows_nan_and_counts_them(fake_rewards):
    reward = _multi(
        [
            {"name": "jpeg_compressibility", "weight": 1.0},
            {"name": "metadata_value", "weight": 1.0, "optional": True},
        ]
    )
    meta = [{"value": 1.0}, {"fail": True}, {"value": 3.0}]
    total, components = reward.score_with_components(blank_images(3), [""] * 3, meta)
    assert np.isnan(total[1]) and np.isfinite(total[[0, 2]]).all()
    assert np.isfinite(components["jpeg_compressibility"]).all()  # the other component still logs
    metrics = summarize_rewards(total, components)
    assert metrics["reward/num_nan_rows"] == 1
    assert metrics["reward/metadata_value"] == pytest.approx(2.0)  # mean over rows that scored


def test_required_failure_raises_with_component_name_and_row(fake_rewards):
    reward = _multi([{"name": "jpeg_compressibility"}, {"name": "metadata_value", "label": "judge"}])
    with pytest.raises(RewardError) as caught:
        reward(blank_images(3), [""] * 3, [{"value": 1.0}, {"value": 2.0}, {"fail": True}])
    assert (caught.value.reward_name, caught.value.row_index) == ("judge", 2)


@pytest.mark.parametrize(
    "components, match",
    [
        ([], "non-empty"),
        ([{"name": "metadata_value", "weight": float("nan")}], "finite"),
        ([{"name": "metadata_value"}, {"name": "metadata_value"}], "label"),
        ([{"name": "metadata_value", "wieght": 1}], "wieght"),
        ([{"name": "nope"}], "component 0.*unknown reward name 'nope'"),
    ],
)
def test_bad_components_are_named(fake_rewards, components, match):
    with pytest.raises(ValueError, match=match):
        _multi(components)


def test_routing_by_data_source(fake_rewards):
    router = build_reward(
        {
            "name": "route_by_data_source",
            "options": {
                "routes": {"ocr": {"name": "metadata_value", "options": {"scale": 10.0}}},
                "default": "metadata_value",
            },
        }
    )
    meta = [
        {"data_source": "ocr", "value": 1.0},
        {"data_source": "other", "value": 2.0},
        {"value": 3.0},
        {"data_source": "ocr", "value": 4.0},
    ]
    total, components = router.score_with_components(blank_images(4), [""] * 4, meta)
    np.testing.assert_allclose(total, [10.0, 2.0, 3.0, 40.0])
    assert list(components) == ["metadata_value"]  # both routes are this reward: one metric
    # A failing routed row is reported in the batch's numbering.
    meta[3] = {"data_source": "ocr", "fail": True}
    with pytest.raises(RewardError) as caught:
        router(blank_images(4), [""] * 4, meta)
    assert caught.value.row_index == 3
    no_default = build_reward({"name": "route_by_data_source", "options": {"routes": {"ocr": "metadata_value"}}})
    with pytest.raises(RewardError, match="data_source='web'"):
        no_default(blank_images(1), [""], [{"data_source": "web", "value": 1}])
