"""A reward that scores rows one by one (OCR) has each request's rows scored on several threads at
once (`ServerLimits.scoring_threads`), put back in row order, its failures naming the request's
row; a batched reward still gets the whole request in one call."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from flowrl.rewards import Reward, RewardError, RowwiseReward
from flowrl.rewards.http_client import HttpReward
from flowrl.server.http import serve_in_background
from flowrl.server.reward_app import create_reward_app, score_in_chunks
from flowrl.server.score_request import ServerLimits


class MeetingRows(RowwiseReward):
    """metadata["value"], after waiting for `parties` rows to be scored at the same time (a
    serial pass breaks the barrier and fails); fails on rows with metadata["fail"]."""

    name = "meeting_rows"

    def __init__(self, parties: int):
        self.barrier = threading.Barrier(parties, timeout=10)
        self.threads: set[int] = set()

    def score_row(self, image_hwc, prompt, metadata):
        self.threads.add(threading.get_ident())
        self.barrier.wait()
        if metadata.get("fail"):
            raise RuntimeError("asked to fail")
        return float(metadata["value"])


class BatchCalls(Reward):
    """A batched reward that records the size of every call."""

    name = "batch_calls"

    def __init__(self):
        self.calls: list[int] = []

    def score_batch(self, images, prompts, metadata):
        self.calls.append(len(prompts))
        return np.array([float(m["value"]) for m in metadata])


def _batch(num_rows: int, **row_overrides):
    images = np.random.default_rng(0).integers(0, 256, (num_rows, 3, 8, 8), dtype=np.uint8)
    metadata = [{"value": float(i), **row_overrides.get(str(i), {})} for i in range(num_rows)]
    return images, [""] * num_rows, metadata


def test_a_requests_rows_are_scored_on_several_threads_in_row_order():
    reward = MeetingRows(parties=2)
    with serve_in_background(create_reward_app(reward, ServerLimits(scoring_threads=2))) as base:
        images, prompts, metadata = _batch(6)
        np.testing.assert_array_equal(HttpReward(base)(images, prompts, metadata), np.arange(6.0))
    assert len(reward.threads) == 2


def test_a_failure_names_the_first_failing_row_of_the_request():
    reward = MeetingRows(parties=1)
    with serve_in_background(create_reward_app(reward, ServerLimits(scoring_threads=3))) as base:
        images, prompts, metadata = _batch(7, **{"5": {"fail": True}, "2": {"fail": True}})
        with pytest.raises(RewardError) as caught:
            HttpReward(base)(images, prompts, metadata)
    assert caught.value.row_index == 2 and "asked to fail" in str(caught.value)


def test_chunks_cover_the_batch_in_order_and_renumber_failures():
    reward = MeetingRows(parties=1)
    with ThreadPoolExecutor(4) as pool:
        for rows, chunks in ((5, 2), (3, 4), (1, 3), (8, 8)):
            images, prompts, metadata = _batch(rows)
            total, components = score_in_chunks(reward, images, prompts, metadata, pool, chunks)
            np.testing.assert_array_equal(total, np.arange(float(rows)))
            np.testing.assert_array_equal(components["meeting_rows"], np.arange(float(rows)))
        images, prompts, metadata = _batch(5, **{"4": {"fail": True}})
        with pytest.raises(RewardError) as caught:
            score_in_chunks(reward, images, prompts, metadata, pool, 2)
    assert caught.value.row_index == 4


def test_a_batched_reward_gets_the_whole_request_in_one_call():
    reward = BatchCalls()
    with serve_in_background(create_reward_app(reward, ServerLimits(scoring_threads=4))) as base:
        images, prompts, metadata = _batch(6)
        np.testing.assert_array_equal(HttpReward(base)(images, prompts, metadata), np.arange(6.0))
    assert reward.calls == [6]
