"""Async scoring: same scores as synchronous scoring, starts before the last row is submitted,
batches what is pending (a reward that scores rows one by one: spread over the workers), and
re-raises failures with the submitted row index; the pool size `auto` means."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from flowrl.rewards import AsyncRewardScorer, Reward, RewardError, RowwiseReward, build_reward
from flowrl.rewards.async_scoring import scoring_workers
from flowrl.rewards.multi import DataSourceRouter, MultiReward


def _images(num_rows: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (num_rows, 3, 24, 24), dtype=np.uint8)
    images[::3] = 200  # some flat rows so scores differ a lot
    return images


def test_async_equals_sync_with_rows_finishing_out_of_order():
    reward = build_reward(
        {
            "name": "multi",
            "options": {
                "components": [
                    {"name": "jpeg_compressibility", "weight": 1.0},
                    {"name": "jpeg_incompressibility", "weight": 0.5},
                ]
            },
        }
    )
    images = _images(12)
    prompts, meta = [f"p{i}" for i in range(12)], [{} for _ in range(12)]
    sync_total, sync_components = reward.score_with_components(images, prompts, meta)
    order = list(range(12))
    random.Random(0).shuffle(order)
    with AsyncRewardScorer(reward, num_workers=2) as scorer:
        for step in range(2):  # reusable across steps
            for row in order:  # a fake engine finishing rows in its own order, over time
                scorer.submit(row, images[row], prompts[row], meta[row])
                time.sleep(0.002)
            total, components = scorer.results_with_components()
            np.testing.assert_array_equal(total, sync_total)
            for name in sync_components:
                np.testing.assert_array_equal(components[name], sync_components[name])


class GatedReward(Reward):
    """Records when each batch starts and blocks until the test opens the gate."""

    name = "gated"

    def __init__(self):
        self.first_batch_started = threading.Event()
        self.gate = threading.Event()
        self.batches: list[list[str]] = []

    def score_batch(self, images, prompts, metadata):
        self.batches.append(list(prompts))
        self.first_batch_started.set()
        assert self.gate.wait(10)
        return np.array([float(p) for p in prompts])


def test_scoring_starts_before_last_row_and_batches_pending_rows():
    reward = GatedReward()
    images = _images(8)
    with AsyncRewardScorer(reward, num_workers=1) as scorer:
        scorer.submit(0, images[0], "0", {})
        # The producer has not finished the batch, yet scoring of row 0 has begun.
        assert reward.first_batch_started.wait(5)
        assert reward.batches == [["0"]]
        for row in range(1, 8):  # these finish while the only worker is busy ...
            scorer.submit(row, images[row], str(row), {})
        with pytest.raises(TimeoutError, match=r"7 row\(s\) pending and 1 in flight"):
            scorer.results(timeout_s=0.05)
        reward.gate.set()
        scores = scorer.results()
    np.testing.assert_array_equal(scores, np.arange(8.0))
    # ... so the worker takes all seven pending rows as one batch.
    assert reward.batches == [["0"], [str(r) for r in range(1, 8)]]
    assert scorer.scored_batch_sizes == [1, 7]


class GatedRowwise(RowwiseReward):
    """A reward scored row by row (as OCR) whose batches wait for the test's gate; records each
    batch's rows and the thread that scored it."""

    name = "gated_rowwise"

    def __init__(self):
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.batches: list[tuple[str, list[str]]] = []
        self.started = threading.Semaphore(0)

    def score_batch(self, images, prompts, metadata):
        with self.lock:
            self.batches.append((threading.current_thread().name, list(prompts)))
        self.started.release()
        assert self.gate.wait(10)
        return super().score_batch(images, prompts, metadata)

    def score_row(self, image_hwc, prompt, metadata):
        return float(prompt)


def test_a_burst_for_a_reward_scored_row_by_row_is_shared_by_every_worker():
    """Eight rows finishing at once (an engine-batched group) while both workers are busy: the
    first free worker takes its half, not all eight, so the other scores the rest at the same
    time; a batched reward (test above) takes them as one batch."""
    reward = GatedRowwise()
    images = _images(10)
    with AsyncRewardScorer(reward, num_workers=2) as scorer:
        for row in (0, 1):  # one row each: both workers wait at the gate
            scorer.submit(row, images[row], str(row), {})
            assert reward.started.acquire(timeout=5)
        for row in range(2, 10):
            scorer.submit(row, images[row], str(row), {})
        reward.gate.set()
        scores = scorer.results()
    np.testing.assert_array_equal(scores, np.arange(10.0))
    burst = [rows for _, rows in reward.batches[2:]]
    assert sorted(len(rows) for rows in burst) == [1, 1, 2, 4]  # 8 -> 4, then 2 of the 4 left, ...
    assert sorted(row for rows in burst for row in rows) == sorted(str(r) for r in range(2, 10))
    assert len({thread for thread, _ in reward.batches}) == 2


def test_combined_rewards_score_row_by_row_only_when_all_their_rewards_do():
    rowwise = {"name": "jpeg_compressibility"}
    batched = {"name": "image_contrast"}
    assert MultiReward([rowwise, {**rowwise, "label": "again"}]).scores_rows_one_by_one
    assert not MultiReward([rowwise, batched]).scores_rows_one_by_one
    assert DataSourceRouter({"a": rowwise["name"]}, default=rowwise).scores_rows_one_by_one
    assert not DataSourceRouter({"a": rowwise["name"]}, default=batched).scores_rows_one_by_one


def test_auto_scoring_workers_share_this_process_cores_among_the_ranks_of_the_host(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert scoring_workers("auto") == 15  # one core left to the rank's own thread
    assert scoring_workers("auto", ranks_on_this_host=8) == 1
    assert scoring_workers("auto", ranks_on_this_host=32) == 1
    assert scoring_workers(3, ranks_on_this_host=8) == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert scoring_workers("auto") == 1


def test_required_failure_is_raised_with_submitted_row_index(fake_rewards):
    reward = build_reward("metadata_value")
    images = _images(4)
    with AsyncRewardScorer(reward, num_workers=2, max_batch_size=2) as scorer:
        for row in (3, 0, 1, 2):
            scorer.submit(row, images[row], "", {"fail": True} if row == 2 else {"value": row})
        with pytest.raises(RewardError) as caught:
            scorer.results()
    assert caught.value.row_index == 2


def test_bad_submissions_are_rejected():
    with AsyncRewardScorer(build_reward("jpeg_compressibility"), num_workers=1) as scorer:
        image = _images(1)[0]
        scorer.submit(0, image, "", {})
        with pytest.raises(ValueError, match="twice"):
            scorer.submit(0, image, "", {})
        scorer.submit(2, image, "", {})
        with pytest.raises(ValueError, match=r"missing \[1\]"):
            scorer.results()
        with pytest.raises(ValueError, match="uint8"):
            scorer.submit(0, image.astype(np.float32), "", {})
    with pytest.raises(ValueError, match="num_workers"):
        AsyncRewardScorer(build_reward("jpeg_compressibility"), num_workers=0)


def test_close_dropping_pending_rows_returns_after_the_batch_in_flight():
    class Slow(Reward):
        name = "slow"

        def score_batch(self, images, prompts, metadata):
            time.sleep(0.3)
            return np.zeros(len(images))

    before = set(threading.enumerate())
    scorer = AsyncRewardScorer(Slow(), num_workers=1, max_batch_size=1)
    images = _images(10)
    for row in range(10):
        scorer.submit(row, images[row], str(row), {})
    start = time.perf_counter()
    scorer.close(drop_pending=True)
    assert time.perf_counter() - start < 1.5  # not the 3 s that scoring all ten would take
    assert len(scorer.scored_batch_sizes) < 10
    assert set(threading.enumerate()) <= before  # the worker was joined


def test_close_after_a_stop_leaves_a_hung_batch_within_its_timeout(capsys):
    """A reward that never answers (an unanswered remote call) does not hold a stopped run's
    close past `join_timeout_s`: the busy worker is left, with a warning naming the reward."""
    started, release = threading.Event(), threading.Event()

    class Hung(Reward):
        name = "hung"

        def score_batch(self, images, prompts, metadata):
            started.set()
            release.wait(30)
            return np.zeros(len(prompts))

    scorer = AsyncRewardScorer(Hung(), num_workers=1)
    scorer.submit(0, np.zeros((3, 4, 4), np.uint8), "", {})
    assert started.wait(10)
    start = time.monotonic()
    assert scorer.close(drop_pending=True, join_timeout_s=0.2) is False
    assert time.monotonic() - start < 2.0
    assert "reward 'hung': 1 scoring worker(s) still busy" in capsys.readouterr().err
    release.set()
    assert scorer.close() is True  # once it answered, every worker ended
