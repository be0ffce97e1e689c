"""Diffusion-DPO's loss on a batch of preference pairs (arXiv 2311.12908 in flow matching's form,
as flow_grpo's scripts/train_sd3_dpo.py computes it).

Chosen and rejected samples x0_w, x0_l of one prompt are re-noised with the same noise eps and
noise level t; with u = eps - x0 the flow-matching target,

    err(x) = mean((v_theta(x_t) - u)^2),   err_ref(x) = mean((v_ref(x_t) - u)^2)
    loss = -log sigmoid(-(beta / 2) ((err(x_w) - err_ref(x_w)) - (err(x_l) - err_ref(x_l))))

the trained model is pushed to fit the chosen sample better than the reference does, and the
rejected one worse. This module is the formula alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def flow_errors(velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """mean((v - (eps - x0))^2) per row, float32."""
    return ((velocity.float() - (noise - x0).float()) ** 2).flatten(1).mean(dim=1)


def dpo_loss(errors: torch.Tensor, reference_errors: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per pair, margin per pair) for errors (2B,) laid out chosen rows first, then their
    rejected partners in the same order; margin = -(diff_w - diff_l) > 0 when the model prefers
    the chosen sample more than the reference does."""
    half = errors.shape[0] // 2
    diff = errors - reference_errors.detach()
    margin = -(diff[:half] - diff[half:])
    return -F.logsigmoid(0.5 * beta * margin), margin
