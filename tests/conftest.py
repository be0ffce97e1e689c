"""Shared pytest setup: offline hub, session-wide tiny checkpoints, and the `gpu` marker skip."""

from __future__ import annotations

import os

# A hub id that slips into a test must fail at once instead of hanging on DNS retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory):
    """A tiny random SD3 checkpoint folder (seed 0), built once per test session."""
    from flowrl.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("sd3", tmp_path_factory.mktemp("tiny_sd3"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_path(tmp_path_factory):
    """A tiny random Qwen-Image checkpoint folder (seed 0), built once per test session."""
    from flowrl.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("qwen_image", tmp_path_factory.mktemp("tiny_qwen"), seed=0)


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory):
    """A tiny random FLUX.1 [dev] checkpoint folder (seed 0), built once per test session."""
    from flowrl.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("flux", tmp_path_factory.mktemp("tiny_flux"), seed=0)


@pytest.fixture(scope="session")
def tiny_z_image_path(tmp_path_factory):
    """A tiny random Z-Image checkpoint folder (seed 0), built once per test session."""
    from flowrl.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("z_image", tmp_path_factory.mktemp("tiny_z_image"), seed=0)


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` when no CUDA device is present (no command-line flag needed)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
