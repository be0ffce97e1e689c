"""AWM, Advantage Weighted Matching (arXiv 2509.25050, ICML 2026; reference
scxue/advantage_weighted_matching scripts/train_sd3_awm.py with config/dgx_awm.py
geneval_sd3_no_cfg_1node).

- Rollouts: deterministic (Euler's ODE step; the reference's is SA-Solver with its noise off),
  CFG-free, keeping only each sample's final latent, drawn with the trained weights themselves
  (on-policy; with rollout.merge_lora, merged).
- Advantages: the group-relative ones (flowrl.trainer.advantages), clamped to
  algorithm.adv_clip_max and rescaled to +-algorithm.awm.advantage_max.
- The update (flowrl.trainer.forward_update): a fraction of each sample's rollout timesteps, fresh
  noise per pair; with no grad, the surrogate log-prob of the weights the update starts from (the
  ratio's denominator), the LoRA-disabled reference's velocity (algorithm.kl_beta) and the EMA
  policy's (algorithm.awm.ema_kl_beta); AWM's loss (flowrl.trainer.awm_loss) with PPO's clip
  (algorithm.clip_range); then the EMA policy moves by its schedule (flowrl.trainer.scheduled_average).
"""

from __future__ import annotations

import contextlib

import torch

from flowrl.trainer.algorithm import AlgorithmSetup
from flowrl.trainer.awm_loss import awm_advantages, awm_policy_loss, surrogate_log_prob, velocity_kl
from flowrl.trainer.forward_update import ForwardProcessAlgorithm, Pair
from flowrl.trainer.scheduled_average import ScheduledAverage


class AWM(ForwardProcessAlgorithm):
    name = "awm"
    metric_names = ("policy_loss", "kl", "ema_kl", "clipfrac", "ratio")

    def __init__(self, setup: AlgorithmSetup):
        super().__init__(setup)
        self.awm = setup.cfg.algorithm.awm
        self.ema_policy = ScheduledAverage(self.trainable(), 0, self.awm.ema_decay_rate, self.awm.ema_decay_max)

    def averages(self) -> dict:
        return {"ema_policy": self.ema_policy}

    def reference_passes(self) -> list[tuple[str, object]]:
        passes = [("start", contextlib.nullcontext), *self.reference_kl_pass()]
        if self.awm.ema_kl_beta > 0:
            passes.append(("ema", self.ema_policy.applied))
        return passes

    def pair_loss(self, velocity: torch.Tensor, pair: Pair) -> dict[str, torch.Tensor]:
        awm, algo = self.awm, self.algorithm
        log_prob = surrogate_log_prob(velocity, pair.x0, pair.noise, pair.sigma, awm.weighting, awm.ghuber_power)
        start = pair.velocities["start"]
        old = surrogate_log_prob(start, pair.x0, pair.noise, pair.sigma, awm.weighting, awm.ghuber_power)
        advantages = awm_advantages(pair.advantages.double(), algo.adv_clip_max, awm.advantage_max)
        policy, ratio, clipped = awm_policy_loss(log_prob, old, advantages, algo.clip_range)
        kl = velocity_kl(velocity, pair.velocities.get("reference"))
        ema_kl = velocity_kl(velocity, pair.velocities.get("ema"))
        loss = policy.float() + algo.kl_beta * kl + awm.ema_kl_beta * ema_kl
        return {
            "loss": loss,
            "policy_loss": policy,
            "kl": kl,
            "ema_kl": ema_kl,
            "clipfrac": clipped.float(),
            "ratio": ratio,
        }

    def after_update(self) -> dict:
        """The EMA policy moves towards the trained weights by its schedule."""
        decay = self.ema_policy.current_decay(self.num_optimizer_steps)
        self.ema_policy.step(self.num_optimizer_steps)
        return {"awm/ema_decay": decay}
