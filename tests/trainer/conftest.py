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
def no_model_loading(monkeypatch):
    """Any attempt to load a model fails the test: the error must come first."""
    from flowrl.engine.engine import DiffusionEngine

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(DiffusionEngine, "from_pretrained", classmethod(lambda cls, *a, **k: refuse()))
