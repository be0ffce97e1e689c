"""The update shared by the forward-process algorithms (DiffusionNFT, AWM): what differs between
them is a few hooks, chosen before the loops.

- `prepare` (the old-velocity phase): the update's pairs planned (flowrl.trainer.forward_process:
  a fraction of each sample's rollout timesteps that the trained module predicts, fresh noise per
  pair), each pair's noised latent
  x_t, then, with no grad, the velocity of every pair under each of the algorithm's
  `reference_passes()` (a name and the context whose weights it takes: DiffusionNFT's old policy,
  the LoRA-disabled reference, AWM's current weights and EMA policy), each context entered once.
- `update`: per optimizer step, each pair's trained velocity, the algorithm's `pair_loss` (per
  row), every pair of the step weighing the same over all ranks; one optimizer step; then
  `after_update` (the algorithms' averages move).

Subclasses build `self.optim` (flowrl.trainer.optim) and say which rows their advantages train.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from dataclasses import dataclass, field

import torch

from flowrl.engine.output import TransitionSpec
from flowrl.models.base import host_to_device
from flowrl.models.lora import adapter_disabled
from flowrl.run.step_flops import UnitFlops
from flowrl.trainer.advantages import gdpo_weights, step_advantages
from flowrl.trainer.algorithm import Algorithm, AlgorithmSetup, StepWeights
from flowrl.trainer.forward_process import (
    PairNoise,
    global_rows,
    plan_pairs,
    rollout_timesteps,
    trained_pairs_per_sample,
    trained_timesteps,
)
from flowrl.trainer.grad_checkpointing import choose_checkpointing
from flowrl.trainer.merged_rollout import MergedRollout
from flowrl.trainer.optim import Optimization
from flowrl.trainer.plan import Forward, Plan
from flowrl.trainer.velocity import conditional_velocity, renoise


@dataclass
class Pair:
    """One forward of the update: a Forward of the plan, its noised latents, clean latents, noise
    levels and advantages on the device, and the no-grad velocities by reference-pass name."""

    forward: Forward
    x_t: torch.Tensor
    x0: torch.Tensor
    noise: torch.Tensor
    sigma: torch.Tensor
    advantages: torch.Tensor
    velocities: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class PairBatch:
    """A step's update as `prepare` leaves it: this rank's tensors and specs, the rollout
    timesteps, the plan and every pair of every optimizer step, in order."""

    tensors: dict
    specs: list
    timesteps: torch.Tensor
    plan: Plan
    steps: list[list[Pair]] = field(default_factory=list)


class ForwardProcessAlgorithm(Algorithm):
    """An algorithm that trains on final latents re-noised (module docstring). `rollout_average`:
    the average of the weights its rollouts use and rollout servers serve (DiffusionNFT's old
    policy, online DPO's reference snapshot; None: the trained weights)."""

    metric_names: tuple[str, ...] = ()  # the per-row values `pair_loss` returns besides the loss
    rollout_average = None

    def __init__(self, setup: AlgorithmSetup):
        super().__init__(setup)
        cfg = setup.cfg
        self.algorithm, self.trainer_cfg, self.seed = cfg.algorithm, cfg.trainer, cfg.trainer.seed
        self.optim = Optimization(setup.adapter, setup.params, cfg.trainer, setup.parallel, setup.ema)
        self.autocast_dtype = self.optim.autocast_dtype
        self.merged = MergedRollout(setup)
        self.checkpointing = None  # trainer.gradient_checkpointing, settled at the first update
        if setup.adapter.rows_per_sample(cfg.rollout.sampling) > 1:
            s = cfg.rollout.sampling
            raise ValueError(
                f"rollout.sampling.guidance_scale={s.guidance_scale} (true_cfg_scale={s.true_cfg_scale}) runs "
                f"classifier-free guidance on this model, and algorithm.name={cfg.algorithm.name} rolls out and "
                "trains CFG-free; set rollout.sampling.guidance_scale=1.0"
            )

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.setup.adapter.transformer.named_parameters() if p.requires_grad}

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

    # -- rollouts and advantages -----------------------------------------------------------------
    @contextlib.contextmanager
    def rollout_weights(self, policy_version: int):
        """`rollout_average` in the shared modules, if any (merged, with rollout.merge_lora)."""
        with self.published_weights(), self.merged(policy_version):
            yield

    def published_weights(self):
        return contextlib.nullcontext() if self.rollout_average is None else self.rollout_average.applied()

    def advantages(self, rows, step: int) -> StepWeights:
        """The group-relative advantages (flowrl.trainer.advantages)."""
        return StepWeights(*step_advantages(rows, self.algorithm, self.seed, step, gdpo_weights(self.setup.cfg)))

    # -- hooks -----------------------------------------------------------------------------------
    @abstractmethod
    def reference_passes(self) -> list[tuple[str, object]]:
        """(name, context factory) of each no-grad velocity the loss compares with."""

    @abstractmethod
    def pair_loss(self, velocity: torch.Tensor, pair: Pair) -> dict[str, torch.Tensor]:
        """{"loss": (B,), and each of metric_names: (B,)} for the pair's B planned rows (a
        share of the optimizer step's mean each)."""

    def after_update(self) -> dict:
        """After the step's optimizer steps (the averages move); returns metrics."""
        return {}

    def phase_flops(self, units: UnitFlops, rows_trained: int, val_images: int = 0) -> dict[str, float]:
        """FLOPs of each phase of a step that trained `rows_trained` samples (and validated
        `val_images`; flowrl.run.step_flops counts the units): the rollout's, one forward per pair
        for each reference pass (the old-velocity phase), one forward + backward per pair."""
        cfg = self.setup.cfg
        fraction = self.algorithm.train_timestep_fraction
        pairs = rows_trained * self.rows_per_pair * cfg.trainer.update_epochs
        pairs *= trained_pairs_per_sample(trained_timesteps(self.setup.adapter, cfg.rollout.sampling), fraction)
        forward = units.rows_per_sample * units.forward_per_row
        flops = {
            "rollout": units.rollout(cfg),
            "reward_wait": 0.0,
            "old_log_prob": pairs * forward * len(self.reference_passes()),
            "update": pairs * units.train_per_sample_step,
            "weight_sync": 0.0,
        }
        if val_images:
            flops["validation"] = units.validation(cfg, val_images)
        return {name: float(value) for name, value in flops.items()}

    rows_per_pair = 1  # rows each planned (sample, timestep) pair runs (online DPO: chosen and rejected)

    def widen(self, forward: Forward) -> tuple[Forward, torch.Tensor]:
        """The rows a planned forward runs (by default its own) and, for each, which of the
        planned rows' noise it takes (online DPO adds each chosen row's rejected partner, on the
        same noise and timestep)."""
        return forward, torch.arange(len(forward.rows))

    def reference_kl_pass(self) -> list[tuple[str, object]]:
        """The LoRA-disabled reference's velocity, when algorithm.kl_beta weighs a KL to it."""
        if self.algorithm.kl_beta <= 0:
            return []
        return [("reference", lambda: adapter_disabled(self.setup.adapter.transformer))]

    # -- the old-velocity phase -----------------------------------------------------------------
    def prepare(self, rollout, rows, weights: StepWeights, step: int) -> PairBatch:
        tensors = {k: v for k, v in rollout.batch.items() if k != "images"}
        specs = TransitionSpec.from_columns(rollout.non_tensor_batch)
        adapter, parallel = self.setup.adapter, self.setup.parallel
        timesteps = rollout_timesteps(adapter, specs)
        trained = rows.trained(weights.keep)
        fraction = self.algorithm.train_timestep_fraction
        plan = plan_pairs(timesteps, specs, trained, step, self.trainer_cfg, fraction, parallel.pads_micro_batches)
        batch = PairBatch(tensors, specs, timesteps, plan)
        x0 = tensors["all_latents"][:, -1].float()
        advantages = torch.from_numpy(weights.values[rows.mine]).float()
        if self.checkpointing is None:
            self.checkpointing = self._choose_checkpointing(batch, x0)
        noise = PairNoise(self.seed, step, global_rows(trained, len(specs)), tuple(x0.shape[1:]))
        epochs = [epoch for epoch, steps in enumerate(plan.epochs) for _ in steps]
        for index, epoch in enumerate(epochs):
            batch.steps.append(
                [self._pair(batch, f, x0, advantages, noise(f.rows, f.k, epoch)) for f in plan.step_forwards(index)]
            )
        with torch.no_grad():
            for name, context in self.reference_passes():
                with context():
                    for pairs in batch.steps:
                        for pair in pairs:
                            pair.velocities[name] = self.velocity(batch, pair)
        return batch

    def _pair(self, batch: PairBatch, forward: Forward, x0, advantages, noise) -> Pair:
        device = self.setup.adapter.device
        forward, take = self.widen(forward)
        sigma = host_to_device(batch.timesteps[forward.rows, forward.step_index], device)
        x0, noise = host_to_device(x0[forward.rows], device), host_to_device(noise[take], device)
        return Pair(
            forward, renoise(x0, sigma, noise), x0, noise, sigma, host_to_device(advantages[forward.rows], device)
        )

    def velocity(self, batch: PairBatch, pair: Pair) -> torch.Tensor:
        forward = pair.forward
        mb = {name: t[forward.rows] for name, t in batch.tensors.items()}
        sigma = batch.timesteps[forward.rows, forward.step_index]
        return conditional_velocity(self.setup.adapter, mb, pair.x_t, sigma, forward.specs, self.autocast_dtype)

    def _choose_checkpointing(self, batch: PairBatch, x0: torch.Tensor):
        """trainer.gradient_checkpointing for this process: "auto" probes a forward with grad of
        (up to) two rows at their first timestep (flowrl.trainer.grad_checkpointing)."""
        adapter = self.setup.adapter
        rows = torch.arange(min(2, len(batch.specs)))
        probe_forward = Forward(rows, 0, torch.zeros(len(rows), dtype=torch.long), [batch.specs[i] for i in rows])
        device_x0 = host_to_device(x0[rows], adapter.device)
        probe_pair = Pair(probe_forward, device_x0, device_x0, device_x0, device_x0, device_x0)

        def probe():
            adapter.transformer.train()
            try:
                return self.velocity(batch, probe_pair)
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
    def update(self, batch: PairBatch) -> dict:
        """Each optimizer step: every pair's loss (a share of the step's mean over every rank's
        pairs) backpropagated, then one optimizer step; then `after_update`."""
        adapter, plan = self.setup.adapter, batch.plan
        names = ("loss", *self.metric_names)
        sums, count, grad_norms = dict.fromkeys(names, 0.0), 0, []
        adapter.transformer.train()
        for index, pairs in enumerate(batch.steps):
            normalizer = max(plan.step_weights[index] * plan.num_trained_steps, 1.0)
            outputs = []
            for pair in pairs:
                out = self.pair_loss(self.velocity(batch, pair), pair)
                weight = 0.0 if pair.forward.is_padding else 1.0
                self.optim.backward(out["loss"].sum() * weight / normalizer)
                if not pair.forward.is_padding:
                    outputs.append(torch.stack([out[name].detach().float().sum() for name in names]))
                    count += out["loss"].shape[0]
            grad_norms.append(self.optim.step())
            if outputs:  # read once per optimizer step, after its kernels are queued
                for name, value in zip(names, torch.stack(outputs).sum(dim=0).cpu().tolist()):
                    sums[name] += value
        adapter.transformer.eval()
        world = self.setup.parallel.world
        *totals, count = world.sum([*sums.values(), count])
        metrics = {f"actor/{name}": total / max(count, 1) for name, total in zip(names, totals)}
        metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        metrics["actor/num_optimizer_steps"] = len(grad_norms)
        metrics["actor/num_trained_steps_per_sample"] = plan.num_trained_steps
        metrics.update(self.checkpointing.metrics())
        metrics.update(self.after_update())
        return metrics
