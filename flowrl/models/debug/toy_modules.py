"""The toy model's architecture: an SD3 pipeline's modules, sized by a `ToySize`, untrained.

- Tokenizers: the hand-built deterministic ones of flowrl.models.debug.tiny_tokenizers over the toy
  world's words (each one token), 16 tokens long (the longest caption takes 12).
- Text encoders: the tiny CLIPs and T5 of flowrl.models.debug.tiny_modules, random and frozen: the
  transformer learns to read their features (they keep words and word order apart).
- VAE: a diffusers AutoencoderKL with `len(vae_channels) - 1` halvings (8x: a 48 x 48 picture is a
  6 x 6 latent), `latent_channels` channels, no mid-block attention, no quant convs.
- Transformer: SD3Transformer2DModel with 2x2 patches, `num_layers` joint blocks of
  `num_heads` x `head_dim`. At 48 x 48 a patch is one of the world's 3 x 3 grid cells: each image
  token draws one cell's object (or nothing), and attention composes the cells (a cell spread
  over several tokens came out blurred and in mixed colours: docs/learning.md).
- Scheduler: FlowMatchEulerDiscreteScheduler with SD3's shift (3.0).

It knows shapes of modules, nothing about training them (flowrl.models.debug.toy_pretrain).
"""

from __future__ import annotations

from dataclasses import dataclass

TEXT_LENGTH = 16
SCHEDULER_SHIFT = 3.0


@dataclass(frozen=True, kw_only=True)
class PretrainingBudget:
    """What a toy model's pretraining spends: the autoencoder's steps, batch and learning rate, and
    the transformer's, with its EMA decay and caption dropout (shared by the image and video sizes)."""

    vae_steps: int
    vae_batch: int
    vae_lr: float
    steps: int
    batch: int
    lr: float
    ema_decay: float
    caption_dropout: float = 0.1


@dataclass(frozen=True, kw_only=True)
class ToySize(PretrainingBudget):
    """A toy model's architecture and pretraining budget (flowrl.models.debug.toy.SIZES)."""

    name: str
    image_size: int
    vae_channels: tuple[int, ...]
    latent_channels: int
    num_layers: int
    num_heads: int
    head_dim: int
    num_images: int

    @property
    def latent_size(self) -> int:
        return self.image_size // 2 ** (len(self.vae_channels) - 1)


def build_tokenizers():
    """(CLIP tokenizer, T5 tokenizer) over the toy world's words, TEXT_LENGTH tokens long."""
    from flowrl.data.toy_world import world_words
    from flowrl.models.debug.tiny_tokenizers import build_clip_tokenizer, build_t5_tokenizer

    clip = build_clip_tokenizer(world_words())
    t5 = build_t5_tokenizer(world_words())
    clip.model_max_length = TEXT_LENGTH
    t5.model_max_length = TEXT_LENGTH
    return clip, t5


def build_vae(size: ToySize):
    from diffusers import AutoencoderKL

    levels = len(size.vae_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=tuple(size.vae_channels),
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        layers_per_block=1,
        latent_channels=size.latent_channels,
        norm_num_groups=8,
        sample_size=size.image_size,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
        scaling_factor=1.0,  # set from the trained encoder's latents
        shift_factor=0.0,
    )


def build_transformer(size: ToySize):
    from diffusers import SD3Transformer2DModel

    width = size.num_heads * size.head_dim
    return SD3Transformer2DModel(
        sample_size=size.latent_size,
        patch_size=2,
        in_channels=size.latent_channels,
        out_channels=size.latent_channels,
        num_layers=size.num_layers,
        attention_head_dim=size.head_dim,
        num_attention_heads=size.num_heads,
        joint_attention_dim=64,  # the T5's width; the two CLIPs' 32 + 32 are padded to it
        caption_projection_dim=width,
        pooled_projection_dim=64,  # the two CLIPs' pooled 32 + 32
        pos_embed_max_size=size.latent_size,  # in patches: up to twice the trained side
    )


def build_pipeline(size: ToySize):
    """The untrained pipeline (float32, CPU) from torch's current RNG; the caller seeds it."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    from flowrl.models.debug.tiny_modules import clip_text_config, t5_text_encoder

    clip_tokenizer, t5_tokenizer = build_tokenizers()
    clip_config = clip_text_config(clip_tokenizer)
    pipeline = StableDiffusion3Pipeline(
        transformer=build_transformer(size),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_SHIFT),
        vae=build_vae(size),
        text_encoder=CLIPTextModelWithProjection(clip_config),
        tokenizer=clip_tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(clip_config),
        tokenizer_2=clip_tokenizer,
        text_encoder_3=t5_text_encoder(t5_tokenizer),
        tokenizer_3=t5_tokenizer,
    )
    for module in (pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3):
        module.requires_grad_(False).eval()
    return pipeline
