"""Fixtures for reward tests: one shared OCR reward, text rendering, and fake rewards."""

from __future__ import annotations

import pytest

from flowrl.rewards import RowwiseReward, register_reward, unregister_reward


@pytest.fixture(scope="session")
def ocr_reward():
    """One OCR reward (and engine) for all tests: rapidocr init costs about 0.5 s."""
    from flowrl.rewards.ocr import OcrReward

    return OcrReward()


class MetadataValueReward(RowwiseReward):
    """Test reward: scale * metadata[key]; raises on rows with metadata["fail"] true."""

    name = "metadata_value"

    def __init__(self, key: str = "value", scale: float = 1.0):
        self.key, self.scale = key, scale

    def score_row(self, image_hwc, prompt, metadata):
        if metadata.get("fail"):
            raise RuntimeError("asked to fail")
        return self.scale * float(metadata[self.key])


@pytest.fixture
def fake_rewards():
    """Registers `metadata_value` for one test."""
    register_reward("metadata_value", MetadataValueReward, overwrite=True)
    yield MetadataValueReward
    unregister_reward("metadata_value")
