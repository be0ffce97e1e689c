"""The loop of a training run: steps until trainer.total_steps (or trainer.epochs), with validation,
metrics lines and checkpoints at their cadence, the progress bar, warnings about a run that trains
on nothing (and its stop after trainer.max_steps_without_trained_rows such steps in a row), and
clean stops on SIGINT / SIGTERM.

`fit(trainer)` drives a trainer (flowrl.trainer.trainer.Trainer) through the few members it names:
`train_step()`, `validate()`, `save()`, `log(step, metrics)`, `summary()`, `close(...)`,
`data_state(saved)`, `step`, `cfg`, `world`, `plan`, `prompts`, `agent_loop`, `rollouts`, `reward`,
`output_dir`, and the `progress` and `signals` it installs for the run. It knows nothing of what a
step computes.

Stops (flowrl.run.interrupts): a step whose update has not begun is dropped and rewound, one whose
update has begun finishes; the last completed step is saved when no checkpoint holds it yet; the
engine and reward threads are joined; then TrainingInterrupted says which checkpoint a resume
starts from. A run stopped before any step completed removes what it wrote, so the same command
starts over.
"""

from __future__ import annotations

from flowrl.console import note
from flowrl.run import checkpoint, resume
from flowrl.run.health import NoTrainingWatch, ZeroSpreadWatch
from flowrl.run.interrupts import PhaseAborted, StepRewind, StopSignals, TrainingInterrupted
from flowrl.run.progress import NO_PROGRESS, StepProgress


def fit(trainer) -> dict:
    """Train until trainer.total_steps (or trainer.epochs) and return a summary (module docstring)."""
    tcfg = trainer.cfg.trainer
    if trainer.plan.finished:
        trainer.close(shutdown_engine=False)
        if trainer.world.is_main:
            print(trainer.plan.finished, flush=True)
        return {"steps": trainer.step, "steps_trained": 0, "nothing_to_do": trainer.plan.finished}
    start_step = trainer.step
    trainer.progress = StepProgress(
        tcfg.total_steps,
        trainer.step,
        disable=not (trainer.cfg.logging.progress_bar and trainer.world.is_main),
        is_compiling=trainer.cfg.engine.compile,
    )
    trainer.signals = StopSignals()
    zero_spread = ZeroSpreadWatch(trainer.reward.name, trainer.cfg.rollout.n, write=note)
    # Every rank counts (the metrics are the same on each), so all stop together; rank 0 writes.
    no_training = NoTrainingWatch(
        trainer.reward.name, tcfg.max_steps_without_trained_rows, write=note if trainer.world.is_main else _silent
    )
    last_saved_step = trainer.step  # a resumed run's checkpoint holds this step; 0: nothing saved
    rewind: StepRewind | None = None
    interrupted: TrainingInterrupted | None = None
    is_clean_exit = False
    try:
        with trainer.signals:
            try:
                if tcfg.val_every and trainer.step == 0:
                    trainer.log(0, trainer.validate())
                while trainer.step < tcfg.total_steps:
                    if tcfg.epochs is not None and trainer.data_state(saved=True)["data"]["epoch"] >= tcfg.epochs:
                        break
                    rewind = StepRewind.capture(trainer.prompts, trainer.agent_loop)
                    metrics = trainer.train_step()
                    rewind = None  # the step completed: nothing to undo
                    if trainer.world.is_main:
                        zero_spread.observe(trainer.step, metrics)
                    try:
                        if tcfg.val_every and trainer.step % tcfg.val_every == 0:
                            metrics.update(trainer.validate())
                    finally:  # an aborted validation still logs the completed step
                        if trainer.step % tcfg.log_every == 0 or trainer.step == tcfg.total_steps:
                            trainer.log(trainer.step, metrics)
                    if tcfg.save_every and trainer.step % tcfg.save_every == 0:
                        trainer.save()
                        last_saved_step = trainer.step
                    no_training.observe(trainer.step, metrics)  # TrainingStalled past its bound
                    trainer.progress.step_done(metrics)
                    _check_stop(trainer)
                trainer.rollouts.finish()  # the last update goes live on rollout servers
            except PhaseAborted:
                if rewind is not None:
                    rewind.restore()
            if trainer.signals.requested is not None:
                interrupted = _stop_after_signal(trainer, last_saved_step)
        is_clean_exit = interrupted is None
    finally:
        trainer.progress.close()
        # Interrupted or failed: no engine thread may outlive the run, and a batch still being
        # scored (a hung remote reward) does not hold the exit.
        trainer.close(drop_pending=not is_clean_exit, shutdown_engine=not is_clean_exit)
        trainer.progress, trainer.signals = NO_PROGRESS, None
    if zero_spread.summary():
        note(zero_spread.summary())
    if interrupted is not None:
        if interrupted.checkpoint is None and trainer.world.is_main:
            # No step of this run was kept: remove what it wrote (step-0 validation, logs), so the
            # folder is as plan_run found it and the same command starts over.
            resume.delete_run_files(trainer.output_dir, resume.run_files(trainer.output_dir), "no step completed")
        raise interrupted
    return {**trainer.summary(), "steps_trained": trainer.step - start_step}


def _silent(*args, **kwargs) -> None:
    pass


def _check_stop(trainer) -> None:
    """The safe point after a step: stop when a signal was received (over several ranks: by any
    rank, agreed through a collective, so that every rank stops after the same step)."""
    signals = trainer.signals
    if trainer.world.is_distributed:
        requested = signals.requested or 0
        agreed = int(trainer.world.max([float(requested)])[0])
        if agreed and signals.requested is None:
            signals.requested = agreed
    signals.check()


def _stop_after_signal(trainer, last_saved_step: int) -> TrainingInterrupted:
    """Save the last completed step if no checkpoint holds it (every rank: the save is a
    collective when sharded); say where a resume starts."""
    saved_now = trainer.step > last_saved_step
    resume_from = trainer.save() if saved_now else checkpoint.latest_checkpoint(trainer.output_dir)
    return TrainingInterrupted(trainer.signals.requested, trainer.step, resume_from, saved_now)
