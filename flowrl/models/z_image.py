"""Z-Image adapter over the diffusers ZImagePipeline components.

Latent layout: (16, H/8, W/8), the VAE latent; the transformer takes each row as a one-frame
(16, 1, H/8, W/8) tensor and patchifies it itself (2x2 patches). Text: the pipeline's own
`encode_prompt` (chat template, Qwen3's second-to-last hidden states of the prompt's tokens),
variable length per prompt and never padded here: the transformer takes a list of captions, pads
each to a multiple of 32 itself and masks the padding between rows of a batch.
Schedule: the checkpoint's scheduler config over the pipeline's unshifted base
torch.linspace(1, 1/T, T), with mu from the image token count where the config shifts dynamically.
Timestep scaling: the transformer takes 1 - sigma (the pipeline's (1000 - t) / 1000, t = 1000 sigma).
Velocity: the transformer predicts x0 - noise; the pipeline negates it before the scheduler's
step, and so does `velocity` (flowrl's v is about noise - x0).

Guidance, as the pipeline does it, cond and uncond rows in one forward: the pipeline's
`guidance_scale` g_z gives cond + g_z (cond - uncond); flowrl's `guidance_scale` w is the usual CFG
weight, uncond + w (cond - uncond), the same prediction for w = g_z + 1 (so the pipeline's
default 5.0 is w = 6.0, and w > 1 adds the uncond row as g_z > 0 does). The pipeline's two call
options are adapter options here, off by default as there: `cfg_normalization` r > 0 scales a
guided sample down to r times its cond prediction's norm where it is longer (the pipeline's
`cfg_normalization=True` is r = 1), and `cfg_truncation` c < 1 drops guidance, and the uncond row,
at the steps where 1 - sigma > c.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.models.base import FlowModelAdapter, PromptEncoding, cfg_forward_inputs, combine_cfg, rows_to_device
from flowrl.models.kl_vae import decode_kl_latents, prepare_kl_vae
from flowrl.models.schedule import schedule_sigmas


class ZImageAdapter(FlowModelAdapter):
    family = "z_image"
    guidance_kind = "cfg"
    size_multiple = 16  # VAE factor 8 times the transformer's 2x2 patches
    # The single stream's attention projections (text and image tokens alike), in the main
    # blocks and both refiners.
    default_lora_targets = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")

    def __init__(
        self,
        pipeline,
        device,
        dtype,
        max_sequence_length: int = 512,
        cfg_normalization: float = 0.0,
        cfg_truncation: float = 1.0,
    ):
        super().__init__(pipeline, device, dtype, max_sequence_length)
        if not cfg_normalization >= 0.0:
            raise ValueError(
                f"cfg_normalization={cfg_normalization!r} must be >= 0 (0 turns it off; the pipeline's "
                "cfg_normalization=True is 1.0)"
            )
        if not cfg_truncation >= 0.0:
            raise ValueError(f"cfg_truncation={cfg_truncation!r} must be >= 0 (1.0 or more: never truncate)")
        self.cfg_normalization = float(cfg_normalization)
        self.cfg_truncation = float(cfg_truncation)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.latent_channels = self.transformer.config.in_channels
        self._sigma_cache: dict[tuple[int, int], torch.Tensor] = {}
        self.vae_memory_format = prepare_kl_vae(self.vae, self.device)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device="cpu",
        dtype=torch.float32,
        max_sequence_length: int = 512,
        cfg_normalization: float = 0.0,
        cfg_truncation: float = 1.0,
    ):
        from diffusers import ZImagePipeline

        from flowrl.models.loading import load_pipeline

        pipeline = load_pipeline(ZImagePipeline, path, dtype)
        pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        for module in (pipeline.transformer, pipeline.vae, pipeline.text_encoder):
            module.requires_grad_(False).eval()
        return cls(pipeline, device, dtype, max_sequence_length, cfg_normalization, cfg_truncation)

    # --- text -------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[PromptEncoding]:
        embeds, _ = self.pipeline.encode_prompt(
            prompt=list(prompts),
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return [PromptEncoding(e, torch.ones(e.shape[0], dtype=torch.bool, device=self.device)) for e in embeds]

    # --- latents and schedule ----------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        _, h, w = self.latent_shape(height, width)
        seq_len = (h // 2) * (w // 2)  # image tokens after the 2x2 patching: the pipeline's image_seq_len
        key = (num_steps, seq_len)
        if key not in self._sigma_cache:
            base = torch.linspace(1.0, 1.0 / num_steps, num_steps).tolist()
            self._sigma_cache[key] = schedule_sigmas(self.scheduler, num_steps, image_seq_len=seq_len, base_sigmas=base)
        return self._sigma_cache[key]

    # --- transformer ---------------------------------------------------------------------------
    def velocity(self, latents, sigmas, cond, uncond, guidance_scale, height, width, sigma_values=None):
        uncond = self._guided_uncond(uncond, sigmas, sigma_values)
        hidden, row_sigmas, encodings, cfg_rows = cfg_forward_inputs(latents, sigmas, cond, uncond)
        timestep = (1000.0 - row_sigmas.float() * 1000.0) / 1000.0  # float32, as the pipeline passes it
        out = self.transformer(
            list(hidden.to(self.dtype).unsqueeze(2).unbind(0)),
            timestep,
            [e.embeds.to(self.dtype) for e in encodings],
            return_dict=False,
        )[0]
        velocity = -torch.stack([frame.float() for frame in out]).squeeze(2)
        guided = combine_cfg(velocity, len(cond), cfg_rows, guidance_scale, renormalize=False)
        if self.cfg_normalization > 0.0 and cfg_rows:
            guided = self._clip_guided_norms(guided, velocity[: len(cond)], cfg_rows)
        return guided

    def _guided_uncond(self, uncond, sigmas, sigma_values):
        """`uncond` without the rows whose step the pipeline runs unguided (cfg_truncation): where
        its t_norm = (1000 - 1000 sigma) / 1000, in float32, exceeds cfg_truncation. Decided on the
        host from `sigma_values` (read from `sigmas` when the caller passed none)."""
        if self.cfg_truncation >= 1.0 or all(u is None for u in uncond):
            return uncond  # t_norm < 1 at every sigma > 0
        values = sigmas.tolist() if sigma_values is None else sigma_values
        t_norms = ((1000.0 - torch.tensor(values, dtype=torch.float32) * 1000.0) / 1000.0).tolist()
        return [None if t_norm > self.cfg_truncation else u for u, t_norm in zip(uncond, t_norms)]

    def _clip_guided_norms(self, guided: torch.Tensor, cond_v: torch.Tensor, cfg_rows: list[int]) -> torch.Tensor:
        """The pipeline's CFG normalization on the guided rows: a sample whose guided prediction
        is longer than cfg_normalization times its cond prediction is scaled down to that norm."""
        index = None if len(cfg_rows) == guided.shape[0] else rows_to_device(cfg_rows, guided.device)
        pick = (lambda t: t) if index is None else (lambda t: t.index_select(0, index))  # noqa: E731
        rows, cond_rows = pick(guided), pick(cond_v)
        dims = tuple(range(1, rows.dim()))
        max_norm = torch.linalg.vector_norm(cond_rows, dim=dims, keepdim=True) * self.cfg_normalization
        norm = torch.linalg.vector_norm(rows, dim=dims, keepdim=True)
        clipped = torch.where(norm > max_norm, rows * (max_norm / norm), rows)
        return clipped if index is None else guided.index_copy(0, index, clipped)

    # --- VAE -----------------------------------------------------------------------------------
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_kl_latents(self.vae, latents, self.vae_memory_format)
