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

import contextlib

import torch

from flowrl.run.step_flops import UnitFlops
from flowrl.trainer.advantages import gdpo_weights, step_advantages
from flowrl.trainer.algorithm import AlgorithmSetup, StepWeights
from flowrl.trainer.forward_process import trained_pairs_per_sample
from flowrl.trainer.forward_update import ForwardProcessAlgorithm, Pair
from flowrl.trainer.nft_loss import nft_loss
from flowrl.trainer.scheduled_average import ScheduledAverage


class DiffusionNFT(ForwardProcessAlgorithm):
    name = "diffusion_nft"
    metric_names = ("policy_loss", "kl", "old_deviation")

    def __init__(self, setup: AlgorithmSetup):
        super().__init__(setup)
        self.nft = setup.cfg.algorithm.nft
        nft = self.nft
        self.old = ScheduledAverage(self.trainable(), nft.old_decay_flat, nft.old_decay_rate, nft.old_decay_max)

    def averages(self) -> dict:
        return {"old_policy": self.old}

    # -- rollouts --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def rollout_weights(self, policy_version: int):
        """The old policy in the shared modules (merged, with rollout.merge_lora)."""
        with self.old.applied(), self.merged(policy_version):
            yield

    def published_weights(self):
        """Rollout servers serve the old policy."""
        return self.old.applied()

    # -- rewards -> advantages ------------------------------------------------------------------
    def advantages(self, rows, step: int) -> StepWeights:
        return StepWeights(*step_advantages(rows, self.algorithm, self.seed, step, gdpo_weights(self.setup.cfg)))

    # -- the update ------------------------------------------------------------------------------
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

    def phase_flops(self, units: UnitFlops, rows_trained: int, val_images: int = 0) -> dict[str, float]:
        return phase_flops(units, self.setup.cfg, rows_trained, val_images)


def phase_flops(units: UnitFlops, cfg, rows_trained: int, val_images: int = 0) -> dict[str, float]:
    """FLOPs of each phase of one DiffusionNFT step of `cfg` that trained `rows_trained` samples
    (flowrl.run.step_flops counts the units): the rollout's forwards (every step, CFG-free) and
    decodes (and the merge), the old policy's (and the reference's) forwards at every pair, the
    update's forward + backward at every pair, validation's forwards and decodes."""
    s, v, algo = cfg.rollout.sampling, cfg.rollout.val_sampling, cfg.algorithm
    samples = cfg.trainer.prompts_per_step * cfg.rollout.n
    pairs = rows_trained * trained_pairs_per_sample(s.num_inference_steps, algo.train_timestep_fraction)
    pairs *= cfg.trainer.update_epochs
    forward_sample = units.rows_per_sample * units.forward_per_row
    rollout_sample = s.num_inference_steps * units.rows_per_sample * units.rollout_forward_per_row
    flops = {
        "rollout": samples * (rollout_sample + units.decode_per_image) + units.merge_per_rollout,
        "reward_wait": 0.0,
        "old_log_prob": pairs * forward_sample * (2 if algo.kl_beta > 0 else 1),
        "update": pairs * units.train_per_sample_step,
        "weight_sync": 0.0,
    }
    if val_images:
        per_image = v.num_inference_steps * units.val_rows_per_sample * units.val_forward_per_row
        flops["validation"] = val_images * (per_image + units.val_decode_per_image)
    return {name: float(value) for name, value in flops.items()}
