"""The clipped PPO objective of FlowGRPO on per-(sample, step) log-probs, and its metrics.

For one trained denoising step of a micro-batch of samples:
    ratio = exp(log_prob - old_log_prob)
    loss  = mean(max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)))   (+ kl_beta * mean KL)
Rows with weight 0 (NaN rewards, dropped zero-std groups) are excluded from the means. The loss
that is optimized divides the weighted sums by `normalizer` when given: the weight of every
(row, step) pair of the whole optimizer step, so that a micro-batch's loss is its exact share of
that step's mean and every pair weighs the same however the rows were cut into micro-batches.

Metrics follow the Flow-GRPO reference: clipfrac = share of rows with |ratio - 1| > eps,
approx_kl = 0.5 * mean((log_prob - old_log_prob)^2).

This module is pure tensor math: the log-probs come from `flowrl.trainer.policy`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLossOutput:
    """loss: scalar tensor with grad (policy loss + kl_beta * kl, both divided by the normalizer
    when one is given); the rest are detached floats, means over this call's counted rows."""

    loss: torch.Tensor
    policy_loss: float
    clipfrac: float
    ratio_mean: float
    ratio_max: float
    approx_kl: float
    kl: float
    num_rows: int


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp_min(1.0)


def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    kl: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    weights: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate loss of one trained step; every tensor is (B,).

    kl: per-row KL to the reference (None when kl_beta is 0). weights: 1 for rows that count,
    0 for excluded rows (None: all count). normalizer: what the loss's weighted sums divide by
    (module docstring); None: this call's own weight, a plain weighted mean.
    """
    if not clip_range > 0:
        raise ValueError(f"algorithm.clip_range={clip_range} must be > 0 (e.g. 1e-4)")
    log_prob = log_prob.float()
    old_log_prob = old_log_prob.float().to(log_prob.device).detach()
    advantages = advantages.float().to(log_prob.device)
    weights = torch.ones_like(log_prob) if weights is None else weights.float().to(log_prob.device)

    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    surrogate = torch.maximum(unclipped, clipped)
    objective = surrogate if kl is None else surrogate + kl_beta * kl.float()
    scale = weights.sum().clamp_min(1.0) if normalizer is None else max(float(normalizer), 1e-12)
    loss = (objective * weights).sum() / scale
    policy_loss = _weighted_mean(surrogate, weights)
    kl_value = 0.0 if kl is None else float(_weighted_mean(kl.float(), weights).detach())

    with torch.no_grad():
        counted = weights > 0
        ratio_counted = ratio[counted] if counted.any() else ratio.new_ones(1)
        delta = (log_prob - old_log_prob)[counted] if counted.any() else ratio.new_zeros(1)
        return PolicyLossOutput(
            loss=loss,
            policy_loss=float(policy_loss.detach()),
            clipfrac=float(((ratio_counted - 1.0).abs() > clip_range).float().mean()),
            ratio_mean=float(ratio_counted.mean()),
            ratio_max=float(ratio_counted.max()),
            approx_kl=float(0.5 * (delta**2).mean()),
            kl=kl_value,
            num_rows=int(counted.sum()),
        )
