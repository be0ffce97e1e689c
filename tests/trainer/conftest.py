"""Trainer test helpers: the tiny training config (small, fast) on the session's tiny SD3 model."""

from __future__ import annotations

import pytest


@pytest.fixture
def make_cfg(tiny_sd3_path, tmp_path):
    """make_cfg(*overrides, output=name) -> a FlowRLConfig of a very small tiny run."""
    from flowrl.trainer.cli import load_train_config

    def build(*overrides, output: str = "run"):
        return load_train_config(
            None,
            [
                f"model.path={tiny_sd3_path}",
                f"trainer.output_dir={tmp_path / output}",
                "logging.tensorboard=false",
                "logging.progress_bar=false",
                "trainer.val_every=0",
                "trainer.save_every=0",
                *overrides,
            ],
        )

    return build


@pytest.fixture
def take_rollout():
    """take_rollout(trainer, overrides=None) -> (tensors, specs): one rollout batch of the trainer's
    next step as update() receives it; overrides: per-prompt `sampling_overrides` (a list, one
    dict or None per prompt, repeated over its group)."""
    from flowrl.engine.output import TransitionSpec
    from flowrl.rollout.batch import RolloutBatch

    def take(trainer, overrides=None):
        rows = trainer.prompts.next_rows()
        for i, row in enumerate(rows):
            row["uid"] = f"u{i}"
            if overrides is not None and overrides[i]:
                row["sampling_overrides"] = dict(overrides[i])
        batch = RolloutBatch.from_rows(rows).repeat(trainer.cfg.rollout.n)
        out = trainer.agent_loop.generate_sequences(batch)
        tensors = {k: v for k, v in out.batch.items() if k != "images"}
        return tensors, TransitionSpec.from_columns(out.non_tensor_batch)

    return take
