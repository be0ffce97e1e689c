"""Decoding with diffusers' AutoencoderKL, the VAE of SD3, FLUX and Z-Image.

Latents are (B, C, H/8, W/8) in the transformer's scale: the VAE sees latents / scaling_factor +
shift_factor (both from the checkpoint's VAE config). On CUDA the VAE runs channels-last: cuDNN's
convolutions run NHWC there, and an NCHW VAE makes every convolution transpose its input and
output, a sizeable share of a short rollout's device time.
"""

from __future__ import annotations

import torch

from flowrl.models.base import to_uint8


def prepare_kl_vae(vae: torch.nn.Module, device: torch.device) -> torch.memory_format:
    """Put `vae` in the memory format its convolutions run fastest in on `device`; returns it."""
    memory_format = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    vae.to(memory_format=memory_format)
    return memory_format


@torch.no_grad()
def decode_kl_latents(vae: torch.nn.Module, latents: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """(B, C, h, w) transformer-scale latents -> (B, 3, 8h, 8w) uint8 images."""
    config = vae.config
    scaled = latents / config.scaling_factor + config.shift_factor
    scaled = scaled.to(vae.dtype).contiguous(memory_format=memory_format)
    image = vae.decode(scaled, return_dict=False)[0]
    return to_uint8(image)
