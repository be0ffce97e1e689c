"""A run's state on disk: a trainer's checkpoint written and restored, and its final weights exported.

`save(trainer)` writes the step's checkpoint (flowrl.run.checkpoint: weights, optimizer, EMA, data
position, policy version, RNG); `restore(trainer, path)` continues from one, this config's
optimizer hyper-parameters replacing the saved ones (flowrl.run.resume's RESUME_RULES let them
change); `save_final(trainer)` writes `<output_dir>/final/`, the trained model as a pipeline folder
the family's diffusers pipeline loads (flowrl.run.export), and with trainer.ema the average's
weights under `final/ema/`.

Like flowrl.run.loop it reaches the trainer through a few members (`adapter`, `algorithm`
(`optimizer`, `num_optimizer_steps`), `ema`, `parallel`, `world`, `param_names`, `prompts`,
`agent_loop`, `engine`, `config_dict`, `output_dir`, `step`, `policy_version`,
`data_state(saved)`); it knows nothing of what a step computes. Over several ranks every rank calls
these (sharded weights are gathered); rank 0 writes the shared files.
"""

from __future__ import annotations

from pathlib import Path

from flowrl.models.lora import has_lora, save_lora_for_diffusers
from flowrl.run import checkpoint
from flowrl.run.export import export_pipeline, save_transformer


def save(trainer) -> Path:
    """The trainer's checkpoint at its current step (module docstring); returns its folder."""
    state = {
        "policy_version": trainer.policy_version,
        **trainer.data_state(saved=True),
        "num_optimizer_steps": trainer.algorithm.num_optimizer_steps,
    }
    return checkpoint.save_checkpoint(
        trainer.output_dir,
        trainer.step,
        trainer.adapter,
        trainer.algorithm.optimizer,
        trainer.param_names,
        state,
        trainer.config_dict,
        ema=trainer.ema,
        parallel=trainer.parallel,
        averages=trainer.algorithm.averages(),
    )


def restore(trainer, path: Path, say=print) -> None:
    """Continue from the checkpoint at `path` (verified by flowrl.run.resume.plan_run)."""
    optimizer = trainer.algorithm.optimizer
    restored = checkpoint.load_checkpoint(
        path,
        trainer.adapter.transformer,
        optimizer,
        trainer.param_names,
        verify=False,
        ema=trainer.ema,
        parallel=trainer.parallel,
        averages=trainer.algorithm.averages(),
    )
    tcfg = trainer.cfg.trainer
    for group in optimizer.param_groups:
        group.update(lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay)
    if trainer.ema is not None and not restored["ema_restored"]:
        trainer.ema.reset()  # from the restored weights
        say(f"{path} holds no EMA weights: trainer.ema starts from the checkpoint's weights")
    for name, average in trainer.algorithm.averages().items():
        if name not in restored["restored"]:
            average.reset()  # from the restored weights
            say(
                f"{path} holds no {name} weights: {trainer.algorithm.name}'s {name} starts from the checkpoint's weights"
            )
    state = restored["trainer"]
    trainer.step = restored["step"]
    trainer.prompts.load_state_dict(state["data"])
    trainer.agent_loop.rows_generated = state["rows_generated"]
    trainer.algorithm.num_optimizer_steps = state["num_optimizer_steps"]
    trainer.policy_version = state["policy_version"]
    trainer.engine.set_policy_version(trainer.policy_version)
    say(f"resumed from {path} at step {trainer.step}")


def save_final(trainer) -> Path:
    """`<output_dir>/final/` (module docstring); returns the pipeline folder."""
    final = trainer.output_dir / "final"
    state = trainer.parallel.gathered_state_dict(trainer.adapter.transformer)
    if trainer.world.is_main:
        export_pipeline(trainer.adapter, final, trainer.step, trainer.config_dict, transformer_state=state)
    trainer.world.barrier()
    if trainer.ema is not None:
        with trainer.ema.applied():
            _save_weights(trainer, final / "ema")
    return final


def _save_weights(trainer, folder: Path) -> Path:
    """The trained weights alone: a diffusers LoRA folder, or the transformer (gathered from every
    rank when sharded), written by rank 0."""
    transformer = trainer.adapter.transformer
    lora = has_lora(transformer)
    state = None if lora else trainer.parallel.gathered_state_dict(transformer)
    if trainer.world.is_main:  # LoRA weights are the same on every rank
        if lora:
            save_lora_for_diffusers(trainer.adapter, folder / "lora")
        else:
            save_transformer(transformer, folder / "transformer", state)
    trainer.world.barrier()
    return folder / ("lora" if lora else "transformer")
