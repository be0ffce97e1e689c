"""Weight-free pixel-contrast rewards (used by the embedded tiny CPU run).

`image_flatness` = -(standard deviation of all pixel values), in [0, 1] units: flatter, lower-
contrast (and so more JPEG-compressible) images score higher. `image_contrast` is its opposite.

Why these: the tiny random VAE barely reacts to the mean of its latents (its group norms remove
it), so brightness- or JPEG-size rewards give the tiny model almost no signal it can follow in a
few minutes, while pixel contrast responds. The tiny run uses `image_flatness` on purpose: random
weight drift (a control run with shuffled advantages) RAISES contrast, so a rising flatness
reward cannot come from drift, only from learning (see docs/training.md). On real models any
registered reward works.
"""

from __future__ import annotations

import numpy as np

from flowrl.rewards.base import Reward


class ImageContrast(Reward):
    name = "image_contrast"
    sign = 1.0

    def score_batch(self, images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        pixels = images.reshape(images.shape[0], -1).astype(np.float64) / 255.0
        return self.sign * pixels.std(axis=1)


class ImageFlatness(ImageContrast):
    name = "image_flatness"
    sign = -1.0
