"""A tiny random Z-Image pipeline (ZImagePipeline), built offline and deterministically.

The structure is the real model's, shrunk: a Qwen3 text encoder whose second-to-last hidden state
is the caption (width 32), the single-stream ZImageTransformer2DModel with its noise and context
refiners (one block each) and two main blocks, a 16-channel AutoencoderKL with a downsampling
factor of 8 and FLUX's latent scaling and shift, and the Z-Image scheduler config (fixed shift 6,
no dynamic shifting). The tokenizer is flowrl.models.debug.tiny_tokenizers' hand-built Qwen2 BPE with a
chat template that lays a prompt out as Qwen3's template does for ZImagePipeline's call
(`add_generation_prompt=True`, `enable_thinking=True`): "<|im_start|>user\\n{prompt}<|im_end|>\\n
<|im_start|>assistant\\n", each marker, role word and newline one token.
"""

from __future__ import annotations

from flowrl.models.debug.architectures import Z_IMAGE_SCHEDULER
from flowrl.models.debug.tiny_modules import tiny_kl_vae
from flowrl.models.debug.tiny_tokenizers import QWEN_MAX_LENGTH, build_qwen2_tokenizer

# Qwen3's chat template, reduced to what a text-to-image prompt uses (messages without tools):
# each message as <|im_start|>role\n content <|im_end|>\n, then the assistant's turn, whose empty
# thinking block appears only when thinking is switched off.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
THINK_TOKENS = ("<think>", "</think>")
TEXT_HIDDEN = 32


def build_z_image_tokenizer():
    """The tiny Qwen2 tokenizer with Qwen3's thinking markers and the chat template above."""
    tokenizer = build_qwen2_tokenizer()
    tokenizer.add_tokens(list(THINK_TOKENS), special_tokens=True)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def build_z_image_pipeline():
    """A tiny ZImagePipeline with random weights from torch's current RNG (float32, CPU)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = build_z_image_tokenizer()
    token_id = tokenizer.convert_tokens_to_ids
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_HIDDEN,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=QWEN_MAX_LENGTH,
            bos_token_id=token_id("<|endoftext|>"),
            pad_token_id=token_id("<|endoftext|>"),
            eos_token_id=token_id("<|im_end|>"),
        )
    )
    # Constraints: head_dim = dim / n_heads = sum(axes_dims); cap_feat_dim = the text width.
    # axes_lens: RoPE positions per axis; the first covers the caption (up to the pipeline's 512
    # tokens, padded to a multiple of 32) and the image's frame index after it; the others the
    # image's token rows and columns (64: up to 1024 px).
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        qk_norm=True,
        cap_feat_dim=TEXT_HIDDEN,
        axes_dims=[8, 4, 4],
        axes_lens=[1024, 64, 64],
    )
    vae = tiny_kl_vae(scaling_factor=0.3611, shift_factor=0.1159)
    scheduler = FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER)
    return ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
