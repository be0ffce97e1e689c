"""`flowrl train`: FlowGRPO training from a YAML recipe plus dotted key=value overrides.

    flowrl train                                   # the embedded tiny CPU run (a few minutes)
    flowrl train --config recipes/sd35_medium_ocr_lora.yaml model.path=/path/to/sd35m
    flowrl train --config F trainer.total_steps=5 rollout.n=8
    torchrun --nproc-per-node 4 -m flowrl train --config F        # 4 data-parallel ranks
    flowrl train --config F distributed.launcher=ray distributed.num_workers=4

Without --config the embedded tiny run is used: the tiny random SD3 model (built offline on
first use), full fine-tuning on CPU with the weight-free `image_flatness` reward (flatter,
lower-contrast images score higher); it prints the mean reward of the first and last 5 steps. recipes/tiny_cpu.yaml spells out the same settings.
Over several processes (docs/distributed.md) every rank runs `train_rank`; rank 0 prints.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=None, metavar="F", help="YAML recipe (see recipes/); omitted: the embedded tiny CPU run"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides applied last, e.g. rollout.n=16 trainer.lr=3e-4",
    )


def run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from flowrl.run.config import load_train_config

        cfg = load_train_config(args.config, list(args.overrides))
        from flowrl.distributed.launch import launch_training

        return launch_training(cfg, functools.partial(train_rank, args=args))
    except ValueError as error:  # the config, or the world it runs in: the same on every rank
        if os.environ.get("RANK", "0") == "0":
            print(f"flowrl train: error: {error}", file=sys.stderr)
        return 2


def train_rank(cfg, world, args: argparse.Namespace) -> int:
    """One rank of `flowrl train` (the only one in a one-process run): plan the run (on rank 0,
    before the model loads: a finished run loads nothing), build the trainer, fit; rank 0 prints.
    A stop signal during start-up abandons it; during training it stops the run cleanly and rank 0
    prints how to resume (flowrl.run.interrupts). Returns the exit code."""
    from flowrl.config import config_to_dict
    from flowrl.rewards.base import RewardError
    from flowrl.run.health import TrainingStalled
    from flowrl.run.interrupts import PhaseAborted, StopSignals, TrainingInterrupted
    from flowrl.run.resume import plan_run

    say = print if world.is_main else (lambda *args, **kwargs: None)
    # Until training starts, a stop signal simply abandons the start-up: nothing is written yet
    # that a resume would need (the tiny model is written to a staging folder and moved in place).
    signals = StopSignals()
    try:
        with signals, signals.abortable():
            plan = world.on_main(lambda: plan_run(cfg, config_to_dict(cfg)))
            if plan.finished:
                say(f"flowrl train: {plan.finished}")
                return 0
            from flowrl.trainer.trainer import Trainer

            trainer = Trainer(cfg, plan=plan, world=world)
    except ValueError as error:
        where = f" (rank {world.rank})" if world.is_distributed else ""
        print(f"flowrl train{where}: error: {error}", file=sys.stderr)
        return 2
    except (PhaseAborted, KeyboardInterrupt):
        say("flowrl train: interrupted before training started; run the same command to start again", file=sys.stderr)
        return 128 + (signals.requested or signal.SIGINT)
    if args.config is None and cfg.model.path is None:  # the defaults' own model, not an override's
        say(
            f"flowrl train: embedded tiny CPU run ({cfg.trainer.total_steps} steps, reward {cfg.reward.name}); "
            f"outputs in {cfg.trainer.output_dir}"
        )
    try:
        summary = trainer.fit()
    except TrainingInterrupted as stop:
        world.barrier()  # every rank has stopped and saved: the ranks exit together
        say(resume_hint(stop, args, cfg.trainer), file=sys.stderr)
        return stop.exit_code
    except TrainingStalled as stalled:  # every rank stops after the same step
        say(f"flowrl train: error: {stalled}", file=sys.stderr)
        return 2
    except RewardError as error:  # a required reward failed: its name, row and cause, not a traceback
        where = f" (rank {world.rank})" if world.is_distributed else ""
        print(
            f"flowrl train{where}: error: {error}; fix the reward (or mark it optional: true in reward.components), "
            "then run the same command: it resumes from the latest checkpoint",
            file=sys.stderr,
        )
        return 2
    finally:
        trainer.engine.shutdown()
    if not world.is_main:
        return 0
    trained, reached = summary["steps_trained"], summary["steps"]
    print(
        f"steps trained: {trained}"
        + (f" (resumed at step {reached - trained}, now at {reached})" if trained != reached else "")
    )
    print(f"mean reward, first 5 steps: {summary['first5_reward_mean']:.5g}")
    print(f"mean reward, last 5 steps:  {summary['last5_reward_mean']:.5g}")
    for point in summary.get("validation", []):  # the first and the last: before and after training
        shown = ", ".join(f"{_short(key)} {value:.3f}" for key, value in point.items() if key != "step")
        print(f"validation at step {point['step']}: {shown}")
    print(
        f"metrics: {summary['metrics']}; reward curve: {summary['reward_curve']}; weights: {summary['final_weights']}"
    )
    if summary.get("random_weights"):
        print(
            f"WARNING: trained RANDOM weights (model.path=random:{summary['random_weights']}): a speed run, not a model"
        )
    return 0


def resume_hint(stop, args: argparse.Namespace, tcfg) -> str:
    """The one line printed after an interrupt: where the run stopped and the command that resumes it
    (under torchrun, the same torchrun launch)."""
    import os

    from flowrl.distributed.launch import torchrun_command_prefix

    if stop.checkpoint is None:
        return (
            f"flowrl train: stopped before a step completed; nothing to resume (the files this run wrote were "
            f"removed from {tcfg.output_dir}, so the same command starts it again)"
        )
    # The same command resumes unless it names another checkpoint or deletes this run's files.
    extra = [] if tcfg.resume == "auto" else ["trainer.resume=auto"]
    extra += ["trainer.overwrite=false"] if tcfg.overwrite else []
    # A rank of torchrun's agent (which sets TORCHELASTIC_RUN_ID; Ray's workers do not): the same launch.
    launcher = torchrun_command_prefix() if "TORCHELASTIC_RUN_ID" in os.environ else None
    command = train_command(args, extra, launcher)
    saved = "saved at the interrupt" if stop.saved_now else "the latest checkpoint"
    return f"flowrl train: stopped after step {stop.step}; {stop.checkpoint} ({saved}); resume with: {command}"


def train_command(args: argparse.Namespace, extra: list[str] = (), launcher: list[str] | None = None) -> str:
    """The `flowrl train` command line of `args` (plus `extra` overrides), quoted for a POSIX shell;
    `launcher`: the words that run flowrl instead of `flowrl` (`torchrun ... -m flowrl`)."""
    import shlex

    words = [*(launcher or ["flowrl"]), "train"]
    if args.config is not None:
        words += ["--config", args.config]
    return shlex.join([*words, *args.overrides, *extra])


def _short(key: str) -> str:
    """val/reward_mean -> reward; val/reward/<component>/mean -> <component>."""
    return "reward" if key == "val/reward_mean" else key.removeprefix("val/reward/").removesuffix("/mean")
