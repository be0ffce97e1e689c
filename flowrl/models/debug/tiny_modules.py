"""Tiny random modules shared by several families' tiny checkpoints (flowrl.models.debug.tiny): the CLIP
text encoder's config (SD3's two CLIPs, FLUX's CLIP-L), the T5 encoder (SD3, FLUX) and the
16-channel AutoencoderKL (SD3, FLUX, Z-Image). Each takes its weights from torch's current RNG;
the caller seeds it."""

from __future__ import annotations


def clip_text_config(clip_tokenizer):
    """The tiny CLIP text encoder's config (SD3's two CLIPs, FLUX's CLIP-L)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(clip_tokenizer),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=32,
        max_position_embeddings=clip_tokenizer.model_max_length,
        hidden_act="gelu",
        bos_token_id=clip_tokenizer.bos_token_id,
        eos_token_id=clip_tokenizer.eos_token_id,
        pad_token_id=clip_tokenizer.pad_token_id,
    )


def t5_text_encoder(t5_tokenizer):
    """The tiny T5 encoder (d_model 64) of SD3 and FLUX."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tokenizer),
            d_model=64,
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=t5_tokenizer.pad_token_id,
            eos_token_id=t5_tokenizer.eos_token_id,
            decoder_start_token_id=t5_tokenizer.pad_token_id,
        )
    )


def tiny_kl_vae(scaling_factor: float, shift_factor: float):
    """A tiny AutoencoderKL with the real ones' structure (16 latent channels, downsampling 8) and
    the family's latent scale and shift (SD3's; FLUX.1's, which Z-Image uses too): the published
    AutoencoderKL config with narrow blocks."""
    from diffusers import AutoencoderKL

    from flowrl.models.debug.architectures import SD35_MEDIUM_VAE

    return AutoencoderKL(
        **dict(
            SD35_MEDIUM_VAE,
            block_out_channels=(8, 16, 16, 16),
            layers_per_block=1,
            norm_num_groups=8,
            sample_size=64,
            shift_factor=shift_factor,
            scaling_factor=scaling_factor,
        )
    )
