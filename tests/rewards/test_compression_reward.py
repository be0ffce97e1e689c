"""JPEG compressibility: flat images beat noise; incompressibility is the exact reverse."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.rewards import build_reward


def _flat_and_noise(size: int = 64) -> np.ndarray:
    flat = np.full((3, size, size), 120, np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, (3, size, size), dtype=np.uint8)
    return np.stack([flat, noise])


def test_compressibility_orders_flat_above_noise_and_incompressibility_reverses():
    images = _flat_and_noise()
    compress = build_reward("jpeg_compressibility")(images, ["", ""], [{}, {}])
    incompress = build_reward("jpeg_incompressibility")(images, ["", ""], [{}, {}])
    assert compress[0] > compress[1]
    assert incompress[1] > incompress[0]
    np.testing.assert_array_equal(compress, -incompress)
    assert (incompress > 0).all()  # sizes in kB, never a silent 0


def test_torch_input_matches_numpy_and_quality_changes_size():
    images = _flat_and_noise()
    reward = build_reward({"name": "jpeg_incompressibility", "options": {"quality": 95}})
    np.testing.assert_array_equal(
        reward(torch.from_numpy(images), ["", ""], [{}, {}]), reward(images, ["", ""], [{}, {}])
    )
    low = build_reward({"name": "jpeg_incompressibility", "options": {"quality": 20}})(images, ["", ""], [{}, {}])
    assert low[1] < reward(images, ["", ""], [{}, {}])[1]


@pytest.mark.parametrize("quality", [0, 96, 90.5])
def test_quality_out_of_range_is_rejected(quality):
    with pytest.raises(ValueError, match="quality"):
        build_reward({"name": "jpeg_compressibility", "options": {"quality": quality}})
