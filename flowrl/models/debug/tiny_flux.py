"""The tiny random FLUX.1 [dev] pipeline (`flowrl make-tiny --kind flux`), built offline.

The real model's structure at toy widths: CLIP-L (pooled only) + T5 text encoders with the
hand-built tokenizers of flowrl.models.debug.tiny_tokenizers, a FluxTransformer2DModel with double- and
single-stream blocks and the guidance embedding of FLUX.1 [dev], the 16-channel AutoencoderKL with
FLUX's latent normalisation, and FLUX.1 [dev]'s scheduler config (resolution-dependent shift).
flowrl.models.debug.tiny seeds the RNG and saves it.
"""

from __future__ import annotations

from flowrl.models.debug.architectures import FLUX_DEV_SCHEDULER
from flowrl.models.debug.tiny_modules import clip_text_config, t5_text_encoder, tiny_kl_vae
from flowrl.models.debug.tiny_tokenizers import build_clip_tokenizer, build_t5_tokenizer
from flowrl.models.flux import MAX_T5_TOKENS


def build_tiny_flux():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    clip_tokenizer = build_clip_tokenizer()
    t5_tokenizer = build_t5_tokenizer()
    t5_tokenizer.model_max_length = MAX_T5_TOKENS  # FluxPipeline pads T5 prompts to 512 by default
    text_encoder = CLIPTextModel(clip_text_config(clip_tokenizer))
    text_encoder_2 = t5_text_encoder(t5_tokenizer)
    # Constraints: in_channels = 4 x 16 latent channels (2x2 packing), sum(axes_dims_rope) =
    # attention_head_dim, joint_attention_dim = T5 d_model, pooled_projection_dim = CLIP hidden.
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    vae = tiny_kl_vae(scaling_factor=0.3611, shift_factor=0.1159)
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )
