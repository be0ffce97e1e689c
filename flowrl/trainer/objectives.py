"""The per-step policy objectives FlowGRPO trains with (`algorithm.policy_loss`), chosen once
before the update loop (`Objective.choose`). Each turns one trained step's scores into a per-row
term to minimize, before the row weights, the KL and the behaviour weight:

- `ppo_clip` (Flow-GRPO): ratio = exp(log p - log p_old), term = max(-A ratio, -A clip(ratio, 1 +- eps)).
- `grpo_guard` (GRPO-Guard, arXiv 2510.22319; verl-omni's GRPOGuardLoss): RatioNorm, with s the
  row's transition std and b = mean((mu - mu_old)^2) / (2 s^2),
      ratio = exp((log p - log p_old + b) * s)    ( = exp(mean(eps * (mu - mu_old))) )
  PPO-clipped, and the term divided by the step's -dt (verl-omni's gradient reweight, which
  divides by the micro-batch's mean sqrt(-dt) squared; here each row by its own).
- `dppo` (Flow-DPPO, arXiv 2606.11025; UniRL, verl-omni's FlowDPPOLoss): no clip; with
  D = mean((mu - mu_old)^2 / (2 s^2)), the exact per-step KL of the two Gaussians, a row's term
  -A ratio is dropped iff D >= tau and the ratio moves with the advantage (ratio > 1, A > 0 or
  ratio < 1, A < 0); corrective moves are kept.

Guard and DPPO compare the step's mean with the old policy's (`mu_old`), which the trainer
recomputes before the update (flowrl.trainer.update). The rollout's means are never stored, so
both need algorithm.old_log_prob=recompute (the config refuses the rest).

This module is tensor math only: the scores come from flowrl.trainer.logprob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.models.base import host_to_device


@dataclass
class Surrogate:
    """One trained step's per-row objective (B,) before the row weights (`terms`, to minimize),
    the ratio it used (B,), which rows its trust region acted on (B,) bool (clipped, or dropped by
    DPPO), and the old-to-new mean divergence D (B,) where the objective measures it (else None)."""

    terms: torch.Tensor
    ratio: torch.Tensor
    acted: torch.Tensor
    divergence: torch.Tensor | None = None


def _mean_over_elements(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).mean(dim=1)


def ppo_clip(log_prob, old_log_prob, advantages, clip_range: float) -> Surrogate:
    """Flow-GRPO's clipped surrogate; every tensor (B,)."""
    ratio = torch.exp(log_prob - old_log_prob)
    clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    terms = torch.maximum(-advantages * ratio, -advantages * clipped)
    return Surrogate(terms, ratio, (ratio - 1.0).abs() > clip_range)


def mean_divergence(mean, old_mean, std) -> torch.Tensor:
    """D = mean over elements of (mu - mu_old)^2 / (2 s^2), per row (B,); s the transition std (B,)."""
    return _mean_over_elements((mean - old_mean) ** 2) / (2.0 * std**2)


def ratio_norm(log_prob, old_log_prob, mean, old_mean, std, neg_dt, advantages, clip_range: float) -> Surrogate:
    """GRPO-Guard's RatioNorm surrogate (module docstring): log-probs, std, -dt and advantages
    (B,), the means (B, ...)."""
    bias = mean_divergence(mean, old_mean, std)
    ratio = torch.exp((log_prob - old_log_prob + bias) * std)
    clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    terms = torch.maximum(-advantages * ratio, -advantages * clipped) / neg_dt
    return Surrogate(terms, ratio, (ratio - 1.0).abs() > clip_range, bias.detach())


def dppo_drop(log_prob, old_log_prob, mean, old_mean, std, advantages, tau: float) -> Surrogate:
    """Flow-DPPO's surrogate with its drop rule (module docstring)."""
    ratio = torch.exp(log_prob - old_log_prob)
    divergence = mean_divergence(mean, old_mean, std).detach()
    moves_with_advantage = ((ratio > 1.0) & (advantages > 0)) | ((ratio < 1.0) & (advantages < 0))
    dropped = (divergence >= tau) & moves_with_advantage.detach()
    terms = torch.where(dropped, torch.zeros_like(ratio), -advantages * ratio)
    return Surrogate(terms, ratio, dropped, divergence)


class Objective:
    """algorithm.policy_loss, chosen once: `needs_old_means` says whether the update keeps the old
    policy's per-step means beside its denominators; calling it gives a forward's Surrogate."""

    def __init__(self, name: str, clip_range: float, tau: float):
        self.name, self.clip_range, self.tau = name, clip_range, tau
        self.needs_old_means = name != "ppo_clip"

    @classmethod
    def choose(cls, algorithm_cfg) -> "Objective":
        return cls(algorithm_cfg.policy_loss, algorithm_cfg.clip_range, algorithm_cfg.dppo_tau)

    def __call__(self, scored, old_log_prob, old_mean, advantages, neg_dt) -> Surrogate:
        """scored: the forward's flowrl.sampler.StepResult (with grad); old_log_prob (B,) and
        old_mean (B, ...) (None for ppo_clip) on any device; advantages, neg_dt (B,) host tensors."""
        device = scored.log_prob.device
        log_prob = scored.log_prob.float()
        old_log_prob = host_to_device(old_log_prob.detach(), device, torch.float32)
        advantages = host_to_device(advantages, device, torch.float32)
        if self.name == "ppo_clip":
            return ppo_clip(log_prob, old_log_prob, advantages, self.clip_range)
        mean, std = scored.mean.float(), scored.std.float()
        old_mean = host_to_device(old_mean.detach(), device, torch.float32)
        if self.name == "grpo_guard":
            neg_dt = host_to_device(neg_dt, device, torch.float32)
            return ratio_norm(log_prob, old_log_prob, mean, old_mean, std, neg_dt, advantages, self.clip_range)
        return dppo_drop(log_prob, old_log_prob, mean, old_mean, std, advantages, self.tau)
