"""Group-wise rewards: the async scorer hands them whole groups, and `vlm` pairwise mode turns a
judge's preferences into win rates, its comparisons bounded, drawn from the seed and reported."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from chat_standin import gray_images, standin_server

from flowrl.rewards import RewardError
from flowrl.rewards.async_scoring import AsyncRewardScorer
from flowrl.rewards.groups import GroupReward, group_rows
from flowrl.rewards.vlm import VlmReward, comparison_pairs


@pytest.fixture(scope="module")
def judge_url():
    with standin_server() as (_, url):
        yield url


@pytest.fixture
def pairwise(judge_url):
    built = []

    def build(**options):
        built.append(VlmReward(judge_url, "m", mode="pairwise", **options))
        return built[-1]

    yield build
    for reward in built:
        reward.close()


def test_groups_are_uids_else_prompts():
    meta = [{"uid": "u1"}, {}, {"uid": "u1"}, {}, {"uid": "u2"}]
    assert group_rows(["a", "b", "c", "b", "a"], meta) == [[0, 2], [1, 3], [4]]


def test_pairwise_win_rates_rank_each_group(pairwise):
    levels = [200, 0, 255, 100, 30, 90]  # two groups of three, interleaved rows
    meta = [{"uid": "g0"}, {"uid": "g1"}] * 3
    reward = pairwise()
    total, components = reward.score_with_components(gray_images(levels), ["p"] * 6, meta)
    # g0: rows 0, 2, 4 = 200, 255, 30; g1: rows 1, 3, 5 = 0, 100, 90 (the brighter image wins).
    np.testing.assert_allclose(total, [0.5, 0.0, 1.0, 1.0, 0.0, 0.5])
    np.testing.assert_array_equal(components["num_comparisons"], [3] * 6)
    assert reward.num_requests == 6


def test_comparisons_are_bounded_seeded_and_both_orders_are_shown(pairwise):
    everything = comparison_pairs(8, None, seed=0, key="g")
    assert len(everything) == 28 and {tuple(sorted(pair)) for pair in everything} == {
        (i, j) for i in range(8) for j in range(i + 1, 8)
    }
    assert any(first > second for first, second in everything)  # B is sometimes the earlier row
    bounded = comparison_pairs(8, 5, seed=0, key="g")
    assert len(bounded) == 5 and bounded == comparison_pairs(8, 5, seed=0, key="g")
    assert bounded != comparison_pairs(8, 5, seed=1, key="g")
    reward = pairwise(max_comparisons_per_group=2)
    images, meta = gray_images([10, 20, 30, 40]), [{"uid": "g"}] * 4
    total, components = reward.score_with_components(images, ["p"] * 4, meta)
    assert reward.num_requests == 2 and set(components["num_comparisons"]) == {2.0}
    again, _ = reward.score_with_components(images, ["p"] * 4, meta)
    np.testing.assert_array_equal(total, again)
    assert set(np.unique(total)) <= {0.0, 0.5, 1.0}


def test_a_group_of_one_scores_half_without_asking(pairwise):
    reward = pairwise()
    total, components = reward.score_with_components(gray_images([10]), ["p"], [{}])
    assert total.tolist() == [0.5] and components["num_comparisons"].tolist() == [0] and reward.num_requests == 0


def test_a_failed_comparison_names_its_rows_or_spoils_only_its_group(pairwise):
    reward = pairwise(max_attempts=1)
    prompts = ["ok", "ok", "bad [400]", "bad [400]"]
    with pytest.raises(RewardError, match=r"row 2: comparing rows 2 and 3: judge http status"):
        reward(gray_images([1, 2, 3, 4]), prompts, [{}] * 4)
    scores, failures = reward.score_or_nan(gray_images([1, 2, 3, 4]), prompts, [{}] * 4)
    assert np.isfinite(scores[:2]).all() and np.isnan(scores[2:]).all() and len(failures) == 1


class RecordingGroupReward(GroupReward):
    """Scores each row with its group's size; records the batches it was handed."""

    name = "recording_groups"

    def __init__(self):
        self.batches, self.lock = [], threading.Lock()

    def score_groups(self, images, prompts, metadata, groups):
        with self.lock:
            self.batches.append([meta["uid"] for meta in metadata])
        scores = np.zeros(len(prompts))
        for rows in groups:
            scores[rows] = len(rows)
        return scores, {self.name: scores}


def test_the_async_scorer_hands_a_group_reward_whole_groups_only():
    reward = RecordingGroupReward()
    with AsyncRewardScorer(reward, num_workers=2, group_size=3) as scorer:
        for row in range(12):  # four groups of three, their rows interleaved as an engine finishes them
            scorer.submit(row, np.zeros((3, 4, 4), np.uint8), "p", {"uid": f"g{row % 4}"})
        total = scorer.results(12)
        np.testing.assert_array_equal(total, [3.0] * 12)
        for batch in reward.batches:
            assert all(batch.count(uid) == 3 for uid in batch), reward.batches
        # An incomplete group (a stopped rollout, a last partial group) is scored when results() asks.
        for row in range(2):
            scorer.submit(row, np.zeros((3, 4, 4), np.uint8), "p", {"uid": "short"})
        np.testing.assert_array_equal(scorer.results(2, timeout_s=10), [2.0, 2.0])


def test_pairwise_through_the_async_scorer_equals_direct_scoring(pairwise):
    reward = pairwise()
    levels, meta = [5, 250, 80, 120, 40, 200], [{"uid": f"g{row // 3}"} for row in range(6)]
    direct = reward(gray_images(levels), ["p"] * 6, meta)
    with AsyncRewardScorer(reward, num_workers=2, group_size=3) as scorer:
        for row in (0, 3, 1, 4, 2, 5):
            scorer.submit(row, gray_images([levels[row]])[0], "p", meta[row])
        np.testing.assert_array_equal(scorer.results(6), direct)


def test_a_weighted_sum_with_a_group_component_is_group_wise(judge_url):
    from flowrl.rewards import build_reward

    pair = {"name": "vlm", "options": {"url": judge_url, "model": "m", "mode": "pairwise"}}
    point = {"name": "vlm", "label": "judge_score", "options": {"url": judge_url, "model": "m"}}
    assert build_reward({"name": "multi", "options": {"components": [pair, {"name": "image_flatness"}]}}).scores_groups
    assert not build_reward({"name": "multi", "options": {"components": [point]}}).scores_groups
