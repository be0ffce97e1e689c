"""The toy world's evaluator: its own captions' pictures score 1, other captions' score near 0,
blur and noise of a decoder's kind do not change the verdict, and bad captions are named with
their row."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from PIL import Image, ImageFilter

from flowrl.cli import main
from flowrl.data.toy_render import render_caption
from flowrl.data.toy_split import all_captions
from flowrl.data.toy_world import parse_caption, requirements
from flowrl.rewards import RewardError, build_reward
from flowrl.rewards.shapes import check_caption, detect_objects


def _captions(count: int, seed: int):
    """Captions of every category, in proportion to none: `count` per category, drawn at random."""
    rng = random.Random(seed)
    return [rng.choice(group) for group in all_captions().values() for _ in range(count)]


def _chw(picture_hwc):
    return np.ascontiguousarray(picture_hwc.transpose(2, 0, 1))


def test_pictures_of_their_own_caption_score_one():
    reward = build_reward("shapes")
    captions = _captions(60, seed=0)
    pictures = np.stack([_chw(render_caption(c, seed=i)) for i, c in enumerate(captions)])
    texts = [c.text for c in captions]
    start = time.perf_counter()
    total, components = reward.score_with_components(pictures, texts, [{"ground_truth": t} for t in texts])
    per_image = (time.perf_counter() - start) / len(captions)
    assert np.mean(components["strict"] == 1.0) >= 0.99
    assert np.array_equal(total, components["partial"])
    assert per_image < 0.05  # milliseconds in practice; generous for a loaded CI machine


def test_pictures_of_another_caption_score_near_zero():
    rng = random.Random(1)
    captions = _captions(40, seed=1)
    strict, partial = [], []
    for index, drawn in enumerate(captions):
        asked = rng.choice(captions)
        if asked.text == drawn.text:
            continue
        results = check_caption(detect_objects(render_caption(drawn, seed=index)), asked)
        strict.append(all(results))
        partial.append(np.mean(results))
    assert np.mean(strict) <= 0.05
    assert np.mean(partial) <= 0.4


def test_blur_and_noise_of_a_decoder_keep_the_verdict():
    rng = np.random.default_rng(0)
    captions = _captions(20, seed=2)
    kept = []
    for index, caption in enumerate(captions):
        blurred = Image.fromarray(render_caption(caption, seed=index)).filter(
            ImageFilter.GaussianBlur(0.5)
        )  # about a pixel of a 48-pixel picture
        noisy = np.asarray(blurred, dtype=np.float64) + rng.normal(0, 8, blurred.size[::-1] + (3,))
        picture = np.clip(noisy, 0, 255).astype(np.uint8)
        kept.append(all(check_caption(detect_objects(picture), caption)))
    assert np.mean(kept) >= 0.95


def test_partial_score_counts_the_requirements_that_hold():
    caption = parse_caption("a red circle to the left of a blue square")
    assert [r.kind for r in requirements(caption)] == ["present", "present", "relation", "total"]
    swapped = render_caption(parse_caption("a red circle to the right of a blue square"), seed=0)
    assert check_caption(detect_objects(swapped), caption) == [True, True, False, True]
    reward = build_reward({"name": "shapes", "options": {"score": "strict"}})
    assert reward(_chw(swapped)[None], [caption.text], [{}])[0] == 0.0  # read from the prompt
    partial = build_reward("shapes")(_chw(swapped)[None], ["ignored"], [{"ground_truth": caption.text}])
    assert partial[0] == 0.75
    counting = parse_caption("three blue squares")
    empty = np.full((64, 64, 3), 255, np.uint8)
    assert check_caption(detect_objects(empty), counting) == [False, False, False]


def test_unknown_words_are_named_with_the_row_and_the_caption():
    reward = build_reward("shapes")
    pictures = np.stack([_chw(render_caption(parse_caption("a red circle"), seed=0))] * 2)
    with pytest.raises(RewardError) as error:
        reward(pictures, ["a red circle", "x"], [{}, {"ground_truth": "a pink circle"}])
    text = str(error.value)
    assert "row 1" in text and "'a pink circle'" in text and "unknown colour 'pink'" in text and "ground_truth" in text
    with pytest.raises(RewardError, match="row 0.*'a red hexagon'.*prompt"):
        reward(pictures[:1], ["a red hexagon"], [{}])
    with pytest.raises(ValueError, match="score='best'"):
        build_reward({"name": "shapes", "options": {"score": "best"}})


def test_reward_score_cli_reads_the_caption(tmp_path, capsys):
    path = tmp_path / "scene.png"
    Image.fromarray(render_caption(parse_caption("two green squares"), seed=4)).save(path)
    assert main(["reward-score", "--reward", "shapes", "--ground-truth", "two green squares", str(path)]) == 0
    assert main(["reward-score", "--reward", "shapes", "--prompt", "two red squares", str(path)]) == 0
    assert capsys.readouterr().out.split() == ["1", "0.333333"]
