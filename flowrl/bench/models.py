"""Models for benchmarks: random weights at published architectures, or a local checkpoint.

`build_bench_model(name_or_path, device, dtype)` returns a `BenchModel`: an engine adapter and a
diffusers pipeline that share one transformer and one VAE (so every mode of a benchmark runs the
very same modules), plus the text geometry used for fake prompts.

Named architectures (random weights, no text encoders; their configs: flowrl.bench.architectures):
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
- `tiny-sd3`, `tiny-qwen`, `tiny-flux`, `tiny-z-image`: the modules of `flowrl.models.tiny` (CPU
  smoke tests).

Big models are built parameter by parameter directly on the target device in the target dtype
(constructing a 20 B model on the CPU takes minutes). Prompt embeddings are fixed random tensors
drawn from a hash of the prompt text: realistic shapes, no text encoder. Speed does not depend on
the weights' values; the initialisation only keeps activations finite (PyTorch's default scale).
A local diffusers folder loads through `flowrl.models.load_adapter` with its real text encoders.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from flowrl.bench.architectures import ARCHITECTURES, RANDOM_WEIGHT_MODULES
from flowrl.models.base import FlowModelAdapter, PromptEncoding, pad_encodings
from flowrl.models.flux import FluxAdapter
from flowrl.models.qwen_image import QwenImageAdapter
from flowrl.models.sd3 import SD3Adapter
from flowrl.models.z_image import ZImageAdapter
from flowrl.sampling_params import SamplingParams


@dataclass
class BenchModel:
    name: str
    family: str
    adapter: FlowModelAdapter
    pipeline: object  # the family's diffusers pipeline over the adapter's modules


class _RandomPromptsMixin:
    """encode_prompts without a text encoder: a fixed random (L, D) embedding per prompt text."""

    text_tokens: int
    text_dim: int
    pooled_dim: int | None

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[PromptEncoding]:
        out = []
        for text in prompts:
            gen = torch.Generator().manual_seed(zlib.crc32(text.encode()))
            embeds = torch.randn((self.text_tokens, self.text_dim), generator=gen).to(self.device, self.dtype)
            pooled = None
            if self.pooled_dim is not None:
                pooled = torch.randn((self.pooled_dim,), generator=gen).to(self.device, self.dtype)
            mask = torch.ones(self.text_tokens, dtype=torch.bool, device=self.device)
            out.append(PromptEncoding(embeds, mask, pooled))
        return out


class BenchSD3Adapter(_RandomPromptsMixin, SD3Adapter):
    pass


class BenchQwenImageAdapter(_RandomPromptsMixin, QwenImageAdapter):
    pass


class BenchFluxAdapter(_RandomPromptsMixin, FluxAdapter):
    pass


class BenchZImageAdapter(_RandomPromptsMixin, ZImageAdapter):
    pass


# family -> the adapter over random prompt embeddings
BENCH_ADAPTERS = {
    "sd3": BenchSD3Adapter,
    "qwen_image": BenchQwenImageAdapter,
    "flux": BenchFluxAdapter,
    "z_image": BenchZImageAdapter,
}


def _fill_parameter(data: torch.Tensor, name: str, generator: torch.Generator) -> None:
    """PyTorch's default scale: weights U(-1/sqrt(fan_in), 1/sqrt(fan_in)); norm weights 1; biases 0."""
    if data.dim() >= 2:
        bound = 1.0 / math.sqrt(math.prod(data.shape[1:]))
        data.uniform_(-bound, bound, generator=generator)
    elif name == "weight":
        data.fill_(1.0)
    else:
        data.zero_()


def build_random_module(cls, config: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Instantiate `cls(**config)` with parameters allocated and filled directly on `device` in
    `dtype` (construction happens on the meta device; buffers are built normally, then moved)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        module = cls(**config)
    generator = torch.Generator(device=device).manual_seed(seed)
    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if param is None:
                continue
            data = torch.empty(param.shape, device=device, dtype=dtype)
            _fill_parameter(data, name, generator)
            submodule._parameters[name] = torch.nn.Parameter(data, requires_grad=False)
    return module.to(device=device, dtype=dtype).eval()


def _random_modules(name: str, device: torch.device, dtype: torch.dtype, num_layers: int | None):
    import diffusers

    transformer_cls, config, vae_cls, vae_config, scheduler_config = RANDOM_WEIGHT_MODULES[name]
    config = dict(config)
    if num_layers is not None:  # fewer main blocks of every kind, at the published widths
        for key in ("num_layers", "num_single_layers", "n_layers"):  # Z-Image's is n_layers
            if key in config:
                config[key] = num_layers
        if "dual_attention_layers" in config:
            config["dual_attention_layers"] = tuple(i for i in config["dual_attention_layers"] if i < num_layers)
    transformer = build_random_module(getattr(diffusers, transformer_cls), config, device, dtype, seed=0)
    vae = build_random_module(getattr(diffusers, vae_cls), vae_config, device, dtype, seed=1)
    return transformer, vae, diffusers.FlowMatchEulerDiscreteScheduler(**scheduler_config)


def _tiny_modules(name: str, device: torch.device, dtype: torch.dtype):
    from flowrl.models.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline(ARCHITECTURES[name][0], seed=0)
    modules = [m.to(device=device, dtype=dtype).eval().requires_grad_(False) for m in (pipe.transformer, pipe.vae)]
    return modules[0], modules[1], pipe.scheduler


def _pipeline(family: str, transformer, vae, scheduler):
    """The family's diffusers pipeline over these modules, text encoders None (prompts are
    passed as embeddings)."""
    import diffusers

    text_modules = {
        "sd3": ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3"),
        "qwen_image": ("text_encoder", "tokenizer"),
        "flux": ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
        "z_image": ("text_encoder", "tokenizer"),
    }[family]
    pipeline_cls = {
        "sd3": "StableDiffusion3Pipeline",
        "qwen_image": "QwenImagePipeline",
        "flux": "FluxPipeline",
        "z_image": "ZImagePipeline",
    }
    pipe = getattr(diffusers, pipeline_cls[family])(
        transformer=transformer, scheduler=scheduler, vae=vae, **dict.fromkeys(text_modules)
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_bench_model(
    model: str, device: str | torch.device, dtype: torch.dtype, num_layers: int | None = None
) -> BenchModel:
    """A BenchModel for a named architecture (see ARCHITECTURES) or a local diffusers folder.
    num_layers: build a named architecture with fewer transformer blocks (smoke tests only)."""
    device = torch.device(device)
    if model not in ARCHITECTURES:
        if num_layers is not None:
            raise ValueError(f"--num-layers={num_layers} applies to named architectures only, not model={model!r}")
        from flowrl.models.registry import load_adapter

        adapter = load_adapter(model, device=device, dtype=dtype)  # raises a ValueError naming the fix
        return BenchModel(model, adapter.family, adapter, adapter.pipeline)
    family, tokens, width, pooled = ARCHITECTURES[model]
    if model.startswith("tiny-"):
        if num_layers is not None:
            raise ValueError(f"--num-layers={num_layers} is for the published architectures, not {model!r}")
        transformer, vae, scheduler = _tiny_modules(model, device, dtype)
    else:
        transformer, vae, scheduler = _random_modules(model, device, dtype, num_layers)
    pipe = _pipeline(family, transformer, vae, scheduler)
    adapter_cls = BENCH_ADAPTERS[family]
    # FLUX's T5 length is an adapter setting (the positions it builds); the others take their default.
    options = {"max_sequence_length": tokens} if family == "flux" else {}
    adapter = adapter_cls(pipe, device, dtype, **options)
    adapter.text_tokens, adapter.text_dim, adapter.pooled_dim = tokens, width, pooled
    return BenchModel(model, family, adapter, pipe)


def make_trainable(transformer: torch.nn.Module, rank: int, targets) -> list[torch.nn.Parameter]:
    """The trainer's setup at `--lora-rank`: a LoRA adapter of that rank on `targets` (peft's
    gaussian init, alpha = 2 x rank, as the recipes), or, at rank 0, the full transformer."""
    from flowrl.trainer.lora import apply_trainable

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
