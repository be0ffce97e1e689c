"""FLUX.1 [dev] adapter over the diffusers FluxPipeline components.

Latent layout: packed (H/16 * W/16, 64) tokens (2x2 patches of the 16-channel VAE latent), the
transformer's input layout; noise is drawn unpacked (1, 16, H/8, W/8) and packed, so a seed gives
the pipeline's start. Positions for the transformer's RoPE: `img_ids` (0, row, column) of each
patch and `txt_ids` (zeros), built as the pipeline builds them and kept on the device per shape.
Text: CLIP-L's pooled embedding plus T5-XXL's hidden states through the pipeline's own
`encode_prompt`; every prompt is padded to max_sequence_length T5 tokens (512 by default, as the
pipeline), attended unmasked as the pipeline does, so the stored mask is all True.
Schedule: sigmas linspace(1, 1/T, T), as the pipeline passes them, shifted by the checkpoint's
resolution-dependent shift with mu from the packed image token count (its `calculate_shift`).
Guidance is "distilled" (flowrl.models.base): guidance_scale feeds the transformer's guidance
embedding, one row per sample; true_cfg_scale > 1 adds each sample's uncond row (the negative
prompt, with the same guidance value) to the same forward, v = v_u + g (v_c - v_u).
Timestep: the pipeline's timestep is sigma * 1000 in float32, cast to the model dtype and divided
by 1000 there; the transformer multiplies by 1000 again. The adapter passes the same value, so the
rounding matches the pipeline's in every dtype.
Attention gradients: a single-stream block concatenates its attention output with its MLP branch,
so the gradient reaching its attention is a strided slice, while the double-stream blocks' is
contiguous, at the same shapes. cuDNN's attention backward reuses the plan it built for a shape
whatever that gradient's strides, and a plan built on the strided one read out of bounds on the
contiguous one: an eager training step ended with an illegal memory access (benchmarks/results/
says where it was seen). The adapter hands each single-stream block's attention gradient on
contiguous (`contiguous_gradient`), in the layout of the attention's output; the forward is the
same tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.models.base import (
    PromptEncoding,
    cfg_forward_inputs,
    combine_cfg,
    pad_encodings,
    with_cfg_rows,
)
from flowrl.models.kl_vae import decode_kl_latents, prepare_kl_vae
from flowrl.models.packed import PackedLatentAdapter, unpack_2x2

# FluxPipeline refuses longer T5 prompts (its check_inputs).
MAX_T5_TOKENS = 512


class _ContiguousGradient(torch.autograd.Function):
    """The identity; its backward hands the gradient on contiguous."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def contiguous_gradient(module, args, output):
    """Forward hook on a single-stream block's attention (module docstring, "Attention gradients")."""
    if torch.is_tensor(output) and output.requires_grad:
        return _ContiguousGradient.apply(output)
    return output


class FluxAdapter(PackedLatentAdapter):
    family = "flux"
    size_multiple = 16  # VAE factor 8 times the 2x2 packing
    guidance_kind = "distilled"
    max_sequence_length_limit = MAX_T5_TOKENS
    # Flow-GRPO's FLUX LoRA targets (yifan123/flow_grpo, scripts/train_flux.py): both streams'
    # attention projections and both MLPs of the double-stream blocks; `attn.to_q/k/v` also match
    # the single-stream blocks' attention.
    default_lora_targets = (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )

    def __init__(self, pipeline, device, dtype, max_sequence_length: int = MAX_T5_TOKENS):
        super().__init__(pipeline, device, dtype, max_sequence_length)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.latent_channels = self.transformer.config.in_channels // 4
        self.has_guidance_embedding = bool(self.transformer.config.guidance_embeds)
        self._position_ids: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.vae_memory_format = prepare_kl_vae(self.vae, self.device)
        for block in self.transformer.single_transformer_blocks:
            block.attn.register_forward_hook(contiguous_gradient)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device="cpu", dtype=torch.float32, max_sequence_length: int = MAX_T5_TOKENS
    ):
        from diffusers import FluxPipeline

        from flowrl.models.loading import load_pipeline

        pipeline = load_pipeline(FluxPipeline, path, dtype)
        pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        for module in (pipeline.transformer, pipeline.vae, pipeline.text_encoder, pipeline.text_encoder_2):
            module.requires_grad_(False).eval()
        return cls(pipeline, device, dtype, max_sequence_length)

    def check_guidance(self, params) -> None:
        super().check_guidance(params)
        if not self.has_guidance_embedding and params.guidance_scale != 1.0:
            raise ValueError(
                f"SamplingParams.guidance_scale={params.guidance_scale} has no effect: this FLUX "
                "transformer has no guidance embedding (guidance_embeds is false, as in FLUX.1 "
                "[schnell]); leave guidance_scale at 1.0 (true_cfg_scale > 1 adds a negative-prompt row)"
            )

    # --- text -------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[PromptEncoding]:
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        mask = torch.ones(embeds.shape[1], dtype=torch.bool, device=self.device)
        return [PromptEncoding(embeds[i], mask, pooled[i]) for i in range(len(prompts))]

    # --- latents and schedule: flowrl.models.packed; positions -----------------------------------
    def position_ids(self, height: int, width: int, text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(txt_ids (L, 3), img_ids (h/2 * w/2, 3)) on the device in the model dtype, as the
        pipeline builds them; kept per shape, so a step copies nothing from the host."""
        h, w = self._latent_hw(height, width)
        key = (h, w, text_len)
        if key not in self._position_ids:
            txt_ids = torch.zeros(text_len, 3, device=self.device, dtype=self.dtype)
            img_ids = self.pipeline._prepare_latent_image_ids(None, h // 2, w // 2, self.device, self.dtype)
            self._position_ids[key] = (txt_ids, img_ids)
        return self._position_ids[key]

    # --- transformer ---------------------------------------------------------------------------
    def velocity(
        self,
        latents,
        sigmas,
        cond,
        uncond,
        guidance_scale,
        height,
        width,
        sigma_values=None,
        embedded_guidance: torch.Tensor | None = None,
    ):
        """guidance_scale (B,): the true-CFG weight of rows with an uncond encoding;
        embedded_guidance (B,): each row's SamplingParams.guidance_scale, the guidance embedding's
        value (ignored by a transformer without one). sigma_values: unused."""
        hidden, sigma, encodings, cfg_rows = cfg_forward_inputs(latents, sigmas, cond, uncond)
        embeds, _, pooled = pad_encodings(encodings)
        txt_ids, img_ids = self.position_ids(height, width, embeds.shape[1])
        guidance = None
        if self.has_guidance_embedding:
            assert embedded_guidance is not None, "a guidance-distilled FLUX forward needs embedded_guidance"
            guidance = with_cfg_rows(embedded_guidance.to(hidden.device, torch.float32), cfg_rows)
        out = self.transformer(
            hidden_states=hidden.to(self.dtype),
            timestep=(sigma * 1000.0).to(self.dtype) / 1000.0,  # the pipeline's timestep (module docstring)
            guidance=guidance,
            pooled_projections=pooled.to(self.dtype),
            encoder_hidden_states=embeds.to(self.dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0].float()
        return combine_cfg(out, len(cond), cfg_rows, guidance_scale, renormalize=False)

    # --- VAE -----------------------------------------------------------------------------------
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        return decode_kl_latents(self.vae, unpack_2x2(latents, h, w), self.vae_memory_format)
