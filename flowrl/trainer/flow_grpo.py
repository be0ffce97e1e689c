"""FlowGRPO (arXiv 2505.05470; FLOWGRPO.md): SDE rollouts with per-step log-probs, group-relative
advantages, and the clipped PPO loss over the stored transitions.

- Rollouts: an SDE window (`rollout.sampling.sde_window_size`) drawn once per training step from
  (trainer.seed, step) and shared by every row, one per row from its seed, or moved by MixGRPO's
  progressive schedule (`rollout.sde_window_draw`); with `rollout.merge_lora` the rollout samples with the adapter merged
  into its weights (flowrl.accel.merged_lora).
- Advantages: (r - group mean) / (std + eps), clamped, or with several rewards each normalised
  before their weighted sum (`algorithm.advantage_aggregation=gdpo`; flowrl.trainer.advantages); rows with no
  valid reward are not trained, nor, with `algorithm.zero_std_policy=drop`, groups without spread;
  `algorithm.shuffle_advantages` permutes them over the trained rows (the control run).
- Update: flowrl.trainer.update (the old log-prob phase, then the optimizer steps); rows drawn by
  older weights (trainer.async_rollout) train with decoupled PPO.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from flowrl import sampler
from flowrl.engine.output import TransitionSpec
from flowrl.run.step_flops import UnitFlops, trained_steps_per_sample
from flowrl.trainer.advantages import gdpo_weights, step_advantages
from flowrl.trainer.algorithm import Algorithm, AlgorithmSetup, StepWeights
from flowrl.trainer.merged_rollout import MergedRollout
from flowrl.trainer.plan import seeded_generator
from flowrl.trainer.update import PolicyUpdater


def update_inputs(rollout) -> tuple[dict, list[TransitionSpec]]:
    """A rollout batch as the updater takes it: its stored tensors (the images left out) and the
    settings each row was drawn with."""
    tensors = {k: v for k, v in rollout.batch.items() if k != "images"}
    return tensors, TransitionSpec.from_columns(rollout.non_tensor_batch)


class FlowGRPO(Algorithm):
    name = "flow_grpo"

    def __init__(self, setup: AlgorithmSetup):
        super().__init__(setup)
        cfg = setup.cfg
        self.algorithm, self.rollout, self.seed = cfg.algorithm, cfg.rollout, cfg.trainer.seed
        self.compiled = cfg.engine.compile
        self.updater = PolicyUpdater(
            setup.adapter, setup.params, cfg.algorithm, cfg.trainer, ema=setup.ema, parallel=setup.parallel
        )
        self.autocast_dtype = self.updater.autocast_dtype
        self.merged = MergedRollout(setup)  # rollout.merge_lora
        self.component_weights = gdpo_weights(cfg)  # algorithm.advantage_aggregation=gdpo

    @property
    def optimizer(self):
        return self.updater.optimizer

    @property
    def num_optimizer_steps(self) -> int:
        return self.updater.num_optimizer_steps

    @num_optimizer_steps.setter
    def num_optimizer_steps(self, value: int) -> None:
        self.updater.num_optimizer_steps = value

    # -- rollouts --------------------------------------------------------------------------------
    def sampling_overrides(self, step: int) -> dict | None:
        """The step's SDE window: explicit, one drawn from (trainer.seed, step) for every row
        (rollout.sde_window_draw=step), MixGRPO's progressive one for every row (`progressive`), or
        left to the engine, which draws each row's from its own seed (`row`) or uses its default
        (no window size)."""
        s, draw = self.rollout.sampling, self.rollout.sde_window_draw
        if s.sde_window is not None or s.sde_window_size is None or draw == "row":
            return None if s.sde_window is None else {"sde_window": tuple(s.sde_window)}
        if draw == "progressive":  # steps count from 1: the first sde_window_shift_every share position 0
            position = (step - 1) // self.rollout.sde_window_shift_every
            window = sampler.progressive_sde_window(
                s.num_inference_steps, s.sde_window_size, s.sde_window_range, position, self.rollout.sde_window_shift
            )
            return {"sde_window": window}
        window = sampler.draw_sde_window(
            s.num_inference_steps, s.sde_window_size, s.sde_window_range, seeded_generator(self.seed, step, 7)
        )
        return {"sde_window": window}

    def rollout_weights(self, policy_version: int):
        """With rollout.merge_lora, the adapter merged into the weights (flowrl.trainer.merged_rollout)."""
        return self.merged(policy_version)

    @property
    def lora_merge_s(self) -> float:
        return self.merged.lora_merge_s

    @property
    def checkpointing(self):
        return self.updater.checkpointing

    # -- rewards -> advantages ------------------------------------------------------------------
    def advantages(self, rows, step: int) -> StepWeights:
        return StepWeights(*step_advantages(rows, self.algorithm, self.seed, step, self.component_weights))

    # -- the update ------------------------------------------------------------------------------
    @property
    def scores_early(self) -> bool:
        return self.updater.scores_early

    def score_early(self, rollout, rows, step: int, keep_going) -> None:
        """While the rewards are still being scored, the recompute as planned with every row trained
        (flowrl.trainer.early_denominators; with algorithm.old_log_prob=recompute, after the first
        update)."""
        every_row = rows.trained(np.ones(len(rows.owner), dtype=bool))
        self.updater.score_early(*update_inputs(rollout), step, every_row, keep_going)

    def prepare(self, rollout, rows, weights: StepWeights, step: int):
        tensors, specs = update_inputs(rollout)
        advantages = torch.from_numpy(weights.values[rows.mine])
        return self.updater.prepare(
            tensors,
            specs,
            advantages,
            step,
            trained=rows.trained(weights.keep),
            policy_versions=rows.policy_versions[rows.mine],
        )

    def update(self, batch) -> dict:
        return self.updater.update(batch)

    def phase_flops(self, units: UnitFlops, rows_trained: int, val_images: int = 0) -> dict[str, float]:
        return phase_flops(units, self.setup.cfg, rows_trained, val_images)


def recomputed_rows(rows_trained: int, cfg) -> int:
    """The samples algorithm.old_log_prob=recompute scores before the update: all but those of the
    first optimizer step (the first of `trainer.updates_per_step` near-equal mini-batches, the
    larger when they differ), which score their denominators themselves; 0 with `rollout`."""
    if cfg.algorithm.old_log_prob != "recompute" or rows_trained == 0:
        return 0
    return rows_trained - math.ceil(rows_trained / cfg.trainer.updates_per_step)


def phase_flops(units: UnitFlops, cfg, rows_trained: int, val_images: int = 0) -> dict[str, float]:
    """FLOPs of each phase of one FlowGRPO step of `cfg` that trained `rows_trained` samples, with
    a validation of `val_images` images (0: none): the rollout's forwards and decodes (with
    rollout.merge_lora, on merged weights, plus the merge), the recompute's forwards (the rows of
    the optimizer steps after the first, whose own forwards give the first one's denominators), the
    update's forward + backward and the KL reference's forward, validation's forwards and decodes
    (flowrl.run.step_flops counts the units). Phases without device work count 0."""
    algo = cfg.algorithm
    trained = rows_trained * trained_steps_per_sample(cfg)
    forward_sample = units.rows_per_sample * units.forward_per_row
    flops = {
        "rollout": units.rollout(cfg),
        "reward_wait": 0.0,
        "old_log_prob": recomputed_rows(rows_trained, cfg) * trained_steps_per_sample(cfg) * forward_sample,
        "update": trained
        * cfg.trainer.update_epochs
        * (units.train_per_sample_step + (forward_sample if algo.kl_beta > 0 else 0)),
        "weight_sync": 0.0,
    }
    if val_images:
        flops["validation"] = units.validation(cfg, val_images)
    return {name: float(value) for name, value in flops.items()}
