"""Synchronous against one-step-ahead asynchronous decoupled training: what async costs in learning
and saves in time.

Trains the same run three ways and prints, per mode, the mean reward of the first and last five
steps, its gain, and the median seconds per step after the first (and of it, the seconds the step
waited for its rollout, and the seconds the rollout itself took); medians, so that a few steps
slowed by other work on the machine do not decide the comparison:
- colocated: the trainer's own engine (the reference);
- sync: rollouts on `--replicas` started `flowrl serve` replicas, weights pushed after each update;
- async: the same replicas with trainer.async_rollout=true (step k+1 rolls out while step k trains).

    python benchmarks/async_rollout.py --steps 30                 # the embedded tiny CPU run, shortened
    python benchmarks/async_rollout.py --steps 30 --replicas 1 --device cuda:0 --replica-devices cuda:1 \
        rollout.sampling.height=256 rollout.sampling.width=256

Extra KEY=VALUE arguments override the embedded tiny run's config (flowrl.run.config).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

MODES = ("colocated", "sync", "async")


def run_mode(mode: str, args, out_dir: str) -> dict:
    from flowrl.run.config import load_train_config
    from flowrl.trainer.trainer import Trainer

    overrides = [
        f"trainer.output_dir={out_dir}/{mode}",
        f"trainer.total_steps={args.steps}",
        f"model.device={args.device}",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        # Async training needs the recomputed denominator (decoupled PPO); every mode takes it, so
        # the modes differ only in where and when they roll out.
        "algorithm.old_log_prob=recompute",
        *args.overrides,
    ]
    if mode != "colocated":
        overrides.append(f"rollout.num_replicas={args.replicas}")
        if args.replica_devices:
            overrides.append(f"rollout.replica_devices=[{args.replica_devices}]")
    if mode == "async":
        overrides.append("trainer.async_rollout=true")
    trainer = Trainer(load_train_config(None, overrides))
    steps = []
    try:
        for _ in range(args.steps):
            steps.append(trainer.train_step())
        trainer.rollouts.finish()
    finally:
        trainer.rollouts.close()
        trainer.rollout_backend.close()
        trainer.scorer.close()
        trainer.engine.shutdown()
    rewards = [m["reward/mean"] for m in steps]
    timed = steps[1:] or steps  # the first step also pays for warm-up
    return {
        "first5": float(np.mean(rewards[:5])),
        "last5": float(np.mean(rewards[-5:])),
        "step_s": float(np.median([m["timing/step_s"] for m in timed])),
        "wait_s": float(np.median([m["timing/rollout_wait_s"] for m in timed])),
        "rollout_s": float(np.median([m["timing/rollout_s"] for m in timed])),
        "staleness": float(np.mean([m["rollout/staleness_mean"] for m in steps])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="the trainer's device")
    parser.add_argument("--replica-devices", default="", help="comma-separated, one per replica (default: --device)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {}
    with tempfile.TemporaryDirectory(prefix="flowrl-async-") as out_dir:
        for mode in args.modes.split(","):
            results[mode] = run_mode(mode, args, out_dir)
            r = results[mode]
            print(
                f"{mode:<10} reward first5 {r['first5']:.4f}  last5 {r['last5']:.4f}  gain {r['last5'] - r['first5']:+.4f}  "
                f"step {r['step_s']:.2f} s (rollout wait {r['wait_s']:.2f} s of a {r['rollout_s']:.2f} s rollout)  "
                f"mean staleness {r['staleness']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
