"""The transformer's velocity for rows of a stored rollout batch, at latents and noise levels the
caller chooses.

The forward-process algorithms (DiffusionNFT, AWM, online Diffusion-DPO) train on a sample's final
latent re-noised, x_t = (1 - t) x0 + t eps (`renoise`), and compare velocities there: this module
runs the transformer on such latents with the rows' stored prompt encodings (`prompt_encodings`,
each row trimmed to its own length so a micro-batch is padded as the engine padded it), the cond
row alone (these algorithms train without classifier-free guidance) and each row's guidance
embedding where the family has one. FlowGRPO's rescoring (flowrl.trainer.logprob) takes its
encodings from here too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flowrl.engine.output import TransitionSpec
from flowrl.models.base import FlowModelAdapter, PromptEncoding, host_to_device, mixed_precision


def prompt_encodings(tensors: dict[str, torch.Tensor], prefix: str, device) -> list[PromptEncoding]:
    """Per-row PromptEncodings from stacked (right-padded) embeddings: each row trimmed back to
    its own length (last True of its mask), so the adapter pads a micro-batch exactly as the
    engine padded its forward. Each stacked tensor goes to the device in one copy that does not
    wait for the device (host_to_device), and the rows are views of it."""
    mask = tensors[f"{prefix}prompt_embeds_mask"].bool()
    width = mask.shape[1]
    # Lengths from the host mask (no device read-back); an all-False row keeps the full width.
    last_true = width - 1 - mask.flip(1).int().argmax(dim=1)
    lengths = torch.where(mask.any(dim=1), last_true + 1, torch.full_like(last_true, width)).tolist()
    embeds = host_to_device(tensors[f"{prefix}prompt_embeds"], device)
    mask = host_to_device(mask, device)
    pooled = tensors.get(f"{prefix}pooled_prompt_embeds")
    pooled = None if pooled is None else host_to_device(pooled, device)
    return [
        PromptEncoding(embeds[row, :length], mask[row, :length], None if pooled is None else pooled[row])
        for row, length in enumerate(lengths)
    ]


def renoise(x0: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """x_sigma = (1 - sigma) x0 + sigma noise, sigma (B,) per row: the flow-matching forward process."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    return (1.0 - s) * x0 + s * noise


def conditional_velocity(
    adapter: FlowModelAdapter,
    tensors: dict[str, torch.Tensor],
    latents: torch.Tensor,
    sigma: torch.Tensor,
    specs: Sequence[TransitionSpec],
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """v(latents, sigma | prompt) (B, ...) float32 for the rows of `tensors` (a micro-batch of a
    rollout batch, host tensors), `latents` on the device, `sigma` (B,) a host tensor (the engine
    passes its sigmas as host floats too), `specs` the settings each row was drawn with (one size
    for all). Gradients flow when called with grad enabled."""
    device = adapter.device
    sizes = {(s.height, s.width, s.num_frames) for s in specs}
    if len(sizes) != 1:
        raise ValueError(f"rows of one forward were drawn at different sizes {sorted(sizes)}; pass one size")
    height, width, _ = sizes.pop()
    guidance = host_to_device(torch.tensor([s.guidance_scale for s in specs], dtype=torch.float32), device)
    cond = prompt_encodings(tensors, "", device)
    sigma_values = sigma.tolist()
    with mixed_precision(device, autocast_dtype):
        velocity = adapter.velocity(
            latents,
            host_to_device(sigma.float(), device),
            cond,
            [None] * len(cond),
            torch.ones_like(guidance),
            height,
            width,
            sigma_values=sigma_values,
            **adapter.guidance_embedding_kwargs(guidance),
        )
    return velocity.float()
