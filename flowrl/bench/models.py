"""Models for benchmarks: random weights at published architectures, or a local checkpoint.

`build_bench_model(name_or_path, device, dtype)` returns a `BenchModel`: an engine adapter and a
diffusers pipeline that share one transformer and one VAE (so every mode of a benchmark runs the
very same modules), plus the text geometry used for fake prompts.

Named architectures (random weights, no text encoders; flowrl.models.debug.random_weights builds them
from the configs of flowrl.models.debug.architectures, and the trainer takes them as `random:NAME`):
- `sd3-medium`: SD3Transformer2DModel and AutoencoderKL with the configs of
  stabilityai/stable-diffusion-3-medium (2.03 B transformer parameters); prompts as sd35-medium's.
- `sd35-medium`: SD3Transformer2DModel and AutoencoderKL with the configs of
  stabilityai/stable-diffusion-3.5-medium (2.24 B transformer parameters); prompts are 77 + 256
  tokens of width 4096 plus a pooled 2048 vector, as CLIP-L/G + T5 give.
- `sd35-large`: the same with stabilityai/stable-diffusion-3.5-large's transformer (8.06 B).
- `qwen-image`: QwenImageTransformer2DModel and AutoencoderKLQwenImage with the configs of
  Qwen/Qwen-Image (20.4 B transformer parameters); prompts are 64 tokens of width 3584.
- `flux-dev`: FluxTransformer2DModel (guidance embedding) and AutoencoderKL with the configs of
  black-forest-labs/FLUX.1-dev (11.9 B); prompts are 512 T5 tokens of width 4096 (the pipeline's
  default max_sequence_length) plus CLIP-L's pooled 768 vector.
- `z-image`: ZImageTransformer2DModel and AutoencoderKL with the configs of
  Tongyi-MAI/Z-Image-Turbo (6.15 B transformer parameters; the undistilled Z-Image has the same
  architecture) and Z-Image's scheduler (shift 6); prompts are 64 tokens of width 2560, as
  Qwen3-4B gives.
- `wan2.1-1.3b`, `wan2.1-14b`, `wan2.2-5b`, `wan2.2-a14b`: WanTransformer3DModel and
  AutoencoderKLWan with the Wan2.1-T2V-1.3B, Wan2.1-T2V-14B, Wan2.2-TI2V-5B and Wan2.2-T2V-A14B
  configs (the 5B with the 48-channel Wan2.2 VAE; the A14B with two experts of the 14B's
  architecture, switched at sigma 0.875) and the checkpoints' UniPC flow schedule; prompts are 512
  UMT5 tokens of width 4096.
  Samples are videos: `--num-frames` (4k+1) and `--height`/`--width` of `flowrl bench rollout`.
- `tiny-sd3`, `tiny-qwen`, `tiny-flux`, `tiny-z-image`, `tiny-wan`, `tiny-wan2.2`: the modules of
  `flowrl.models.debug.tiny` (CPU smoke tests).

Prompt embeddings are fixed random tensors drawn from a hash of the prompt text: realistic
shapes, no text encoder. A local diffusers folder loads through `flowrl.models.load_adapter` with
its real text encoders.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from flowrl.models.base import FlowModelAdapter, pad_encodings
from flowrl.models.debug.architectures import ARCHITECTURES
from flowrl.models.debug.random_weights import RANDOM_PREFIX
from flowrl.models.registry import load_adapter
from flowrl.sampling_params import SamplingParams


@dataclass
class BenchModel:
    name: str
    family: str
    adapter: FlowModelAdapter
    pipeline: object  # the family's diffusers pipeline over the adapter's modules


def build_bench_model(
    model: str,
    device: str | torch.device,
    dtype: torch.dtype,
    num_layers: int | None = None,
    max_sequence_length: int | None = None,
) -> BenchModel:
    """A BenchModel for a named architecture (flowrl.models.debug.architectures; `random:NAME` too) or a
    local diffusers folder. num_layers: build a named architecture with fewer transformer blocks
    (smoke tests only). max_sequence_length: the adapter's text length (model.max_sequence_length;
    None: the family's default), which also sets a named architecture's prompt length."""
    device = torch.device(device)
    options = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
    name = model.removeprefix(RANDOM_PREFIX)
    if name not in ARCHITECTURES:
        if num_layers is not None:
            raise ValueError(f"--num-layers={num_layers} applies to named architectures only, not model={model!r}")
        adapter = load_adapter(model, device=device, dtype=dtype, **options)  # raises a ValueError naming the fix
        return BenchModel(model, adapter.family, adapter, adapter.pipeline)
    try:
        adapter = load_adapter(RANDOM_PREFIX + name, device, dtype, num_layers=num_layers, warn=False, **options)
    except ValueError as error:
        raise ValueError(str(error).replace("num_layers=", "--num-layers=")) from None
    return BenchModel(name, adapter.family, adapter, adapter.pipeline)


def make_trainable(transformer: torch.nn.Module, rank: int, targets) -> list[torch.nn.Parameter]:
    """The trainer's setup at `--lora-rank`: a LoRA adapter of that rank on `targets` (peft's
    gaussian init, alpha = 2 x rank, as the recipes), or, at rank 0, the full transformer."""
    from flowrl.models.lora import apply_trainable

    if rank < 0:
        raise ValueError(f"--lora-rank={rank} must be >= 0 (0 trains the full transformer)")
    cfg = SimpleNamespace(
        enabled=rank > 0, rank=rank, alpha=2.0 * rank, target_modules=list(targets), init="gaussian", dropout=0.0
    )
    return apply_trainable(transformer, cfg)


def pipeline_prompt_kwargs(
    bench: BenchModel, prompts: list[str], guidance_scale: float, true_cfg_scale: float = 1.0
) -> dict:
    """Precomputed prompt embeddings as the family's pipeline takes them (batch = len(prompts)),
    with the empty negative prompt's embeddings when the settings take an uncond row (the
    adapter's rule: flowrl.models.base)."""
    adapter = bench.adapter
    encodings = adapter.encode_prompts(prompts)
    settings = SamplingParams(guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale)
    uses_uncond = adapter.rows_per_sample(settings) > 1
    negative_encodings = adapter.encode_prompts([""]) * len(prompts) if uses_uncond else None
    if bench.family == "z_image":
        # Unpadded captions, as the pipeline's own encoder gives them; its guidance_scale is
        # flowrl's minus 1 (flowrl.models.z_image), and 0 turns guidance off.
        kwargs = dict(prompt_embeds=[e.embeds for e in encodings], guidance_scale=max(guidance_scale - 1.0, 0.0))
        if uses_uncond:
            kwargs.update(negative_prompt_embeds=[e.embeds for e in negative_encodings])
        return kwargs
    embeds, mask, pooled = pad_encodings(encodings)
    negatives = pad_encodings(negative_encodings) if uses_uncond else None
    if bench.family in ("wan2.1", "wan2.2"):  # every prompt at its full, zero-padded length
        kwargs = dict(prompt_embeds=embeds, guidance_scale=guidance_scale)
        if uses_uncond:
            kwargs.update(negative_prompt_embeds=negatives[0])
        return kwargs
    if bench.family in ("sd3", "flux"):
        kwargs = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, guidance_scale=guidance_scale)
        if bench.family == "flux":
            kwargs.update(true_cfg_scale=true_cfg_scale)
        if uses_uncond:
            kwargs.update(negative_prompt_embeds=negatives[0], negative_pooled_prompt_embeds=negatives[2])
        return kwargs
    # Qwen-Image: no mask when nothing is padded (what the pipeline does itself; keeps fast kernels).
    padded = len({e.embeds.shape[0] for e in encodings}) > 1
    kwargs = dict(prompt_embeds=embeds, prompt_embeds_mask=mask if padded else None, true_cfg_scale=guidance_scale)
    if uses_uncond:
        kwargs.update(negative_prompt_embeds=negatives[0], negative_prompt_embeds_mask=None)
    return kwargs
