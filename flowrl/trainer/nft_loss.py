"""DiffusionNFT's loss on one forward (arXiv 2509.16117; NVlabs scripts/train_nft_sd3.py).

For rows re-noised from their final latents x0 to x_t at noise level t, with the trained
velocity v, the old policy's v_old (no grad) and the reward's optimality weight
r = clamp(A / A_max / 2 + 1/2, 0, 1) (A the clamped group advantage):

    v+ = beta v + (1 - beta) v_old           v- = (1 + beta) v_old - beta v
    x0+ = x_t - t v+                         x0- = x_t - t v-
    w+- = sg(mean |x0+- - x0|), at least 1e-5 (the reference's adaptive weights, in float64)
    loss_row = A_max (r mean((x0+ - x0)^2) / w+ + (1 - r) mean((x0- - x0)^2) / w-) / beta
               + kl_beta mean((v - v_ref)^2)

Positive samples pull v towards x0 along v+, negative ones push along v- (the implicit negative
policy); beta scales how far v may move from v_old. Means are over each row's latent elements.
This module is the formula alone, on tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_FLOOR = 1e-5  # the reference's lower clip of the adaptive weights


@dataclass
class NftLossOutput:
    """Per row (B,): the loss (policy term + KL term), the policy term, the KL term (0 without a
    reference) and mean((v - v_old)^2), how far the trained velocity moved from the old one."""

    loss: torch.Tensor
    policy: torch.Tensor
    kl: torch.Tensor
    old_deviation: torch.Tensor


def optimality_weight(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = clamp(clamp(A, +-A_max) / A_max / 2 + 1/2, 0, 1): 1 for the best samples, 0 for the worst."""
    clipped = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (clipped / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def nft_loss(
    velocity: torch.Tensor,
    old_velocity: torch.Tensor,
    x0: torch.Tensor,
    x_t: torch.Tensor,
    sigma: torch.Tensor,
    advantages: torch.Tensor,
    beta: float,
    adv_clip_max: float,
    kl_beta: float = 0.0,
    reference_velocity: torch.Tensor | None = None,
) -> NftLossOutput:
    """The loss of each row (module docstring); float32 inputs, sigma and advantages (B,)."""
    dims = tuple(range(1, x0.dim()))
    t = sigma.view(-1, *([1] * len(dims)))
    old = old_velocity.detach()
    positive = x_t - t * (beta * velocity + (1.0 - beta) * old)
    negative = x_t - t * ((1.0 + beta) * old - beta * velocity)
    with torch.no_grad():
        w_pos = (positive.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=WEIGHT_FLOOR)
        w_neg = (negative.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=WEIGHT_FLOOR)
    pos_loss = ((positive - x0) ** 2 / w_pos).mean(dim=dims)
    neg_loss = ((negative - x0) ** 2 / w_neg).mean(dim=dims)
    r = optimality_weight(advantages, adv_clip_max)
    policy = adv_clip_max * (r * pos_loss + (1.0 - r) * neg_loss) / beta
    policy = policy.float()
    if reference_velocity is None or kl_beta == 0.0:
        kl = torch.zeros_like(policy)
    else:
        kl = ((velocity - reference_velocity.detach()) ** 2).mean(dim=dims)
    with torch.no_grad():
        old_deviation = ((velocity - old) ** 2).mean(dim=dims)
    return NftLossOutput(policy + kl_beta * kl, policy, kl, old_deviation)
