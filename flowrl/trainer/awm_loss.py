"""AWM's loss on one forward (Advantage Weighted Matching, arXiv 2509.25050; reference
scxue/advantage_weighted_matching scripts/train_sd3_awm.py `compute_log_prob_awm` and its loss).

For rows re-noised from their final latents x0 with noise eps to x_t at noise level t, the
flow-matching error l = mean((v - (eps - x0))^2) becomes a surrogate log-likelihood
logp = -w(l, t) by the chosen timestep weighting:

    uniform: l      t: t l      t2: t^2 l      huber: t (sqrt(l + 1e-10) - 1e-5)
    ghuber:  t ((l + 1e-10)^p - 1e-10^p) / p        (the reference's GenEval and OCR setting, p = 0.25)

and the policy term is PPO's on ratio = exp(logp - logp_old) with the advantage A clamped to
+-A_clip and rescaled to +-A_max: max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)). On the first
optimizer step ratio = 1 and the gradient is A grad w: the pretraining loss weighted by the
advantage. Two KL terms on the velocity keep it near the LoRA-disabled reference and near an EMA of
the trained weights: kl_beta mean((v - v_ref)^2) + ema_kl_beta mean((v - v_ema)^2). Means are over
each row's latent elements; this module is the formula alone.
"""

from __future__ import annotations

import torch

WEIGHTINGS = ("ghuber", "uniform", "t", "t2", "huber")


def surrogate_log_prob(
    velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor, weighting: str, power: float
) -> torch.Tensor:
    """-w(l, t) per row (B,) in float64 (module docstring)."""
    dims = tuple(range(1, x0.dim()))
    error = ((velocity.double() - (noise.double() - x0.double())) ** 2).mean(dim=dims)
    t = sigma.double()
    if weighting == "uniform":
        return -error
    if weighting == "t":
        return -error * t
    if weighting == "t2":
        return -error * t**2
    if weighting == "huber":
        return -(torch.sqrt(error + 1e-10) - 1e-5) * t
    if weighting == "ghuber":
        floor = torch.tensor(1e-10, dtype=torch.float64, device=error.device)
        return -((error + 1e-10) ** power - floor**power) * t / power
    raise ValueError(f"algorithm.awm.weighting={weighting!r} is unknown; use one of {', '.join(WEIGHTINGS)}")


def awm_advantages(advantages: torch.Tensor, adv_clip_max: float, advantage_max: float) -> torch.Tensor:
    """A clamped to +-adv_clip_max, then rescaled to +-advantage_max."""
    return advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max * advantage_max


def awm_policy_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-row clipped policy loss, ratio, whether the ratio left the clip range)."""
    ratio = torch.exp(log_prob - old_log_prob.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio, ((ratio - 1.0).abs() > clip_range)


def velocity_kl(velocity: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """mean((v - target)^2) per row; zeros without a target."""
    if target is None:
        return torch.zeros(velocity.shape[0], device=velocity.device)
    return ((velocity - target.detach()) ** 2).mean(dim=tuple(range(1, velocity.dim())))
