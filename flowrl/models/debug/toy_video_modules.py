"""The video toy model's architecture: a Wan2.1-style WanPipeline's modules, sized by a
`VideoToySize`, untrained.

- Tokenizer: the hand-built T5 tokenizer of flowrl.models.debug.tiny_tokenizers over the video
  world's words (each one token), `TEXT_LENGTH` tokens long (the longest caption takes 6).
- Text encoder: the tiny UMT5 of flowrl.models.debug.tiny_wan, random and frozen (the transformer
  learns to read its features).
- VAE: AutoencoderKLWan with Wan2.1's compressions (4x in time, 8x in space): a 5-frame 48 x 48
  clip is a (z_dim, 2, 6, 6) latent, the first frame alone in latent frame 0 and the four after it
  in latent frame 1; its latents_mean / latents_std are set from the trained encoder's latents.
- Transformer: WanTransformer3DModel with (1, 2, 2) patches: at 48 x 48 each patch is one of the
  world's 3 x 3 grid cells, as in the image toy model (flowrl.models.debug.toy_modules).
- Scheduler: Wan's UniPC over flow sigmas, shift 3 (flowrl takes its sigmas and steps them).

It knows shapes of modules, nothing about training them (flowrl.models.debug.toy_video_pretrain).
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.models.debug.toy_modules import PretrainingBudget

TEXT_LENGTH = 8


@dataclass(frozen=True, kw_only=True)
class VideoToySize(PretrainingBudget):
    """A video toy model's architecture and pretraining budget (flowrl.models.debug.toy.SIZES)."""

    name: str
    image_size: int
    num_frames: int
    vae_base_dim: int
    vae_dim_mult: tuple[int, ...]  # channels per level as multiples of vae_base_dim; 4 levels (8x)
    latent_channels: int
    num_layers: int
    num_heads: int
    head_dim: int
    ffn_dim: int
    num_clips: int
    # A committed size whose trained autoencoder this size takes instead of training its own (the
    # same architecture; its vae_* budget is the one that autoencoder was trained with).
    codec: str | None = None

    @property
    def latent_size(self) -> int:
        return self.image_size // 8


def build_video_tokenizer():
    from flowrl.data.toy_video import video_words
    from flowrl.models.debug.tiny_tokenizers import build_t5_tokenizer

    tokenizer = build_t5_tokenizer(video_words())
    tokenizer.model_max_length = TEXT_LENGTH
    return tokenizer


def build_video_vae(size: VideoToySize):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=size.vae_base_dim,
        z_dim=size.latent_channels,
        dim_mult=list(size.vae_dim_mult),
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * size.latent_channels,  # set from the trained encoder's latents
        latents_std=[1.0] * size.latent_channels,
    )


def build_video_transformer(size: VideoToySize):
    from diffusers import WanTransformer3DModel

    # The head width splits into RoPE's frame, height and width parts (head_dim 16: 8 + 4 + 4).
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=size.num_heads,
        attention_head_dim=size.head_dim,
        in_channels=size.latent_channels,
        out_channels=size.latent_channels,
        text_dim=32,  # the UMT5's width
        freq_dim=64,
        ffn_dim=size.ffn_dim,
        num_layers=size.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=64,
    )


def build_video_pipeline(size: VideoToySize):
    """The untrained WanPipeline (float32, CPU) from torch's current RNG; the caller seeds it."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from flowrl.models.debug.architectures import WAN_SCHEDULER
    from flowrl.models.debug.tiny_wan import umt5_text_encoder

    tokenizer = build_video_tokenizer()
    pipeline = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=umt5_text_encoder(tokenizer),
        transformer=build_video_transformer(size),
        vae=build_video_vae(size),
        scheduler=UniPCMultistepScheduler(**{k: v for k, v in WAN_SCHEDULER.items() if k != "_class_name"}),
    )
    pipeline.text_encoder.requires_grad_(False).eval()
    return pipeline
