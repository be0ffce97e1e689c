"""Qwen-Image adapter over the diffusers QwenImagePipeline components.

Latent layout: packed (H/16 * W/16, 64) tokens (2x2 patches of the 16-channel VAE latent), the
transformer's input layout; noise is drawn in the unpacked (16, H/8, W/8) layout and packed, so a
seed gives the same start as the pipeline. Text: Qwen2.5-VL hidden states through the pipeline's
own chat-template encoder, variable length per prompt; batched rows are right-padded and masked.
Schedule: dynamic shift with mu from the packed image token count. Timestep scaling: sigma.
CFG is "true CFG" with the guided vector rescaled to the cond vector's norm, as the pipeline does.
Compiling (flowrl.accel.compile_adapter) sets `pads_single_row`, the one place where the fast path
meets the adapter; without it the transformer runs as diffusers wrote it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.models.base import PromptEncoding, cfg_forward_inputs, combine_cfg, pad_encodings, to_uint8
from flowrl.models.packed import PackedLatentAdapter, pack_2x2, unpack_2x2
from flowrl.models.qwen_text_mask import avoid_scalar_copy
from flowrl.models.qwen_vae import decode_single_frames_in_2d, single_frame_2d


class QwenImageAdapter(PackedLatentAdapter):
    family = "qwen_image"
    size_multiple = 16  # VAE factor 8 times the 2x2 packing
    max_sequence_length_limit = 1024
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
    )
    # Set by flowrl.accel.compile_adapter (flowrl.accel.qwen_image): a batch of one runs as two
    # identical rows (row 0 kept), so that compiled blocks reuse their batch >= 2 graph. Results stay
    # the same function of the inputs either way.
    pads_single_row = False

    def __init__(self, pipeline, device, dtype, max_sequence_length: int = 1024, true_cfg_renorm: bool = True):
        super().__init__(pipeline, device, dtype, max_sequence_length)
        self.true_cfg_renorm = true_cfg_renorm
        self.vae_scale_factor = 2 ** len(self.vae.temperal_downsample)
        self.latent_channels = self.vae.config.z_dim
        # RoPE positions come from a table of P positions: an image of t tokens a side takes
        # t / 2 on each side of 0, and the text follows at t / 2 .. t / 2 + text length.
        positions = self.transformer.pos_embed.pos_freqs.shape[0]
        max_tokens = 2 * (positions - max_sequence_length)
        self.max_image_side = max_tokens * 2 * self.vae_scale_factor  # 2x2 packing of VAE latents
        decode_single_frames_in_2d(self.vae)  # taken only inside `decode` (see flowrl/models/qwen_vae.py)
        avoid_scalar_copy()  # a padded batch's forward does not wait for the device (flowrl/models/qwen_text_mask.py)

    @classmethod
    def from_pretrained(cls, path: str | Path, device="cpu", dtype=torch.float32, max_sequence_length: int = 1024):
        from diffusers import QwenImagePipeline

        from flowrl.models.loading import load_pipeline

        pipeline = load_pipeline(QwenImagePipeline, path, dtype)
        pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        for module in (pipeline.transformer, pipeline.vae, pipeline.text_encoder):
            module.requires_grad_(False).eval()
        return cls(pipeline, device, dtype, max_sequence_length)

    # --- text -------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[PromptEncoding]:
        embeds, mask = self.pipeline.encode_prompt(
            prompt=list(prompts), device=self.device, max_sequence_length=self.max_sequence_length
        )
        lengths = [embeds.shape[1]] * len(prompts) if mask is None else mask.sum(dim=1).tolist()
        out = []
        for row, length in enumerate(lengths):
            length = int(length)
            row_mask = torch.ones(length, dtype=torch.bool, device=self.device)
            out.append(PromptEncoding(embeds[row, :length], row_mask, None))
        return out

    # --- latents and schedule: flowrl.models.packed ---------------------------------------------
    def pack(self, latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, C, h, w) -> (B, h/2 * w/2, 4C): each token is a 2x2 patch, channel-major."""
        return pack_2x2(latents)

    def unpack(self, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Inverse of pack: (B, h/2 * w/2, 4C) -> (B, C, h, w)."""
        return unpack_2x2(tokens, h, w)

    # --- transformer ---------------------------------------------------------------------------
    def velocity(self, latents, sigmas, cond, uncond, guidance_scale, height, width, sigma_values=None):
        hidden, timestep, encodings, cfg_rows = cfg_forward_inputs(latents, sigmas, cond, uncond)
        embeds, mask, _ = pad_encodings(encodings)
        # Lengths are known on the host, so deciding whether a mask is needed costs no sync;
        # without padding we pass no mask (the pipeline does the same, and fast kernels apply).
        lengths = [e.embeds.shape[0] for e in encodings]
        padded_text = len(set(lengths)) > 1
        h, w = self._latent_hw(height, width)
        rows = hidden.shape[0]
        padded = self.pads_single_row and rows == 1
        repeat = (lambda t: torch.cat([t, t])) if padded else (lambda t: t)  # noqa: E731
        out = self.transformer(
            hidden_states=repeat(hidden.to(self.dtype)),
            timestep=repeat(timestep.to(self.dtype)),
            encoder_hidden_states=repeat(embeds.to(self.dtype)),
            encoder_hidden_states_mask=repeat(mask) if padded_text else None,
            img_shapes=[[(1, h // 2, w // 2)]] * (rows + padded),
            return_dict=False,
        )[0][:rows].float()
        return combine_cfg(out, len(cond), cfg_rows, guidance_scale, renormalize=self.true_cfg_renorm)

    # --- VAE -----------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        x = self.unpack(latents, h, w)[:, :, None]  # (B, C, 1, h, w): one video frame
        config = self.vae.config
        mean = torch.tensor(config.latents_mean, device=x.device, dtype=torch.float32).view(1, -1, 1, 1, 1)
        std = torch.tensor(config.latents_std, device=x.device, dtype=torch.float32).view(1, -1, 1, 1, 1)
        x = x * std + mean
        with single_frame_2d():  # an image is one frame: 2D convolutions, a third of the FLOPs
            image = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0][:, :, 0]
        return to_uint8(image)
