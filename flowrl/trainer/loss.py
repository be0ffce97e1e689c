"""The clipped PPO objective of FlowGRPO on per-(sample, step) log-probs, and its metrics.

For one trained denoising step of a micro-batch of samples:
    ratio = exp(log_prob - old_log_prob)
    loss  = mean(max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)))   (+ kl_beta * mean KL)
With samples drawn by older weights than the update starts from (decoupled PPO: AReaL, arXiv
2505.24298, eq. 5; truncated as verl's rollout correction), `old_log_prob` is the proximal policy's
(the weights the update starts from) and each pair's term is weighted by the behaviour weight
    w = min(exp(old_log_prob - behaviour_log_prob), cap)   (detached)
so the clip is centred on the proximal policy and the behaviour policy enters only through w
(a fresh row passes its old_log_prob as its behaviour log-prob: w = 1 exactly).
Rows with weight 0 (NaN rewards, dropped zero-std groups) are excluded from the means. The loss
that is optimized divides the weighted sums by `normalizer` when given: the weight of every
(row, step) pair of the whole optimizer step, so that a micro-batch's loss is its exact share of
that step's mean and every pair weighs the same however the rows were cut into micro-batches.

Metrics follow the Flow-GRPO reference: clipfrac = share of rows with |ratio - 1| > eps,
approx_kl = 0.5 * mean((log_prob - old_log_prob)^2). The other objectives of
`algorithm.policy_loss` (flowrl.trainer.objectives) hand in their own per-row terms and ratios in
place of the clipped ones; clipfrac is then the share their trust region acted on (DPPO: dropped),
and divergence the mean old-to-new divergence D they measured.

This module is pure tensor math: the log-probs come from `flowrl.trainer.logprob`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.models.base import host_to_device
from flowrl.trainer.objectives import Surrogate, ppo_clip


@dataclass
class PolicyLossOutput:
    """loss: scalar tensor with grad (policy loss + kl_beta * kl, both divided by the normalizer
    when one is given). The metrics are detached 0-d tensors on the loss's device, means over this
    call's counted rows (with none: the on-policy values, ratio 1 and the rest 0): reading them
    waits for the device, so a loop of forwards reads them once, after the loop. num_rows: the
    counted rows, a host int (from host weights: no device read). divergence: the mean D of
    flowrl.trainer.objectives (0 where the objective measures none). behaviour_weight /
    behaviour_capped: with a behaviour log-prob, the mean weight and the share of rows the cap
    truncated (else None)."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    clipfrac: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_max: torch.Tensor
    approx_kl: torch.Tensor
    kl: torch.Tensor
    num_rows: int
    divergence: torch.Tensor | None = None
    behaviour_weight: torch.Tensor | None = None
    behaviour_capped: torch.Tensor | None = None


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
    behaviour_log_prob: torch.Tensor | None = None,
    behaviour_weight_cap: float = 5.0,
    surrogate: Surrogate | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate loss of one trained step; every tensor is (B,).

    kl: per-row KL to the reference (None when kl_beta is 0). weights: 1 for rows that count,
    0 for excluded rows (None: all count). normalizer: what the loss's weighted sums divide by
    (module docstring); None: this call's own weight, a plain weighted mean. behaviour_log_prob:
    the log-probs of the policy that drew each row, for decoupled PPO (module docstring; None: the
    rows were drawn by the old_log_prob policy, plain PPO). surrogate: the per-row objective of another
    algorithm.policy_loss (flowrl.trainer.objectives; None: the clipped ratio above). Nothing here waits
    for the device when `weights` is a host tensor (or None): host inputs are copied to the
    log-prob's device without blocking.
    """
    if not clip_range > 0:
        raise ValueError(f"algorithm.clip_range={clip_range} must be > 0 (e.g. 1e-4)")
    device = log_prob.device
    num_rows = int(log_prob.shape[0]) if weights is None else int((weights > 0).sum())
    log_prob = log_prob.float()
    old_log_prob = host_to_device(old_log_prob.detach(), device, torch.float32)
    advantages = host_to_device(advantages, device, torch.float32)
    weights = torch.ones_like(log_prob) if weights is None else host_to_device(weights, device, torch.float32)

    if surrogate is None:
        surrogate = ppo_clip(log_prob, old_log_prob, advantages, clip_range)
    ratio, acted, divergence = surrogate.ratio, surrogate.acted, surrogate.divergence
    surrogate = surrogate.terms
    behaviour_weight = None
    if behaviour_log_prob is not None:
        behaviour_log_prob = host_to_device(behaviour_log_prob.detach(), device, torch.float32)
        behaviour_weight = torch.exp(old_log_prob - behaviour_log_prob).clamp(max=behaviour_weight_cap)
        surrogate = surrogate * behaviour_weight
    objective = surrogate if kl is None else surrogate + kl_beta * kl.float()
    scale = weights.sum().clamp_min(1.0) if normalizer is None else max(float(normalizer), 1e-12)
    loss = (objective * weights).sum() / scale

    with torch.no_grad():
        counted = (weights > 0).float()
        share = counted / max(num_rows, 1)  # a mean over the counted rows (0 with none)
        delta = log_prob - old_log_prob
        if num_rows:
            ratio_mean = (ratio * share).sum()
            ratio_max = torch.where(counted > 0, ratio, torch.full_like(ratio, -torch.inf)).max()
        else:
            ratio_mean = ratio_max = torch.ones((), device=device)
        return PolicyLossOutput(
            loss=loss,
            policy_loss=_weighted_mean(surrogate, weights).detach(),
            clipfrac=(acted.float() * share).sum(),
            ratio_mean=ratio_mean,
            ratio_max=ratio_max,
            approx_kl=0.5 * (delta**2 * share).sum(),
            kl=torch.zeros((), device=device) if kl is None else _weighted_mean(kl.float(), weights).detach(),
            num_rows=num_rows,
            divergence=torch.zeros((), device=device) if divergence is None else (divergence.float() * share).sum(),
            behaviour_weight=None if behaviour_weight is None else (behaviour_weight * share).sum(),
            behaviour_capped=None
            if behaviour_weight is None
            else ((behaviour_weight >= behaviour_weight_cap).float() * share).sum(),
        )
