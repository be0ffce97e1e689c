"""DiffusionNFT (arXiv 2509.16117, ICLR 2026; reference NVlabs/DiffusionNFT
scripts/train_nft_sd3.py): online RL on the forward process.

- Rollouts: deterministic (Euler's ODE step; the reference's is a 2nd-order DPM solver), without
  CFG or log-probs, keeping only each sample's final latent; drawn with the **old policy**
  (flowrl.trainer.scheduled_average), an average of the trained weights put into the shared modules for
  the rollout (`rollout_weights`) and uploaded to rollout servers in their place
  (`published_weights`). With rollout.merge_lora the old adapter is merged as FlowGRPO's is.
- Advantages: FlowGRPO's group-relative ones (flowrl.trainer.advantages), clamped to
  algorithm.adv_clip_max; the loss turns them into the optimality weight r.
- The update (flowrl.trainer.forward_update): a fraction of each sample's rollout timesteps,
  fresh noise per pair; the old policy's velocity at every pair (and the LoRA-disabled
  reference's, with algorithm.kl_beta), with no grad; DiffusionNFT's loss
  (flowrl.trainer.nft_loss); then the old policy moves by its schedule.
"""

from __future__ import annotations

import torch

from flowrl.trainer.algorithm import AlgorithmSetup
from flowrl.trainer.forward_update import ForwardProcessAlgorithm, Pair
from flowrl.trainer.nft_loss import nft_loss
from flowrl.trainer.scheduled_average import ScheduledAverage


class DiffusionNFT(ForwardProcessAlgorithm):
    name = "diffusion_nft"
    metric_names = ("policy_loss", "kl", "old_deviation")

    def __init__(self, setup: AlgorithmSetup):
        super().__init__(setup)
        self.nft = nft = setup.cfg.algorithm.nft
        self.old = ScheduledAverage(self.trainable(), nft.old_decay_flat, nft.old_decay_rate, nft.old_decay_max)
        self.rollout_average = self.old  # rollouts and rollout servers use the old policy

    def averages(self) -> dict:
        return {"old_policy": self.old}

    def reference_passes(self) -> list[tuple[str, object]]:
        return [("old", self.old.applied), *self.reference_kl_pass()]

    def pair_loss(self, velocity: torch.Tensor, pair: Pair) -> dict[str, torch.Tensor]:
        out = nft_loss(
            velocity,
            pair.velocities["old"],
            pair.x0,
            pair.x_t,
            pair.sigma,
            pair.advantages,
            self.nft.beta,
            self.algorithm.adv_clip_max,
            self.algorithm.kl_beta,
            pair.velocities.get("reference"),
        )
        return {"loss": out.loss, "policy_loss": out.policy, "kl": out.kl, "old_deviation": out.old_deviation}

    def after_update(self) -> dict:
        """The old policy moves towards the trained weights by its schedule."""
        decay = self.old.current_decay(self.num_optimizer_steps)
        self.old.step(self.num_optimizer_steps)
        return {"nft/old_decay": decay}
