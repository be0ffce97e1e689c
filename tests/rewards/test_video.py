"""Rewards on videos: an image reward per frame with each named aggregation against the frames
scored one by one; temporal consistency 1 for a still video and lower for flicker; an image reward
handed a video says how to score its frames."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl.rewards import RewardError, build_reward
from flowrl.rewards.compression import JpegCompressibility


def _videos(seed=0, batch=2, frames=5, size=16):
    rng = np.random.default_rng(seed)
    videos = rng.integers(0, 256, (batch, frames, 3, size, size), dtype=np.uint8)
    videos[:, 0] = 128  # a flat first frame: the cheapest to compress
    return videos


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"aggregate": "mean"}, lambda s: s.mean(axis=1)),
        ({"aggregate": "min"}, lambda s: s.min(axis=1)),
        ({"aggregate": "frames", "frames": [0, -1]}, lambda s: s[:, [0, -1]].mean(axis=1)),
    ],
)
def test_per_frame_aggregations_are_the_frames_scores_combined(options, expected):
    videos = _videos()
    reward = build_reward({"name": "per_frame", "options": {"reward": "jpeg_compressibility", **options}})
    frame_reward = JpegCompressibility()
    per_frame = np.stack([frame_reward(v, ["p"] * len(v), [{}] * len(v)) for v in videos])
    assert per_frame[:, 0].min() > per_frame[:, 1:].max()  # frames differ, so the rules differ
    np.testing.assert_allclose(reward(videos, ["p", "q"], [{}, {}]), expected(per_frame))


def test_temporal_consistency_is_one_for_a_still_video_and_lower_with_flicker():
    reward = build_reward("temporal_consistency")
    still = np.repeat(_videos()[:, 1:2], 5, axis=1)
    flicker = still.copy()
    flicker[:, 2] = 255 - flicker[:, 2]
    scores = reward(np.concatenate([still, flicker]), ["p"] * 4, [{}] * 4)
    np.testing.assert_allclose(scores[:2], 1.0)
    assert (scores[2:] < 0.9).all()


def test_an_image_reward_refuses_videos_and_names_the_fix():
    with pytest.raises(ValueError, match=r"scores images .* per_frame"):
        build_reward("jpeg_compressibility")(_videos(), ["p", "q"], [{}, {}])
    with pytest.raises(RewardError, match=r"frames=\[0, 9\] has indices \[9\] outside a 5-frame video"):
        build_reward(
            {
                "name": "per_frame",
                "options": {"reward": "jpeg_compressibility", "aggregate": "frames", "frames": [0, 9]},
            }
        )(_videos(), ["p", "q"], [{}, {}])
    with pytest.raises(ValueError, match=r"aggregate='median' is unknown"):
        build_reward({"name": "per_frame", "options": {"reward": "jpeg_compressibility", "aggregate": "median"}})
