"""DiffusionNFT (arXiv 2509.16117, ICLR 2026; reference NVlabs/DiffusionNFT
scripts/train_nft_sd3.py): online RL on the forward process.

- Rollouts: deterministic (Euler's ODE step; the reference's is a 2nd-order DPM solver), without
  CFG or log-probs, keeping only each sample's final latent; drawn with the **old policy**
  (flowrl.trainer.old_policy), an average of the trained weights put into the shared modules for
  the rollout (`rollout_weights`) and uploaded to rollout servers in their place
  (`published_weights`). With rollout.merge_lora the old adapter is merged as FlowGRPO's is.
- Advantages: FlowGRPO's group-relative ones (flowrl.trainer.advantages), clamped to
  algorithm.adv_clip_max; the loss turns them into the optimality weight r.
- The old-velocity phase (`prepare`): the update's pairs planned (flowrl.trainer.forward_process:
  a fraction of each sample's rollout timesteps, fresh noise per pair), then the old policy's
  velocity at every pair (and the LoRA-disabled reference's, with algorithm.kl_beta), under no
  grad, with the old weights swapped in once.
- Update: per pair the trained velocity, DiffusionNFT's loss (flowrl.trainer.nft_loss), every pair
  of an optimizer step weighing the same over all ranks; then the old policy moves by its schedule.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from flowrl.engine.output import TransitionSpec
from flowrl.models.base import host_to_device
from flowrl.models.lora import adapter_disabled
from flowrl.run.step_flops import UnitFlops
from flowrl.trainer.advantages import step_advantages
from flowrl.trainer.algorithm import Algorithm, AlgorithmSetup, StepWeights
from flowrl.trainer.forward_process import (
    PairNoise,
    global_rows,
    plan_pairs,
    rollout_timesteps,
    trained_pairs_per_sample,
)
from flowrl.trainer.grad_checkpointing import choose_checkpointing
from flowrl.trainer.merged_rollout import MergedRollout
from flowrl.trainer.nft_loss import nft_loss
from flowrl.trainer.old_policy import OldPolicy
from flowrl.trainer.optim import Optimization
from flowrl.trainer.plan import Forward, Plan
from flowrl.trainer.velocity import conditional_velocity, renoise

_METRICS = ("policy_loss", "kl", "old_deviation")


@dataclass
class PairForward:
    """One forward of the update: a Forward of the plan, its epoch, its noised latents on the
    device, and the no-grad velocities the loss compares with."""

    forward: Forward
    epoch: int
    x_t: torch.Tensor
    old_velocity: torch.Tensor
    reference_velocity: torch.Tensor | None = None


@dataclass
class NftBatch:
    """A step's update as `prepare` leaves it: this rank's tensors and specs, its final latents
    and advantages, the plan and every forward of every optimizer step, in order."""

    tensors: dict
    specs: list
    x0: torch.Tensor
    advantages: torch.Tensor
    timesteps: torch.Tensor
    plan: Plan
    steps: list[list[PairForward]] = field(default_factory=list)


class DiffusionNFT(Algorithm):
    name = "diffusion_nft"

    def __init__(self, setup: AlgorithmSetup):
        super().__init__(setup)
        cfg = setup.cfg
        self.algorithm, self.trainer_cfg, self.seed = cfg.algorithm, cfg.trainer, cfg.trainer.seed
        self.nft = cfg.algorithm.nft
        transformer = setup.adapter.transformer
        named = {name: p for name, p in transformer.named_parameters() if p.requires_grad}
        self.old = OldPolicy(named, self.nft.old_decay_flat, self.nft.old_decay_rate, self.nft.old_decay_max)
        self.optim = Optimization(setup.adapter, setup.params, cfg.trainer, setup.parallel, setup.ema)
        self.autocast_dtype = self.optim.autocast_dtype
        self.merged = MergedRollout(setup)
        self.checkpointing = None  # trainer.gradient_checkpointing, settled at the first update
        self._check_cfg_free(setup.adapter, cfg.rollout.sampling)

    @staticmethod
    def _check_cfg_free(adapter, sampling) -> None:
        if adapter.rows_per_sample(sampling) > 1:
            raise ValueError(
                f"rollout.sampling.guidance_scale={sampling.guidance_scale} (true_cfg_scale="
                f"{sampling.true_cfg_scale}) runs classifier-free guidance on this model, and "
                "algorithm.name=diffusion_nft rolls out and trains CFG-free; set rollout.sampling.guidance_scale=1.0"
            )

    @property
    def optimizer(self):
        return self.optim.optimizer

    @property
    def num_optimizer_steps(self) -> int:
        return self.optim.num_optimizer_steps

    @num_optimizer_steps.setter
    def num_optimizer_steps(self, value: int) -> None:
        self.optim.num_optimizer_steps = value

    @property
    def lora_merge_s(self) -> float:
        return self.merged.lora_merge_s

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
        return StepWeights(*step_advantages(rows.rewards, rows.uids, self.algorithm, self.seed, step))

    # -- the old-velocity phase -----------------------------------------------------------------
    def prepare(self, rollout, rows, weights: StepWeights, step: int) -> NftBatch:
        tensors = {k: v for k, v in rollout.batch.items() if k != "images"}
        specs = TransitionSpec.from_columns(rollout.non_tensor_batch)
        adapter, parallel = self.setup.adapter, self.setup.parallel
        timesteps = rollout_timesteps(adapter, specs)
        trained = rows.trained(weights.keep)
        plan = plan_pairs(
            timesteps,
            specs,
            trained,
            step,
            self.trainer_cfg,
            self.algorithm.train_timestep_fraction,
            parallel.pads_micro_batches,
        )
        x0 = tensors["all_latents"][:, -1].float()
        advantages = torch.from_numpy(weights.values[rows.mine]).float()
        batch = NftBatch(tensors, specs, x0, advantages, timesteps, plan)
        if self.checkpointing is None:
            self.checkpointing = self._choose_checkpointing(batch)
        noise = PairNoise(self.seed, step, global_rows(trained, len(specs)), tuple(x0.shape[1:]))
        with torch.no_grad():
            with self.old.applied():
                for epoch, index in self._step_epochs(plan):
                    batch.steps.append([self._pair(batch, f, epoch, noise) for f in plan.step_forwards(index)])
            if self.algorithm.kl_beta > 0:
                with adapter_disabled(adapter.transformer):
                    for pairs in batch.steps:
                        for pair in pairs:
                            pair.reference_velocity = self._velocity(batch, pair.forward, pair.x_t)
        return batch

    @staticmethod
    def _step_epochs(plan: Plan) -> list[tuple[int, int]]:
        """(epoch, optimizer step index) of every optimizer step, in order."""
        out = []
        for epoch, steps in enumerate(plan.epochs):
            out += [(epoch, len(out) + i) for i in range(len(steps))]
        return out

    def _pair(self, batch: NftBatch, forward: Forward, epoch: int, noise: PairNoise) -> PairForward:
        device = self.setup.adapter.device
        x0 = host_to_device(batch.x0[forward.rows], device)
        sigma = batch.timesteps[forward.rows, forward.step_index]
        x_t = renoise(x0, host_to_device(sigma, device), host_to_device(noise(forward.rows, forward.k, epoch), device))
        return PairForward(forward, epoch, x_t, self._velocity(batch, forward, x_t))

    def _velocity(self, batch: NftBatch, forward: Forward, x_t: torch.Tensor) -> torch.Tensor:
        mb = {name: t[forward.rows] for name, t in batch.tensors.items()}
        sigma = batch.timesteps[forward.rows, forward.step_index]
        return conditional_velocity(self.setup.adapter, mb, x_t, sigma, forward.specs, self.autocast_dtype)

    def _choose_checkpointing(self, batch: NftBatch):
        """trainer.gradient_checkpointing for this process: "auto" probes a forward with grad of
        (up to) two rows at their first timestep (flowrl.trainer.grad_checkpointing)."""
        adapter = self.setup.adapter
        rows = torch.arange(min(2, len(batch.specs)))
        probe_forward = Forward(rows, 0, torch.zeros(len(rows), dtype=torch.long), [batch.specs[i] for i in rows])

        def probe():
            adapter.transformer.train()
            try:
                x0 = host_to_device(batch.x0[rows], adapter.device)
                return self._velocity(batch, probe_forward, x0)
            finally:
                adapter.transformer.eval()

        return choose_checkpointing(
            self.trainer_cfg.gradient_checkpointing,
            adapter.transformer,
            probe,
            probe_samples=len(rows),
            micro_batch_size=self.trainer_cfg.micro_batch_size,
            device=adapter.device,
            agree_max=self.setup.parallel.world.max,
        )

    # -- the update ------------------------------------------------------------------------------
    def update(self, batch: NftBatch) -> dict:
        """Each optimizer step: every pair's loss (a share of the step's mean over every rank's
        pairs) backpropagated, then one optimizer step; then the old policy moves."""
        adapter, plan = self.setup.adapter, batch.plan
        sums = dict.fromkeys(_METRICS, 0.0)
        count, grad_norms = 0, []
        adapter.transformer.train()
        for index, pairs in enumerate(batch.steps):
            normalizer = max(plan.step_weights[index] * plan.num_trained_steps, 1.0)
            outputs = []
            for pair in pairs:
                forward = pair.forward
                velocity = self._velocity(batch, forward, pair.x_t)
                rows = forward.rows
                x0 = host_to_device(batch.x0[rows], adapter.device)
                sigma = host_to_device(batch.timesteps[rows, forward.step_index], adapter.device)
                out = nft_loss(
                    velocity,
                    pair.old_velocity,
                    x0,
                    pair.x_t,
                    sigma,
                    host_to_device(batch.advantages[rows], adapter.device),
                    self.nft.beta,
                    self.algorithm.adv_clip_max,
                    self.algorithm.kl_beta,
                    pair.reference_velocity,
                )
                weight = 0.0 if forward.is_padding else 1.0
                self.optim.backward(out.loss.sum() * weight / normalizer)
                if not forward.is_padding:
                    outputs.append(torch.stack([out.policy.sum(), out.kl.sum(), out.old_deviation.sum()]).detach())
                    count += len(rows)
            grad_norms.append(self.optim.step())
            if outputs:  # read once per optimizer step, after its kernels are queued
                totals = torch.stack(outputs).sum(dim=0).cpu().tolist()
                for name, value in zip(_METRICS, totals):
                    sums[name] += value
        adapter.transformer.eval()
        decay = self.old.current_decay(self.num_optimizer_steps)
        self.old.step(self.num_optimizer_steps)
        return self._metrics(sums, count, grad_norms, plan, decay)

    def _metrics(self, sums: dict, count: int, grad_norms: list[float], plan: Plan, decay: float) -> dict:
        world = self.setup.parallel.world
        *totals, count = world.sum([*sums.values(), count])
        metrics = {f"actor/{name}": total / max(count, 1) for name, total in zip(_METRICS, totals)}
        metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        metrics["actor/num_optimizer_steps"] = len(grad_norms)
        metrics["actor/num_trained_steps_per_sample"] = plan.num_trained_steps
        metrics["nft/old_decay"] = decay
        metrics.update(self.checkpointing.metrics())
        return metrics

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
