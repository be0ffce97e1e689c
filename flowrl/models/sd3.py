"""Stable Diffusion 3 / 3.5 adapter over the diffusers StableDiffusion3Pipeline components.

Latent layout: (16, H/8, W/8), the transformer's own input layout. Text: CLIP-L + CLIP-G + T5,
encoded by the pipeline's own `encode_prompt`; every prompt has the same fixed length
(77 + max_sequence_length), so no mask is needed and the stored mask is all True. The T5 length
defaults to 256, or to the checkpoint's T5 tokenizer's `model_max_length` when that is shorter
(the toy model's 16: every padding token is attended, so a model trained at one length must be
sampled at it).
Timestep scaling: the transformer takes sigma * 1000, in float32 whatever the model dtype, as
StableDiffusion3Pipeline passes its scheduler's timesteps: the transformer's sinusoidal timestep
embedding runs in float32 and casts to the model dtype only after it, so a bf16 timestep would
move the embedding's input by up to about 2 (of 1000) from what the model was trained with.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.models.base import (
    FlowModelAdapter,
    PromptEncoding,
    cfg_forward_inputs,
    combine_cfg,
    pad_encodings,
)
from flowrl.models.kl_vae import decode_kl_latents, prepare_kl_vae
from flowrl.models.schedule import schedule_sigmas

DEFAULT_TEXT_LENGTH = 256


def default_text_length(pipeline) -> int:
    """The T5 length a checkpoint is sampled at when none is asked for (module docstring)."""
    tokenizer = getattr(pipeline, "tokenizer_3", None)
    declared = getattr(tokenizer, "model_max_length", None) if tokenizer is not None else None
    return min(DEFAULT_TEXT_LENGTH, int(declared)) if declared else DEFAULT_TEXT_LENGTH


class SD3Adapter(FlowModelAdapter):
    family = "sd3"
    size_multiple = 16  # VAE factor 8 times patch size 2
    max_sequence_length_limit = 512  # T5's, as the pipeline allows
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

    def __init__(self, pipeline, device, dtype, max_sequence_length: int | None = None):
        if max_sequence_length is None:
            max_sequence_length = default_text_length(pipeline)
        super().__init__(pipeline, device, dtype, max_sequence_length)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.latent_channels = self.transformer.config.in_channels
        # SD3 crops its position embedding from a pos_embed_max_size^2 grid of patches.
        grid = self.transformer.config.pos_embed_max_size
        if grid:
            self.max_image_side = grid * self.transformer.config.patch_size * self.vae_scale_factor
        self._sigma_cache: dict[int, torch.Tensor] = {}
        self.vae_memory_format = prepare_kl_vae(self.vae, self.device)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device="cpu", dtype=torch.float32, max_sequence_length: int | None = None
    ):
        from diffusers import StableDiffusion3Pipeline

        from flowrl.models.loading import load_pipeline

        pipeline = load_pipeline(StableDiffusion3Pipeline, path, dtype)
        pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        for module in (
            pipeline.transformer,
            pipeline.vae,
            pipeline.text_encoder,
            pipeline.text_encoder_2,
            pipeline.text_encoder_3,
        ):
            if module is not None:
                module.requires_grad_(False).eval()
        return cls(pipeline, device, dtype, max_sequence_length)

    # --- text -------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[PromptEncoding]:
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        mask = torch.ones(embeds.shape[1], dtype=torch.bool, device=self.device)
        return [PromptEncoding(embeds[i], mask, pooled[i]) for i in range(len(prompts))]

    # --- latents and schedule ----------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        if num_steps not in self._sigma_cache:  # fixed shift: independent of the image size
            self._sigma_cache[num_steps] = schedule_sigmas(self.scheduler, num_steps)
        return self._sigma_cache[num_steps]

    # --- transformer ---------------------------------------------------------------------------
    def velocity(self, latents, sigmas, cond, uncond, guidance_scale, height, width, sigma_values=None):
        # sigma_values: unused; SD3's modulation depends on the prompt's pooled embedding too.
        hidden, timestep, encodings, cfg_rows = cfg_forward_inputs(latents, sigmas, cond, uncond)
        embeds, _, pooled = pad_encodings(encodings)
        out = self.transformer(
            hidden_states=hidden.to(self.dtype),
            timestep=timestep.float() * 1000.0,  # float32, as the pipeline (module docstring)
            encoder_hidden_states=embeds.to(self.dtype),
            pooled_projections=pooled.to(self.dtype),
            return_dict=False,
        )[0].float()
        return combine_cfg(out, len(cond), cfg_rows, guidance_scale, renormalize=False)

    # --- VAE -----------------------------------------------------------------------------------
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_kl_latents(self.vae, latents, self.vae_memory_format)
