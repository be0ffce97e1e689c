"""Adapters whose transformer takes 2x2-packed latent tokens (Qwen-Image, FLUX).

The packed layout: (h/2 * w/2, 4C) tokens, each a 2x2 patch of the C-channel VAE latent
(h, w = image size / VAE factor), channel-major. `PackedLatentAdapter` holds what both families
share: the latent shape, seeded noise drawn in the unpacked (1, C, h, w) layout and packed (so a
seed gives the pipelines' start), and the schedule both pipelines use: sigmas linspace(1, 1/T, T)
shifted by the checkpoint's resolution-dependent shift, mu from the packed token count, cached per
(steps, token count). A subclass sets `vae_scale_factor` and `latent_channels`.
"""

from __future__ import annotations

import torch

from flowrl.models.base import FlowModelAdapter
from flowrl.models.schedule import schedule_sigmas


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): each token a 2x2 patch, channel-major."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of pack_2x2: (B, h/2 * w/2, 4C) -> (B, C, h, w)."""
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


class PackedLatentAdapter(FlowModelAdapter):
    vae_scale_factor: int
    latent_channels: int

    def __init__(self, pipeline, device, dtype: torch.dtype, max_sequence_length: int):
        super().__init__(pipeline, device, dtype, max_sequence_length)
        self._sigma_cache: dict[tuple[int, int], torch.Tensor] = {}

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        h, w = self._latent_hw(height, width)
        return ((h // 2) * (w // 2), self.latent_channels * 4)

    def initial_noise(self, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        noise = torch.randn(
            (1, self.latent_channels, h, w), generator=generator, dtype=torch.float32, device=generator.device
        )
        return pack_2x2(noise)[0]

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        seq_len = self.latent_shape(height, width)[0]
        key = (num_steps, seq_len)
        if key not in self._sigma_cache:
            self._sigma_cache[key] = schedule_sigmas(self.scheduler, num_steps, image_seq_len=seq_len, linear_base=True)
        return self._sigma_cache[key]
