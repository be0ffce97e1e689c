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
import sys

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


def load_train_config(config_path: str | None, overrides: list[str]):
    """The config of a `flowrl train` invocation (embedded tiny run when config_path is None)."""
    from flowrl.config import load_config

    layers = list(overrides) if config_path is not None else [*TINY_RUN_OVERRIDES, *overrides]
    return load_config(config_path, layers)


def run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        cfg = load_train_config(args.config, list(args.overrides))
        from flowrl.distributed.launch import launch_training

        return launch_training(cfg, functools.partial(train_rank, embedded=args.config is None))
    except ValueError as error:  # the config, or the world it runs in: the same on every rank
        if os.environ.get("RANK", "0") == "0":
            print(f"flowrl train: error: {error}", file=sys.stderr)
        return 2


def train_rank(cfg, world, embedded: bool = False) -> int:
    """One rank of `flowrl train` (the only one in a one-process run): plan the run (on rank 0,
    before the model loads: a finished run loads nothing), build the trainer, fit; rank 0 prints.
    Returns the exit code."""
    from flowrl.config import config_to_dict
    from flowrl.trainer.resume import plan_run

    say = print if world.is_main else (lambda *args, **kwargs: None)
    try:
        plan = world.on_main(lambda: plan_run(cfg, config_to_dict(cfg)))
        if plan.finished:
            say(f"flowrl train: {plan.finished}")
            return 0
        from flowrl.trainer.trainer import FlowGRPOTrainer

        trainer = FlowGRPOTrainer(cfg, plan=plan, world=world)
    except ValueError as error:
        where = f" (rank {world.rank})" if world.is_distributed else ""
        print(f"flowrl train{where}: error: {error}", file=sys.stderr)
        return 2
    if embedded:
        say(
            f"flowrl train: embedded tiny CPU run ({cfg.trainer.total_steps} steps, reward {cfg.reward.name}); "
            f"outputs in {cfg.trainer.output_dir}"
        )
    summary = trainer.fit()
    if not world.is_main:
        return 0
    trained, reached = summary["steps_trained"], summary["steps"]
    print(
        f"steps trained: {trained}"
        + (f" (resumed at step {reached - trained}, now at {reached})" if trained != reached else "")
    )
    print(f"mean reward, first 5 steps: {summary['first5_reward_mean']:.5g}")
    print(f"mean reward, last 5 steps:  {summary['last5_reward_mean']:.5g}")
    print(
        f"metrics: {summary['metrics']}; reward curve: {summary['reward_curve']}; weights: {summary['final_weights']}"
    )
    return 0
