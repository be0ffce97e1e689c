"""Trainer test helpers: the tiny training config (small, fast) on the session's tiny SD3 model."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_run_config(tiny_sd3_path):
    """tiny_run_config(output_dir, *overrides) -> a FlowRLConfig of a very small run of the tiny
    SD3 model (no tensorboard, bar, validation or checkpoints unless `overrides` ask for them);
    for fixtures of any scope."""
    from flowrl.trainer.cli import load_train_config

    def build(output_dir, *overrides):
        return load_train_config(
            None,
            [
                f"model.path={tiny_sd3_path}",
                f"trainer.output_dir={output_dir}",
                "logging.tensorboard=false",
                "logging.progress_bar=false",
                "trainer.val_every=0",
                "trainer.save_every=0",
                *overrides,
            ],
        )

    return build


@pytest.fixture
def make_cfg(tiny_run_config, tmp_path):
    """make_cfg(*overrides, output=name) -> a FlowRLConfig of a very small tiny run."""

    def build(*overrides, output: str = "run"):
        return tiny_run_config(tmp_path / output, *overrides)

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


def train_tiny_lora_run(model_path, out, *overrides):
    """Train a 2-step LoRA run of the tiny SD3 model at `out` (checkpoints at steps 1 and 2,
    validation at steps 0 and 2); returns the run with the validation images it produced, by
    step: what flowrl eval and flowrl generate must reproduce."""
    from types import SimpleNamespace

    from flowrl.trainer.cli import load_train_config
    from flowrl.trainer.trainer import FlowGRPOTrainer

    cfg = load_train_config(
        None,
        [
            f"model.path={model_path}",
            f"trainer.output_dir={out}",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
            "trainer.total_steps=2",
            "trainer.val_every=2",
            "trainer.save_every=1",
            "trainer.lora.enabled=true",
            "trainer.prompts_per_step=2",
            "trainer.num_val_images=3",
            "rollout.n=4",
            *overrides,
        ],
    )
    trainer = FlowGRPOTrainer(cfg)
    validation_images = {}
    generate_sequences = trainer.agent_loop.generate_sequences

    def recording(batch, validation=False, **kwargs):
        result = generate_sequences(batch, validation=validation, **kwargs)
        if validation:
            validation_images[trainer.step] = result.batch["images"].clone()
        return result

    trainer.agent_loop.generate_sequences = recording
    with trainer:
        trainer.fit()
    prompts = [row["raw_prompt"] for row in trainer.val_rows]
    return SimpleNamespace(dir=out, model=model_path, validation_images=validation_images, val_prompts=prompts)


@pytest.fixture(scope="session")
def tiny_lora_run(tiny_sd3_path, tmp_path_factory):
    """A finished tiny LoRA run on CPU (train_tiny_lora_run)."""
    return train_tiny_lora_run(tiny_sd3_path, tmp_path_factory.mktemp("tiny_lora_run"))


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any attempt to load a model fails the test: the error must come first."""
    from flowrl.engine.engine import DiffusionEngine

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(DiffusionEngine, "from_pretrained", classmethod(lambda cls, *a, **k: refuse()))
