"""The policy update of one training step: clipped PPO over the stored SDE transitions.

`PolicyUpdater.update(tensors, advantages, weights, step)`:
1. picks the trained window steps of every sample (all of them, or a random
   `train_timestep_fraction` of them per sample, drawn from (trainer.seed, step)) and each update
   epoch's sample order (again from (seed, step, epoch)), cut into micro-batches and optimizer
   steps of `grad_accum` micro-batches;
2. gets the PPO denominator: the rollout's log-probs (`algorithm.old_log_prob=rollout`) or a
   no-grad recompute with the current policy before any update (`recompute`);
3. for each optimizer step, for each micro-batch and each trained step: recomputes the log-prob
   with grad, adds the clipped loss (+ KL to the LoRA-disabled reference) and backpropagates;
   then clips the gradient and takes one AdamW step.

Where a scored log-prob takes its VALUE from is chosen once, when the updater is built
(`Scoring`): the grad pass itself (an eager model: one graph), or, with a compiled model, the
no-grad graph the rollout ran (flowrl.trainer.policy, `values_from_no_grad`), which costs one more
no-grad forward per scored micro-batch, except where the recompute's values are those very values
(`old_log_prob=recompute`, before the update's first optimizer step, no KL term): the recipes'
default of one optimizer step per training step. Its gradient always comes from the grad pass.

Every random choice derives from (seed, step), so a resumed run repeats the straight run exactly.
The rollout-vs-trainer log-prob gap is measured on transitions scored by the policy that produced
them: the recompute pass, or (rollout mode) micro-batches scored before the step's first update.

This module knows the stacked rollout tensors and the trainer's config slices; it knows nothing
about the engine, rewards or how the advantages were computed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from flowrl.config.sections import OldLogProbSource
from flowrl.sampler import kl_to_reference
from flowrl.trainer.lora import adapter_disabled
from flowrl.trainer.loss import PolicyLossOutput, clipped_policy_loss
from flowrl.trainer.policy import (
    MIXED_PRECISION_DTYPES,
    TransitionSpec,
    score_transitions,
    takes_values_from_no_grad,
    with_values,
)

# Where a grad pass's log-prob values come from: its own graph ("grad_pass"), a no-grad pass of
# the same forwards run just before it ("value_pass"), or the old-log-prob recompute, which ran
# that no-grad pass already ("recompute").
ValueSource = Literal["grad_pass", "value_pass", "recompute"]
_LOSS_METRICS = ("policy_loss", "clipfrac", "ratio_mean", "approx_kl", "kl")


@dataclass(frozen=True)
class Scoring:
    """The update's value sources: one until its first optimizer step, one after it."""

    first_step: ValueSource
    later_steps: ValueSource

    @classmethod
    def choose(cls, values_from_no_grad: bool, old_log_prob: OldLogProbSource, kl_beta: float) -> "Scoring":
        if not values_from_no_grad:
            return cls("grad_pass", "grad_pass")
        # The recompute ran the no-grad graph on epoch 0's micro-batches with these weights: until
        # the first optimizer step its log-probs ARE the value pass's. It did not keep the mean's
        # value, which the KL term needs: with a KL term the value pass runs.
        if old_log_prob == "recompute" and not kl_beta > 0:
            return cls("recompute", "value_pass")
        return cls("value_pass", "value_pass")


class PolicyUpdater:
    """Owns the optimizer over the trainable parameters and runs the update of each step."""

    def __init__(self, adapter, params: list[torch.nn.Parameter], algorithm_cfg, trainer_cfg, spec: TransitionSpec):
        self.adapter = adapter
        self.params = params
        self.algorithm = algorithm_cfg
        self.trainer = trainer_cfg
        self.spec = spec
        self.optimizer = torch.optim.AdamW(
            params, lr=trainer_cfg.lr, betas=tuple(trainer_cfg.betas), weight_decay=trainer_cfg.weight_decay
        )
        self.autocast_dtype = MIXED_PRECISION_DTYPES[trainer_cfg.mixed_precision]
        self.scaler = torch.amp.GradScaler(adapter.device.type) if trainer_cfg.mixed_precision == "fp16" else None
        self.num_optimizer_steps = 0
        # Read once: the trainer compiles the model (and injects LoRA) before building the updater.
        self.values_from_no_grad = takes_values_from_no_grad(adapter)
        self.scoring = Scoring.choose(self.values_from_no_grad, algorithm_cfg.old_log_prob, algorithm_cfg.kl_beta)

    # -- the update -----------------------------------------------------------------------------
    def update(
        self, tensors: dict[str, torch.Tensor], advantages: torch.Tensor, weights: torch.Tensor, step: int
    ) -> dict:
        """Run the update of training step `step`; returns its metrics (see module docstring)."""
        t0 = time.perf_counter()
        # 1. what is trained, in which order
        num_rows, window = tensors["sigmas"].shape
        if window == 0:
            raise ValueError("the rollouts have no SDE window steps; set rollout.sampling.sde_window_size >= 1")
        train_steps = self.trained_steps(num_rows, window, step)
        num_train = train_steps.shape[1]
        orders = [
            torch.randperm(num_rows, generator=self._generator(step, 2, epoch))
            for epoch in range(self.trainer.update_epochs)
        ]
        accum = self.trainer.resolve_grad_accum(num_rows)
        optimizer_steps = [group for order in orders for group in _chunks(self._micro_batches(order), accum)]
        rollout_log_probs = tensors.get("all_log_probs")
        if rollout_log_probs is not None:
            rollout_log_probs = rollout_log_probs.gather(1, train_steps).float()

        # 2. the PPO denominator
        old, gaps = self._old_log_probs(tensors, train_steps, orders[0], rollout_log_probs)
        measure_gap_in_first_step = rollout_log_probs is not None and self.algorithm.old_log_prob == "rollout"

        # 3. clipped PPO: score with grad, loss, backward; one optimizer step per group
        sums = dict.fromkeys(_LOSS_METRICS, 0.0)
        count, ratio_max, grad_norms = 0, -math.inf, []
        transformer = self.adapter.transformer
        transformer.train()
        for index, group in enumerate(optimizer_steps):
            source = self.scoring.first_step if index == 0 else self.scoring.later_steps
            for rows in group:
                for k in range(num_train):
                    step_index = train_steps[rows, k]
                    result = self._score_with_grad(tensors, rows, step_index, source, old[rows, k])
                    kl = None
                    if self.algorithm.kl_beta > 0:
                        kl = kl_to_reference(result.mean, self._reference_mean(tensors, rows, step_index), result.std)
                    out = clipped_policy_loss(
                        result.log_prob,
                        old[rows, k],
                        advantages[rows],
                        self.algorithm.clip_range,
                        kl=kl,
                        kl_beta=self.algorithm.kl_beta,
                        weights=weights[rows],
                    )
                    self._backward(out.loss / (len(group) * num_train))
                    if measure_gap_in_first_step and index == 0:
                        gaps.append((result.log_prob.detach().cpu() - rollout_log_probs[rows, k]).abs())
                    _accumulate(sums, out)
                    ratio_max = max(ratio_max, out.ratio_max)
                    count += 1
            grad_norms.append(self._optimizer_step())
        transformer.eval()

        # 4. metrics
        metrics = {f"actor/{name}": value / max(count, 1) for name, value in sums.items()}
        metrics["actor/ratio_max"] = ratio_max
        metrics["actor/grad_norm"] = float(np.mean(grad_norms)) if grad_norms else 0.0
        metrics["actor/num_optimizer_steps"] = len(grad_norms)
        metrics["actor/num_trained_steps_per_sample"] = num_train
        if gaps:
            gap = torch.cat(gaps)
            metrics["actor/logprob_gap_mean"] = float(gap.mean())
            metrics["actor/logprob_gap_max"] = float(gap.max())
        metrics["timing/update_s"] = time.perf_counter() - t0
        return metrics

    # -- the pieces of the update -----------------------------------------------------------------
    def trained_steps(self, num_rows: int, window: int, step: int) -> torch.Tensor:
        """(N, K) window-step indices to train per sample (sorted), K = max(1, int(W * fraction))."""
        count = max(1, int(window * float(self.algorithm.train_timestep_fraction) + 1e-9))
        if count >= window:
            return torch.arange(window).expand(num_rows, window).clone()
        gen = self._generator(step, 1)
        return torch.stack([torch.randperm(window, generator=gen)[:count].sort().values for _ in range(num_rows)])

    def _old_log_probs(self, tensors, train_steps, first_order, rollout_log_probs) -> tuple[torch.Tensor, list]:
        """The PPO denominator (N, K), and the log-prob gaps it measured. The recompute uses epoch
        0's micro-batches, so the first update's forwards see the same batch composition (ratio
        exactly 1 on CPU)."""
        if self.algorithm.old_log_prob == "rollout":
            if rollout_log_probs is None:
                raise ValueError(
                    "algorithm.old_log_prob=rollout needs rollout log-probs; set rollout.sampling.logprobs=true"
                )
            return rollout_log_probs, []
        old = torch.empty(train_steps.shape)
        for rows in self._micro_batches(first_order):
            for k in range(train_steps.shape[1]):
                old[rows, k] = self._score_no_grad(tensors, rows, train_steps[rows, k]).log_prob.cpu()
        gaps = [] if rollout_log_probs is None else [(old - rollout_log_probs).abs().flatten()]
        return old, gaps

    def _score_with_grad(self, tensors, rows, step_index, source: ValueSource, recomputed: torch.Tensor):
        """Score micro-batch `rows` at `step_index` with grad, its values from `source`;
        `recomputed`: these rows' recompute log-probs (used by source "recompute")."""
        mb = {name: t[rows] for name, t in tensors.items()}
        if source == "recompute":
            return with_values(
                score_transitions(self.adapter, mb, step_index, self.spec, self.autocast_dtype), recomputed
            )
        return score_transitions(
            self.adapter, mb, step_index, self.spec, self.autocast_dtype, values_from_no_grad=source == "value_pass"
        )

    def _score_no_grad(self, tensors, rows, step_index):
        mb = {name: t[rows] for name, t in tensors.items()}
        with torch.no_grad():
            return score_transitions(self.adapter, mb, step_index, self.spec, self.autocast_dtype)

    def _reference_mean(self, tensors, rows, step_index):
        with torch.no_grad(), adapter_disabled(self.adapter.transformer):
            return self._score_no_grad(tensors, rows, step_index).mean

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def _optimizer_step(self) -> float:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.trainer.grad_clip))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_optimizer_steps += 1
        return grad_norm

    def _generator(self, *keys: int) -> torch.Generator:
        return torch.Generator().manual_seed(
            int(np.random.SeedSequence([self.trainer.seed, *keys]).generate_state(1)[0])
        )

    def _micro_batches(self, order: torch.Tensor) -> list[torch.Tensor]:
        size = self.trainer.micro_batch_size
        return [order[i : i + size] for i in range(0, order.shape[0], size)]


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _accumulate(sums: dict[str, float], out: PolicyLossOutput) -> None:
    for name in _LOSS_METRICS:
        sums[name] += getattr(out, name)
