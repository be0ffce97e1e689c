"""The tests' one small training config: a model folder trained into an output folder with no
tensorboard, progress bar, validation or checkpoints unless the overrides ask for them."""

from __future__ import annotations


def small_run_config(model_path, output_dir, *overrides):
    from flowrl.run.config import load_train_config

    quiet = ["logging.tensorboard=false", "logging.progress_bar=false", "trainer.val_every=0", "trainer.save_every=0"]
    return load_train_config(None, [f"model.path={model_path}", f"trainer.output_dir={output_dir}", *quiet, *overrides])
