"""DiffusionOutput: what the engine returns for one sample (FLOWGRPO.md section 3).

`sigmas[k]` is the noise level in [0, 1] at which SDE-window step k starts, `next_sigmas[k]` the
one it ends at. The trainer recomputes step k from (all_latents[k], sigmas[k], next_sigmas[k]) and
scores all_latents[k + 1]. This module is the output's contract only: it knows nothing about
models, scheduling or training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DiffusionOutput:
    """One generated sample.

    image: (3, H, W) uint8.
    all_latents: (W + 1, *latent_shape) float32: the latent entering the SDE window, then the
        latent after each window step (latent layout is the adapter's model-input layout).
    all_log_probs: (W,) float32 log-prob of each window transition (mean over latent elements),
        or None when log-probs were not requested.
    sigmas / next_sigmas: (W,) float32 noise levels at the start / end of each window step.
    prompt_embeds (L, D) model dtype; prompt_embeds_mask (L,) bool; pooled_prompt_embeds (P,) or
        None (SD3 only). negative_*: the same for the uncond row, None without CFG.
    seed: the seed of this sample's generator. policy_version: the engine's policy version when
        the sample was admitted. sde_window: (start, end) step indices.
    guidance_scale, true_cfg_scale: the guidance settings it was drawn with (SamplingParams).
    timings: seconds spent queued, denoising and decoding.
    """

    prompt: str
    image: torch.Tensor
    all_latents: torch.Tensor
    all_log_probs: torch.Tensor | None
    sigmas: torch.Tensor
    next_sigmas: torch.Tensor
    prompt_embeds: torch.Tensor
    prompt_embeds_mask: torch.Tensor
    pooled_prompt_embeds: torch.Tensor | None
    negative_prompt_embeds: torch.Tensor | None
    negative_prompt_embeds_mask: torch.Tensor | None
    negative_pooled_prompt_embeds: torch.Tensor | None
    seed: int
    policy_version: int
    sde_window: tuple[int, int]
    guidance_scale: float
    true_cfg_scale: float = 1.0
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        # One home for the contract's invariants.
        num_window = self.sigmas.shape[0]
        assert self.image.dtype == torch.uint8 and self.image.dim() == 3 and self.image.shape[0] == 3
        assert self.all_latents.dtype == torch.float32
        assert self.all_latents.shape[0] == num_window + 1
        assert self.next_sigmas.shape == self.sigmas.shape
        if self.all_log_probs is not None:
            assert self.all_log_probs.shape == (num_window,)
            assert self.all_log_probs.dtype == torch.float32
        assert self.prompt_embeds_mask.dtype == torch.bool
        assert self.prompt_embeds_mask.shape[0] == self.prompt_embeds.shape[0]
