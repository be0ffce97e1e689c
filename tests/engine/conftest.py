"""Engine fixtures: one engine per tiny model family, shared by the engine tests."""

from __future__ import annotations

import pytest

from flowrl.engine import DiffusionEngine, SamplingParams


@pytest.fixture(scope="session")
def sd3_engine(tiny_sd3_path):
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_rows=32, decode_chunk_size=3)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def qwen_engine(tiny_qwen_path):
    engine = DiffusionEngine.from_pretrained(tiny_qwen_path, max_batch_rows=32, decode_chunk_size=3)
    yield engine
    engine.shutdown()


@pytest.fixture(params=["sd3", "qwen_image"])
def engine(request):
    name = {"sd3": "sd3_engine", "qwen_image": "qwen_engine"}[request.param]
    return request.getfixturevalue(name)


@pytest.fixture
def params():
    return SamplingParams(height=64, width=64, num_inference_steps=6, noise_level=0.7, seed=11)
