"""The video toy world's evaluator: clips of their own caption score 1, clips of another direction
or colour score low, blur and noise of a decoder's kind keep the verdict, and bad captions are
named with their row."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from PIL import Image, ImageFilter

from flowrl.data.toy_video import MotionCaption, motion_requirements, parse_motion_caption, render_clip
from flowrl.data.toy_video_split import all_motion_captions
from flowrl.rewards import RewardError, build_reward


def _videos(clips) -> np.ndarray:
    """(B, F, 3, H, W) from (F, H, W, 3) clips, as a video model's samples come."""
    return np.ascontiguousarray(np.stack(clips).transpose(0, 1, 4, 2, 3))


def test_clips_of_their_own_caption_score_one():
    reward = build_reward("shapes_video")
    captions = [c for c in all_motion_captions() for _ in range(3)]
    videos = _videos([render_clip(c, seed=i) for i, c in enumerate(captions)])
    texts = [c.text for c in captions]
    start = time.perf_counter()
    total, components = reward.score_with_components(videos, texts, [{"ground_truth": t} for t in texts])
    per_clip = (time.perf_counter() - start) / len(captions)
    assert np.mean(components["strict"] == 1.0) >= 0.99
    assert np.array_equal(total, components["partial"])
    assert per_clip < 0.1  # a few milliseconds in practice


@pytest.mark.parametrize("changed", ["direction", "colour"])
def test_clips_of_another_direction_or_colour_score_low(changed):
    reward = build_reward("shapes_video")
    rng = random.Random(0)
    captions = all_motion_captions()
    asked = []
    for caption in captions:
        options = [c for c in captions if getattr(c, changed) != getattr(caption, changed)]
        options = [
            c
            for c in options
            if all(getattr(c, f) == getattr(caption, f) for f in ("colour", "shape", "direction") if f != changed)
        ]
        asked.append(rng.choice(options))
    videos = _videos([render_clip(c, seed=i) for i, c in enumerate(captions)])
    _, components = reward.score_with_components(videos, [c.text for c in asked], [{}] * len(asked))
    assert components["strict"].max() == 0.0
    assert np.allclose(components["partial"], 0.75)  # one of the four requirements fails


def test_partial_score_counts_the_requirements_that_hold():
    caption = parse_motion_caption("a red circle moving right")
    assert [r.kind for r in motion_requirements(caption)] == ["colour", "shape", "motion", "total"]
    still = render_clip(caption, seed=0)
    still[:] = still[:1]  # the first frame, held: nothing moves
    reward = build_reward("shapes_video")
    assert reward(_videos([still]), [caption.text], [{}])[0] == 0.75
    blank = np.full_like(still, 255)
    assert reward(_videos([blank]), [caption.text], [{}])[0] == 0.0
    wrong = render_clip(MotionCaption("blue", "square", "left"), seed=0)
    strict = build_reward({"name": "shapes_video", "options": {"score": "strict"}})
    assert (
        reward(_videos([wrong]), [caption.text], [{}])[0] == 0.25
        and strict(_videos([wrong]), [caption.text], [{}])[0] == 0
    )


def test_blur_and_noise_of_a_decoder_keep_the_verdict():
    rng = np.random.default_rng(0)
    reward = build_reward({"name": "shapes_video", "options": {"score": "strict"}})
    captions = all_motion_captions()
    clips = []
    for index, caption in enumerate(captions):
        frames = []
        for frame in render_clip(caption, seed=index):
            blurred = np.asarray(Image.fromarray(frame).filter(ImageFilter.GaussianBlur(0.5)), dtype=np.float64)
            frames.append(np.clip(blurred + rng.normal(0, 8, blurred.shape), 0, 255).astype(np.uint8))
        clips.append(np.stack(frames))
    assert reward(_videos(clips), [c.text for c in captions], [{}] * len(captions)).mean() >= 0.95


def test_bad_captions_and_options_are_named():
    reward = build_reward("shapes_video")
    videos = _videos([render_clip(parse_motion_caption("a red circle moving up"), seed=0)] * 2)
    with pytest.raises(RewardError) as error:
        reward(videos, ["a red circle moving up", "x"], [{}, {"ground_truth": "a red circle moving sideways"}])
    text = str(error.value)
    assert "row 1" in text and "unknown direction 'sideways'" in text and "ground_truth" in text
    assert "unknown colour 'pink'" in reward.cannot_score({"prompt": "a pink circle moving up"})
    assert reward.cannot_score({"prompt": "a red circle moving up"}) is None
    with pytest.raises(ValueError, match="min_travel=2"):
        build_reward({"name": "shapes_video", "options": {"min_travel": 2}})
    with pytest.raises(ValueError, match="score='best'"):
        build_reward({"name": "shapes_video", "options": {"score": "best"}})
