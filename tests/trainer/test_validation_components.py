"""Validation reports each component of a reward that has several (the toy world's partial and
strict scores, a weighted sum's parts) beside the total; a reward of one component adds nothing."""

from __future__ import annotations

import numpy as np

from flowrl.trainer.trainer import Trainer


def test_validation_logs_every_component_mean(make_cfg):
    cfg = make_cfg(
        "trainer.total_steps=1",
        "trainer.num_val_images=3",
        "reward.name=null",
        "reward.components=[{name: image_flatness, weight: 1.0}, {name: image_contrast, weight: 0.5}]",
    )
    with Trainer(cfg) as trainer:
        metrics = trainer.validate()
    flat, contrast = metrics["val/reward/image_flatness/mean"], metrics["val/reward/image_contrast/mean"]
    assert np.isclose(metrics["val/reward_mean"], flat + 0.5 * contrast)


def test_single_reward_adds_no_component(make_cfg):
    with Trainer(make_cfg("trainer.num_val_images=2")) as trainer:
        metrics = trainer.validate()
    assert not any(key.startswith("val/reward/") for key in metrics) and "val/reward_mean" in metrics
