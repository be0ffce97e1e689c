"""The config of a training run: a recipe plus `key=value` overrides, or, without a recipe, the
embedded main job (`flowrl train` with no arguments) on top of the config defaults.
"""

from __future__ import annotations

# The embedded tiny run on top of the config defaults (recipes/tiny_cpu.yaml says the same; a test
# keeps the two equal). Sized for a small CPU machine: a tiny model, 64x64 images, 60 short steps.
TINY_RUN_OVERRIDES = (
    "trainer.output_dir=outputs/tiny-run",
    "trainer.total_steps=60",
    "trainer.prompts_per_step=4",
    "trainer.micro_batch_size=16",
    "trainer.lr=0.02",
    "trainer.lora.enabled=false",
    "trainer.val_every=20",
    "trainer.save_every=20",
    "rollout.n=8",
    "reward.name=image_flatness",
)


def load_train_config(config_path: str | None, overrides: list[str]):
    """The config of a `flowrl train` invocation (embedded tiny run when config_path is None)."""
    from flowrl.config import load_config

    layers = list(overrides) if config_path is not None else [*TINY_RUN_OVERRIDES, *overrides]
    return load_config(config_path, layers)
