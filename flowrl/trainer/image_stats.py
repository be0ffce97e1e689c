"""`image_contrast`: a weight-free image-statistic reward for the embedded tiny CPU run.

Score = standard deviation of all pixel values of the image, in [0, 1] units (higher = more
contrast). Why this one: the tiny random VAE barely reacts to the mean of its latents (its group
norms remove it), so brightness- or JPEG-based rewards give the tiny model almost no signal it
can follow in a few minutes, while pixel contrast rises clearly and far above a control run with
shuffled advantages (see docs/training.md). On real models any registered reward works.

It is registered into the reward registry on first use (`ensure_registered`) under the name
"image_contrast" unless the rewards package already provides that name.
"""

from __future__ import annotations

import numpy as np

from flowrl.rewards.base import Reward, register_reward, registered_rewards

NAME = "image_contrast"


class ImageContrast(Reward):
    name = NAME

    def score_batch(self, images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        pixels = images.reshape(images.shape[0], -1).astype(np.float64) / 255.0
        return pixels.std(axis=1)


def ensure_registered() -> None:
    if NAME not in registered_rewards():
        register_reward(NAME, ImageContrast)
