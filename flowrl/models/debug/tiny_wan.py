"""Tiny random Wan text-to-video pipelines (`flowrl make-tiny --kind wan|wan2.2|wan2.2-a14b`), built
offline.

The real models' structure at toy widths: a UMT5 encoder over the hand-built T5 tokenizer of
flowrl.models.debug.tiny_tokenizers (its texts padded to 32 tokens, the real pipelines' 512 being
a tokenizer setting), WanTransformer3DModel blocks with (1, 2, 2) patches and 3D RoPE, and
AutoencoderKLWan with the published compressions:

- `wan` (Wan2.1-T2V): 16 latent channels, 4x temporal and 8x spatial compression; flow shift 3.
- `wan2.2` (Wan2.2-TI2V-5B): the Wan2.2 VAE, 48 latent channels, 16x spatial compression through
  a 2x2 patch around residual blocks; per-token timesteps (`expand_timesteps`); flow shift 5.
- `wan2.2-a14b` (Wan2.2-T2V-A14B): two experts, `transformer` for high noise and `transformer_2`
  for low noise, switched at `boundary_ratio` 0.875, over the Wan2.1 VAE; flow shift 12.

The scheduler is the checkpoints' UniPC over flow sigmas (flowrl takes its sigmas and steps them
itself). flowrl.models.debug.tiny seeds the RNG and saves the pipeline.
"""

from __future__ import annotations

from flowrl.models.debug.architectures import WAN22_A14B_BOUNDARY, WAN22_A14B_SCHEDULER, WAN_SCHEDULER
from flowrl.models.debug.tiny_tokenizers import build_t5_tokenizer

TINY_WAN_TEXT_LENGTH = 32  # the tiny tokenizer's model_max_length: the adapter's default text length


def umt5_text_encoder(tokenizer):
    """A tiny UMT5 encoder (32 wide, 2 layers) over `tokenizer`, weights from torch's RNG."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=32,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )


def _transformer(latent_channels: int):
    from diffusers import WanTransformer3DModel

    # Constraints: text_dim = the UMT5 d_model; the head width splits into RoPE's frame, height and
    # width parts (16 = 8 + 4 + 4).
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=latent_channels,
        out_channels=latent_channels,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )


def _vae(version: str):
    from diffusers import AutoencoderKLWan

    common = dict(base_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    if version == "2.2":
        return AutoencoderKLWan(
            **common,
            decoder_base_dim=4,
            z_dim=48,
            in_channels=12,
            out_channels=12,
            is_residual=True,
            patch_size=2,
            scale_factor_spatial=16,
            latents_mean=[0.0] * 48,
            latents_std=[1.0] * 48,
        )
    return AutoencoderKLWan(**common, z_dim=16, latents_mean=[0.1] * 16, latents_std=[1.5] * 16)


def build_tiny_wan(kind: str):
    """The tiny pipeline of `kind` ("wan", "wan2.2" or "wan2.2-a14b"), weights from torch's RNG."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    tokenizer = build_t5_tokenizer()
    tokenizer.model_max_length = TINY_WAN_TEXT_LENGTH
    text_encoder = umt5_text_encoder(tokenizer)
    scheduler_config = {k: v for k, v in WAN_SCHEDULER.items() if k != "_class_name"}
    if kind == "wan2.2":
        return WanPipeline(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            transformer=_transformer(48),
            vae=_vae("2.2"),
            scheduler=UniPCMultistepScheduler(**dict(scheduler_config, flow_shift=5.0)),
            expand_timesteps=True,
        )
    if kind == "wan2.2-a14b":
        return WanPipeline(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            transformer=_transformer(16),
            transformer_2=_transformer(16),
            vae=_vae("2.1"),
            scheduler=UniPCMultistepScheduler(**dict(scheduler_config, flow_shift=WAN22_A14B_SCHEDULER["flow_shift"])),
            boundary_ratio=WAN22_A14B_BOUNDARY,
        )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=_transformer(16),
        vae=_vae("2.1"),
        scheduler=UniPCMultistepScheduler(**scheduler_config),
    )
