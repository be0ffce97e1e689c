"""Tiny random diffusers checkpoints (SD3, Qwen-Image, FLUX, Z-Image, Wan), built offline and deterministically.

`build_tiny_checkpoint(kind, path, seed)` assembles a complete pipeline (transformer, VAE, text
encoders, hand-built tokenizers, FlowMatchEulerDiscreteScheduler) with random weights drawn from
`seed`, and `save_pretrained`s it. Nothing touches the hub. Two builds with the same seed give
byte-identical files. The configs are the measured ones of design/ENVIRONMENT.md section 2; they keep
the real models' structure (VAE downsampling 8, 16 latent channels, Qwen's 34-token chat prefix) so
code written against the tiny models runs unchanged on the real ones.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from flowrl.models.debug.architectures import QWEN_IMAGE_SCHEDULER
from flowrl.models.debug.tiny_flux import build_tiny_flux
from flowrl.models.debug.tiny_modules import clip_text_config, t5_text_encoder, tiny_kl_vae
from flowrl.models.debug.tiny_tokenizers import (
    QWEN_MAX_LENGTH,
    build_clip_tokenizer,
    build_qwen2_tokenizer,
    build_t5_tokenizer,
)
from flowrl.models.debug.tiny_wan import build_tiny_wan
from flowrl.models.debug.tiny_z_image import build_z_image_pipeline
from flowrl.output_paths import (
    check_output_folder,
    file_sizes,
    is_foreign_folder,
    read_marker,
    remove_listed_files,
    write_marker,
)

TINY_MARKER = "tiny"  # the folder's marker file: .flowrl-tiny

# kind -> the pipeline class name that model_index.json records for it.
TINY_KINDS: dict[str, str] = {
    "sd3": "StableDiffusion3Pipeline",
    "qwen_image": "QwenImagePipeline",
    "flux": "FluxPipeline",
    "z_image": "ZImagePipeline",
    "wan": "WanPipeline",  # Wan2.1-T2V
    "wan2.2": "WanPipeline",  # Wan2.2-TI2V-5B
    "wan2.2-a14b": "WanPipeline",  # Wan2.2-T2V-A14B: two experts
}
# A family whose tiny kind has another name (the other families' kinds are their names).
_TINY_KIND_OF_FAMILY = {"wan2.1": "wan"}


def tiny_kind(family: str) -> str:
    """The tiny checkpoint kind that builds a model of `family`."""
    return _TINY_KIND_OF_FAMILY.get(family, family)


def _check_kind(kind: str) -> None:
    if kind not in TINY_KINDS:
        raise ValueError(f"kind={kind!r} is not a tiny checkpoint kind; choose one of: {', '.join(TINY_KINDS)}")


def _existing_kind(path: Path) -> str | None:
    """The tiny kind already saved at `path`, or None when there is no readable model_index.json."""
    index_file = path / "model_index.json"
    if not index_file.is_file():
        return None
    try:
        class_name = json.loads(index_file.read_text()).get("_class_name")
    except (OSError, json.JSONDecodeError):
        return None
    return next((kind for kind, name in TINY_KINDS.items() if name == class_name), None)


def _build_sd3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    clip_tokenizer = build_clip_tokenizer()
    t5_tokenizer = build_t5_tokenizer()
    # Constraints: joint_attention_dim = T5 d_model >= 2 x CLIP hidden (the two CLIP embeddings are
    # concatenated and zero-padded to the T5 width); pooled_projection_dim = 2 x CLIP projection_dim.
    clip_config = clip_text_config(clip_tokenizer)
    text_encoder = CLIPTextModelWithProjection(clip_config)
    text_encoder_2 = CLIPTextModelWithProjection(clip_config)
    text_encoder_3 = t5_text_encoder(t5_tokenizer)
    # sample_size only sets the default resolution (8 latents = 64 px); pos_embed_max_size=32
    # lets the same weights run up to 256 px.
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        pos_embed_max_size=32,
    )
    vae = tiny_kl_vae(scaling_factor=1.5035, shift_factor=0.0609)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer,
    )


def _build_qwen_image():
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = build_qwen2_tokenizer()
    token_id = tokenizer.convert_tokens_to_ids
    text_hidden = 32
    # Constraint: sum(mrope_section) = head_dim / 2 = (32 / 2) / 2 = 8.
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": text_hidden,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": QWEN_MAX_LENGTH,
        "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "rope_theta": 1e6},
        "bos_token_id": token_id("<|endoftext|>"),
        "pad_token_id": token_id("<|endoftext|>"),
        "eos_token_id": token_id("<|im_end|>"),
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_heads": 2,
        "out_hidden_size": text_hidden,
        "fullatt_block_indexes": [0],
    }
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=text_config,
            vision_config=vision_config,
            vision_start_token_id=token_id("<|vision_start|>"),
            vision_end_token_id=token_id("<|vision_end|>"),
            image_token_id=token_id("<|image_pad|>"),
            video_token_id=token_id("<|video_pad|>"),
        )
    )
    z_dim = 16
    # Constraints: in_channels = 4 x z_dim (2x2 latent packing), sum(axes_dims_rope) =
    # attention_head_dim, joint_attention_dim = text hidden size.
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * z_dim,
        out_channels=z_dim,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_hidden,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)  # Qwen-Image's own
    return QwenImagePipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )


_BUILDERS = {
    "sd3": _build_sd3,
    "qwen_image": _build_qwen_image,
    "flux": build_tiny_flux,
    "z_image": build_z_image_pipeline,
    "wan": lambda: build_tiny_wan("wan"),
    "wan2.2": lambda: build_tiny_wan("wan2.2"),
    "wan2.2-a14b": lambda: build_tiny_wan("wan2.2-a14b"),
}


def build_tiny_pipeline(kind: str, seed: int = 0):
    """A tiny random pipeline of `kind` in memory (float32, CPU); the caller's RNG is untouched."""
    _check_kind(kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipeline = _BUILDERS[kind]()
    return pipeline


def build_tiny_checkpoint(kind: str, path: str | Path, seed: int = 0, overwrite: bool = False) -> Path:
    """Build a tiny random checkpoint of `kind` (a TINY_KINDS key) and save it to `path`.

    The folder follows flowrl.output_paths: a `.flowrl-tiny` marker records the kind, the seed and
    the files written. A folder already holding this kind and seed is reused as it is (so demos can
    call this on every run); flowrl's own earlier build of another kind or seed is replaced; a
    non-empty folder without the marker is refused (OutputExistsError) unless `overwrite`, and even
    then only same-named files are replaced: nothing flowrl did not write is deleted. Returns the path.
    """
    _check_kind(kind)
    path = Path(path)
    previous = read_marker(path, TINY_MARKER)
    if previous is not None and previous.get("kind") == kind and previous.get("seed") == seed:
        if all((path / name).is_file() for name in previous.get("files", [])):
            return path
    is_foreign = is_foreign_folder(path, TINY_MARKER)
    # An unmarked folder holding this kind may be an older tiny build: compared once built, below.
    if not (is_foreign and not overwrite and _existing_kind(path) == kind):
        check_output_folder(path, TINY_MARKER, overwrite)  # raises before anything is built
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".flowrl-tiny-", dir=path.parent) as staging:
        staged = Path(staging)
        build_tiny_pipeline(kind, seed).save_pretrained(staged, safe_serialization=True)
        sizes = file_sizes(staged)
        if is_foreign and not overwrite and file_sizes(path) != sizes:
            # An unmarked folder is taken as flowrl's own only when it holds exactly the files
            # (names and sizes) of a tiny build of this kind: one written before markers existed.
            check_output_folder(path, TINY_MARKER, overwrite)
        path.mkdir(exist_ok=True)
        remove_listed_files(path, [name for name in (previous or {}).get("files", []) if name not in sizes])
        for name in sizes:
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged / name, path / name)
    write_marker(path, TINY_MARKER, list(sizes), kind=kind, seed=seed)
    return path


def parameter_counts(path: str | Path) -> dict[str, int]:
    """Parameters per model component of a saved checkpoint, read from its safetensors headers."""
    from safetensors import safe_open

    path = Path(path)
    marker = read_marker(path, TINY_MARKER)
    if marker is not None:  # only what make-tiny wrote, whatever else the folder holds
        files = sorted(path / name for name in marker.get("files", []) if name.endswith(".safetensors"))
    else:
        files = sorted(path.glob("*/*.safetensors"))
    counts: dict[str, int] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            total = 0
            for name in handle.keys():
                shape = handle.get_slice(name).get_shape()
                total += int(torch.tensor(shape).prod().item()) if shape else 1
        counts[file.parent.name] = counts.get(file.parent.name, 0) + total
    return counts
