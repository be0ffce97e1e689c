"""The policy update of one training step: clipped PPO over the stored SDE transitions.

`PolicyUpdater.update(tensors, advantages, weights, step)`:
1. picks the trained window steps of every sample (all of them, or a random
   `train_timestep_fraction` of them per sample, drawn from (trainer.seed, step));
2. gets the PPO denominator: the rollout's log-probs (`algorithm.old_log_prob=rollout`) or a
   no-grad recompute with the current policy before any update (`recompute`);
3. for each update epoch, shuffles the samples (again from (seed, step, epoch)), and for each
   micro-batch and each trained step recomputes the log-prob with grad, adds the clipped loss
   (+ KL to the LoRA-disabled reference) and backpropagates; every `grad_accum` micro-batches it
   clips the gradient and takes one AdamW step.

With a compiled model (`engine.compile`), every scored log-prob takes its value from the
no-grad graph the rollout ran and its gradient from the grad graph (`values_from_no_grad`,
flowrl.trainer.policy): one more no-grad forward per scored micro-batch, except where the
recompute's values are those very values (`old_log_prob=recompute`, before the step's first
optimizer update, no KL term): the recipes' default of one optimizer step per training step.

Every random choice derives from (seed, step), so a resumed run repeats the straight run exactly.
The rollout-vs-trainer log-prob gap is measured on transitions scored by the policy that produced
them: the recompute pass, or (rollout mode) micro-batches scored before the step's first update.
"""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch

from flowrl.trainer.loss import clipped_policy_loss
from flowrl.trainer.lora import adapter_disabled
from flowrl.trainer.policy import (MIXED_PRECISION_DTYPES, TransitionSpec, score_transitions, takes_values_from_no_grad,
                                   with_values)
from flowrl.sampler import kl_to_reference



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
        mixed = getattr(trainer_cfg, "mixed_precision", "no")
        self.autocast_dtype = MIXED_PRECISION_DTYPES[mixed]
        self.scaler = torch.amp.GradScaler(adapter.device.type) if mixed == "fp16" else None
        self.num_optimizer_steps = 0
        # Read once: the trainer compiles the model (and injects LoRA) before building the updater.
        self.values_from_no_grad = takes_values_from_no_grad(adapter)

    # -- helpers ------------------------------------------------------------------------------
    def _generator(self, *keys: int) -> torch.Generator:
        return torch.Generator().manual_seed(int(np.random.SeedSequence([self.trainer.seed, *keys]).generate_state(1)[0]))

    def trained_steps(self, num_rows: int, window: int, step: int) -> torch.Tensor:
        """(N, K) window-step indices to train per sample (sorted), K = max(1, int(W * fraction))."""
        fraction = float(getattr(self.algorithm, "train_timestep_fraction", 1.0))
        count = max(1, int(window * fraction + 1e-9))
        if count >= window:
            return torch.arange(window).expand(num_rows, window).clone()
        gen = self._generator(step, 1)
        return torch.stack([torch.randperm(window, generator=gen)[:count].sort().values for _ in range(num_rows)])

    def _score(self, tensors, rows, step_index, with_grad: bool, known_log_prob: torch.Tensor | None = None):
        """Score micro-batch `rows` at `step_index`. known_log_prob: the no-grad values of these
        very forwards, computed already (the recompute before any update): the grad pass takes
        them instead of running the no-grad pass again."""
        mb = {name: t[rows] for name, t in tensors.items()}
        context = contextlib.nullcontext() if with_grad else torch.no_grad()
        with context:
            if known_log_prob is not None:
                return with_values(score_transitions(self.adapter, mb, step_index, self.spec, self.autocast_dtype),
                                   known_log_prob)
            return score_transitions(self.adapter, mb, step_index, self.spec, self.autocast_dtype,
                                     values_from_no_grad=self.values_from_no_grad)

    def _reference_mean(self, tensors, rows, step_index):
        with torch.no_grad(), adapter_disabled(self.adapter.transformer):
            return self._score(tensors, rows, step_index, with_grad=False).mean

    def _micro_batches(self, order: torch.Tensor) -> list[torch.Tensor]:
        size = self.trainer.micro_batch_size
        return [order[i:i + size] for i in range(0, order.shape[0], size)]

    # -- the update -----------------------------------------------------------------------------
    def update(self, tensors: dict[str, torch.Tensor], advantages: torch.Tensor, weights: torch.Tensor, step: int) -> dict:
        """Run the update of training step `step`; returns its metrics (see module docstring)."""
        t0 = time.perf_counter()
        num_rows, window = tensors["sigmas"].shape
        if window == 0:
            raise ValueError("the rollouts have no SDE window steps; set rollout.sampling.sde_window_size >= 1")
        train_steps = self.trained_steps(num_rows, window, step)
        num_train = train_steps.shape[1]
        rollout_log_probs = tensors.get("all_log_probs")
        if rollout_log_probs is not None:
            rollout_log_probs = rollout_log_probs.gather(1, train_steps).float()
        gaps: list[torch.Tensor] = []
        transformer = self.adapter.transformer
        orders = [torch.randperm(num_rows, generator=self._generator(step, 2, epoch)) for epoch in range(self.trainer.update_epochs)]

        # 1. the PPO denominator. The recompute uses epoch 0's micro-batches, so the first
        # update's forwards see the same batch composition (ratio exactly 1 on CPU).
        if self.algorithm.old_log_prob == "recompute":
            old = torch.empty(num_rows, num_train)
            for rows in self._micro_batches(orders[0]):
                for k in range(num_train):
                    old[rows, k] = self._score(tensors, rows, train_steps[rows, k], with_grad=False).log_prob.cpu()
            if rollout_log_probs is not None:
                gaps.append((old - rollout_log_probs).abs().flatten())
        else:
            if rollout_log_probs is None:
                raise ValueError("algorithm.old_log_prob=rollout needs rollout log-probs; set rollout.sampling.logprobs=true")
            old = rollout_log_probs

        # 2. the updates
        sums: dict[str, float] = {}
        count, ratio_max, grad_norms = 0, -math.inf, []
        accum = self.trainer.resolve_grad_accum(num_rows) if hasattr(self.trainer, "resolve_grad_accum") else 1
        updated_this_step = False
        # The recompute ran the no-grad graph on epoch 0's micro-batches with these weights: until
        # the first optimizer step its log-probs ARE the value pass's (the mean's value, which the
        # KL needs, was not kept: with a KL term the value pass runs).
        reuse_recompute = (self.values_from_no_grad and self.algorithm.old_log_prob == "recompute"
                           and not self.algorithm.kl_beta > 0)
        transformer.train()
        for order in orders:
            micro_batches = self._micro_batches(order)
            groups = [micro_batches[i:i + accum] for i in range(0, len(micro_batches), accum)]
            for group in groups:
                for rows in group:
                    for k in range(num_train):
                        step_index = train_steps[rows, k]
                        known = old[rows, k] if reuse_recompute and not updated_this_step else None
                        result = self._score(tensors, rows, step_index, with_grad=True, known_log_prob=known)
                        kl = None
                        if self.algorithm.kl_beta > 0:
                            kl = kl_to_reference(result.mean, self._reference_mean(tensors, rows, step_index), result.std)
                        out = clipped_policy_loss(
                            result.log_prob, old[rows, k], advantages[rows], self.algorithm.clip_range,
                            kl=kl, kl_beta=self.algorithm.kl_beta, weights=weights[rows],
                        )
                        scaled = out.loss / (len(group) * num_train)
                        (self.scaler.scale(scaled) if self.scaler else scaled).backward()
                        if rollout_log_probs is not None and not updated_this_step and self.algorithm.old_log_prob == "rollout":
                            gaps.append((result.log_prob.detach().cpu() - rollout_log_probs[rows, k]).abs())
                        for name in ("policy_loss", "clipfrac", "ratio_mean", "approx_kl", "kl"):
                            sums[name] = sums.get(name, 0.0) + getattr(out, name)
                        ratio_max = max(ratio_max, out.ratio_max)
                        count += 1
                grad_norms.append(self._optimizer_step())
                updated_this_step = True
        transformer.eval()

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
