"""Qwen-Image adapter over the diffusers QwenImagePipeline components.

Latent layout: packed (H/16 * W/16, 64) tokens (2x2 patches of the 16-channel VAE latent), the
transformer's input layout; noise is drawn in the unpacked (16, H/8, W/8) layout and packed, so a
seed gives the same start as the pipeline. Text: Qwen2.5-VL hidden states through the pipeline's
own chat-template encoder, variable length per prompt; batched rows are right-padded and masked.
Schedule: dynamic shift with mu from the packed image token count. Timestep scaling: sigma.
CFG is "true CFG" with the guided vector rescaled to the cond vector's norm, as the pipeline does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.models.base import FlowModelAdapter, PromptEncoding, cfg_forward_inputs, combine_cfg, pad_encodings, to_uint8
from flowrl.models.qwen_vae import decode_single_frames_in_2d, single_frame_2d
from flowrl.models.schedule import schedule_sigmas


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, S, H, D) with adjacent pairs (x[2k], x[2k+1]) as (re, im): the
    complex product (re + i im)(cos_k + i sin_k), in real arithmetic, in float32. The tables are
    expanded to the head width (see `_real_rope_tables`): cos = (c0, c0, c1, c1, ...),
    sin = (-s0, s0, -s1, s1, ...), so out = x * cos + swap_pairs(x) * sin. This pair-swap form
    compiles to a kernel 2.4x faster than unbinding and re-stacking the pairs (0.17 vs 0.41 ms
    for q and k of a B=16 block with RMSNorm, H200; benchmarks/qwen_block_parts.py)."""
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos[:, None] + swapped * sin[:, None]).type_as(x)


def _real_rope_tables(module, args, output):
    """Forward hook of the transformer's RoPE module: complex tables (S, D/2) -> the expanded real
    tables `_rotate` takes, (S, D) each, once per forward and outside the compiled blocks
    (inductor generates no code for complex tensors)."""
    tables = []
    for freqs in output:
        cos, sin = freqs.real.float(), freqs.imag.float()
        tables.append((cos.repeat_interleave(2, dim=-1).contiguous(), torch.stack([-sin, sin], dim=-1).flatten(-2).contiguous()))
    return tuple(tables)


class RealRopeQwenAttention:
    """Qwen-Image's joint text-image attention (the math of diffusers' QwenDoubleStreamAttnProcessor2_0)
    with rotary embeddings in real arithmetic, so torch.compile fuses them into the kernels around
    them instead of running complex ops eagerly (several extra float32 passes over q and k per
    block). Takes the expanded (cos, sin) tables made by `_real_rope_tables`."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None):
        assert encoder_hidden_states is not None and attention_mask is None
        if encoder_hidden_states_mask is not None:  # text mask + all-true image mask, (B, 1, 1, L)
            image_mask = encoder_hidden_states_mask.new_ones(hidden_states.shape[:2])
            attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
        head_dim = attn.inner_dim // attn.heads
        split = lambda t: t.unflatten(-1, (-1, head_dim))  # noqa: E731
        img_q, img_k, img_v = split(attn.to_q(hidden_states)), split(attn.to_k(hidden_states)), split(attn.to_v(hidden_states))
        txt_q, txt_k, txt_v = (split(attn.add_q_proj(encoder_hidden_states)), split(attn.add_k_proj(encoder_hidden_states)),
                               split(attn.add_v_proj(encoder_hidden_states)))
        img_q, img_k = attn.norm_q(img_q), attn.norm_k(img_k)
        txt_q, txt_k = attn.norm_added_q(txt_q), attn.norm_added_k(txt_k)
        if image_rotary_emb is not None:
            (img_cos, img_sin), (txt_cos, txt_sin) = image_rotary_emb
            img_q, img_k = _rotate(img_q, img_cos, img_sin), _rotate(img_k, img_cos, img_sin)
            txt_q, txt_k = _rotate(txt_q, txt_cos, txt_sin), _rotate(txt_k, txt_cos, txt_sin)
        # Joint sequence [text, image]; SDPA wants (B, H, L, D).
        q, k, v = (torch.cat(pair, dim=1).transpose(1, 2) for pair in ((txt_q, img_q), (txt_k, img_k), (txt_v, img_v)))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        seq_txt = encoder_hidden_states.shape[1]
        img_out = attn.to_out[0](out[:, seq_txt:].contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)  # dropout
        return img_out, attn.to_add_out(out[:, :seq_txt].contiguous())


class QwenImageAdapter(FlowModelAdapter):
    family = "qwen_image"
    size_multiple = 16  # VAE factor 8 times the 2x2 packing
    default_lora_targets = (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    )

    def __init__(self, pipeline, device, dtype, max_sequence_length: int = 1024, true_cfg_renorm: bool = True):
        super().__init__(pipeline, device, dtype, max_sequence_length)
        self.true_cfg_renorm = true_cfg_renorm
        self.vae_scale_factor = 2 ** len(self.vae.temperal_downsample)
        self.latent_channels = self.vae.config.z_dim
        self._sigma_cache: dict[tuple[int, int], torch.Tensor] = {}
        decode_single_frames_in_2d(self.vae)  # taken only inside `decode` (see flowrl/models/qwen_vae.py)

    @classmethod
    def from_pretrained(cls, path: str | Path, device="cpu", dtype=torch.float32, max_sequence_length: int = 1024):
        from diffusers import QwenImagePipeline

        pipeline = QwenImagePipeline.from_pretrained(str(path), dtype=dtype)
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

    # --- latents and schedule ----------------------------------------------------------------
    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        h, w = self._latent_hw(height, width)
        return ((h // 2) * (w // 2), self.latent_channels * 4)

    def initial_noise(self, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        noise = torch.randn((1, 1, self.latent_channels, h, w), generator=generator, dtype=torch.float32, device=generator.device)
        return self.pack(noise[:, 0], h, w)[0]

    def pack(self, latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, C, h, w) -> (B, h/2 * w/2, 4C): each token is a 2x2 patch, channel-major."""
        b, c = latents.shape[:2]
        x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // 2) * (w // 2), c * 4)

    def unpack(self, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Inverse of pack: (B, h/2 * w/2, 4C) -> (B, C, h, w)."""
        b, _, d = tokens.shape
        c = d // 4
        x = tokens.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, h, w)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        seq_len = self.latent_shape(height, width)[0]
        key = (num_steps, seq_len)
        if key not in self._sigma_cache:
            self._sigma_cache[key] = schedule_sigmas(self.scheduler, num_steps, image_seq_len=seq_len, linear_base=True)
        return self._sigma_cache[key]

    # --- transformer ---------------------------------------------------------------------------
    def velocity(self, latents, sigmas, cond, uncond, guidance_scale, height, width):
        hidden, timestep, encodings, cfg_rows = cfg_forward_inputs(latents, sigmas, cond, uncond)
        embeds, mask, _ = pad_encodings(encodings)
        # Lengths are known on the host, so deciding whether a mask is needed costs no sync;
        # without padding we pass no mask (the pipeline does the same, and fast kernels apply).
        lengths = {e.embeds.shape[0] for e in encodings}
        h, w = self._latent_hw(height, width)
        out = self.transformer(
            hidden_states=hidden.to(self.dtype),
            timestep=timestep.to(self.dtype),
            encoder_hidden_states=embeds.to(self.dtype),
            encoder_hidden_states_mask=mask if len(lengths) > 1 else None,
            img_shapes=[[(1, h // 2, w // 2)]] * hidden.shape[0],
            return_dict=False,
        )[0].float()
        return combine_cfg(out, len(cond), cfg_rows, guidance_scale, renormalize=self.true_cfg_renorm)

    def compile_modules(self, backend: str = "inductor", rounding: str = "eager") -> list[str]:
        """Regional compile, after switching attention to real-arithmetic RoPE (see
        RealRopeQwenAttention); the switch happens once and changes no parameter."""
        if not getattr(self.transformer, "_flowrl_real_rope", False):
            self.transformer.set_attn_processor(RealRopeQwenAttention())
            self.transformer.pos_embed.register_forward_hook(_real_rope_tables)
            self.transformer._flowrl_real_rope = True
        return super().compile_modules(backend, rounding)

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
