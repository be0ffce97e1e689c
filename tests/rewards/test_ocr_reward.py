"""OCR reward: the score formula's rules, and real rapidocr reading rendered text offline."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl.data.render_text import render_text_image
from flowrl.rewards import RewardError, build_reward
from flowrl.rewards.ocr import normalize_text, ocr_text_score


def test_score_rules_case_whitespace_substring_and_bounds():
    assert ocr_text_score("Hello World", "hello world") == 1.0
    assert ocr_text_score("HELLOWORLD", "Hello  World") == 1.0  # whitespace removed on both sides
    assert ocr_text_score("a sign: OPEN 24 HOURS now", "open 24 hours") == 1.0  # target inside text: d = 0
    assert ocr_text_score("", "open") == 0.0  # nothing read: d = len(target)
    one_typo = ocr_text_score("helo", "hello")
    assert one_typo == pytest.approx(1 - 1 / 5)
    # A long unrelated reading is clipped at len(target): never below 0.
    assert ocr_text_score("x" * 100, "abc") == 0.0
    assert normalize_text(" A\tB\nc ") == "abc"
    with pytest.raises(ValueError, match="ground_truth"):
        ocr_text_score("anything", "  \n")


def test_rendered_text_scores_one_against_itself_and_less_against_other_text(ocr_reward):
    images = np.stack([render_text_image("HELLO WORLD"), render_text_image("flow grpo", font_px=32)])
    meta = [{"ground_truth": "HELLO WORLD"}, {"ground_truth": "flow grpo"}]
    own = ocr_reward(images, ["", ""], meta)
    np.testing.assert_array_equal(own, [1.0, 1.0])
    # Case and whitespace rules on real OCR output.
    relaxed = ocr_reward(images, ["", ""], [{"ground_truth": "hello  world"}, {"ground_truth": "FLOWGRPO"}])
    np.testing.assert_array_equal(relaxed, [1.0, 1.0])
    swapped = ocr_reward(images, ["", ""], [{"ground_truth": "flow grpo"}, {"ground_truth": "HELLO WORLD"}])
    assert (swapped < 0.5).all()
    assert swapped.dtype == np.float64


def test_noisy_text_still_read_and_no_text_scores_near_zero(ocr_reward):
    noisy = render_text_image("OPEN 24", font_px=40, noise_sigma=30)
    blank = np.full((3, 320, 320), 255, np.uint8)
    noise = np.random.default_rng(1).integers(0, 256, (3, 320, 320), dtype=np.uint8)
    scores = ocr_reward(np.stack([noisy, blank, noise]), [""] * 3, [{"ground_truth": "open 24"}] * 3)
    assert scores[0] == 1.0
    assert scores[1] <= 0.1 and scores[2] <= 0.1


def test_missing_ground_truth_names_row_and_optional_gives_nan_only_there(ocr_reward):
    images = np.stack([render_text_image("HELLO WORLD")] * 2)
    meta = [{"ground_truth": "HELLO WORLD"}, {"data_source": "ocr"}]
    with pytest.raises(RewardError) as caught:
        ocr_reward(images, ["", ""], meta)
    assert caught.value.reward_name == "ocr" and caught.value.row_index == 1
    assert "ground_truth" in str(caught.value)
    scores, failures = ocr_reward.score_or_nan(images, ["", ""], meta)
    assert scores[0] == 1.0 and np.isnan(scores[1]) and [f.row_index for f in failures] == [1]


def test_onnxruntime_threads_are_bounded(ocr_reward):
    engine = ocr_reward._engine()
    assert engine.cfg.EngineConfig.onnxruntime.intra_op_num_threads == 1
    with pytest.raises(ValueError, match="num_threads"):
        build_reward({"name": "ocr", "options": {"num_threads": 0}})


def test_a_ground_truth_of_none_is_an_error_not_the_text_none(ocr_reward):
    """A dataset row without the field carries ground_truth None; a picture of the word "None"
    must not score 1.0 against it."""
    image = render_text_image("None")[None]
    with pytest.raises(RewardError, match=r"row 0: ValueError: metadata has no 'ground_truth'"):
        ocr_reward(image, [""], [{"ground_truth": None, "data_source": "default"}])
