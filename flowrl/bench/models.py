"""Models for benchmarks: random weights at published architectures, or a local checkpoint.

`build_bench_model(name_or_path, device, dtype)` returns a `BenchModel`: an engine adapter and a
diffusers pipeline that share one transformer and one VAE (so every mode of a benchmark runs the
very same modules), plus the text geometry used for fake prompts.

Named architectures (random weights, no text encoders):
- `sd35-medium`: SD3Transformer2DModel and AutoencoderKL with the configs of
  stabilityai/stable-diffusion-3.5-medium (2.24 B transformer parameters); prompts are 77 + 256
  tokens of width 4096 plus a pooled 2048 vector, as CLIP-L/G + T5 give.
- `qwen-image`: QwenImageTransformer2DModel and AutoencoderKLQwenImage with the configs of
  Qwen/Qwen-Image (20.4 B transformer parameters); prompts are 64 tokens of width 3584.
- `z-image`: ZImageTransformer2DModel and AutoencoderKL with the configs of
  Tongyi-MAI/Z-Image-Turbo (6.15 B transformer parameters; the undistilled Z-Image has the same
  architecture) and Z-Image's scheduler (shift 6); prompts are 64 tokens of width 2560, as
  Qwen3-4B gives.
- `tiny-sd3`, `tiny-qwen`, `tiny-z-image`: the modules of `flowrl.models.tiny` (CPU smoke tests).

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

from flowrl.models.base import FlowModelAdapter, PromptEncoding, pad_encodings
from flowrl.models.qwen_image import QwenImageAdapter
from flowrl.models.sd3 import SD3Adapter
from flowrl.models.z_image import ZImageAdapter

SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
SD35_MEDIUM_VAE = dict(
    in_channels=3,
    out_channels=3,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=0.0609,
    scaling_factor=1.5305,
)
QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
QWEN_IMAGE_VAE = dict(  # AutoencoderKLQwenImage's defaults are the published config; stated here
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
)
Z_IMAGE_TRANSFORMER = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=3840,
    n_layers=30,
    n_refiner_layers=2,
    n_heads=30,
    n_kv_heads=30,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=2560,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[32, 48, 48],
    axes_lens=[1536, 512, 512],
)
# FLUX.1's VAE, which Z-Image uses: SD3.5's layout with its own latent scale and shift.
Z_IMAGE_VAE = dict(SD35_MEDIUM_VAE, scaling_factor=0.3611, shift_factor=0.1159)
Z_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False)
QWEN_IMAGE_SCHEDULER = dict(
    base_shift=0.5,
    max_shift=0.9,
    use_dynamic_shifting=True,
    shift_terminal=0.02,
    time_shift_type="exponential",
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift=1.0,
)

# name -> (family, text tokens, text width, pooled width or None)
ARCHITECTURES: dict[str, tuple[str, int, int, int | None]] = {
    "sd35-medium": ("sd3", 77 + 256, 4096, 2048),
    "qwen-image": ("qwen_image", 64, 3584, None),
    "z-image": ("z_image", 64, 2560, None),
    "tiny-sd3": ("sd3", 77 + 32, 64, 64),
    "tiny-qwen": ("qwen_image", 16, 32, None),
    "tiny-z-image": ("z_image", 16, 32, None),
}


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


class BenchZImageAdapter(_RandomPromptsMixin, ZImageAdapter):
    pass


BENCH_ADAPTERS = {"sd3": BenchSD3Adapter, "qwen_image": BenchQwenImageAdapter, "z_image": BenchZImageAdapter}


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
    from diffusers import (
        AutoencoderKL,
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
        SD3Transformer2DModel,
        ZImageTransformer2DModel,
    )

    if name == "z-image":
        config = dict(Z_IMAGE_TRANSFORMER, **({} if num_layers is None else {"n_layers": num_layers}))
        transformer = build_random_module(ZImageTransformer2DModel, config, device, dtype, seed=0)
        vae = build_random_module(AutoencoderKL, Z_IMAGE_VAE, device, dtype, seed=1)
        return transformer, vae, FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER)
    if name == "sd35-medium":
        config = dict(SD35_MEDIUM_TRANSFORMER)
        if num_layers is not None:
            config["num_layers"] = num_layers
            config["dual_attention_layers"] = tuple(i for i in config["dual_attention_layers"] if i < num_layers)
        transformer = build_random_module(SD3Transformer2DModel, config, device, dtype, seed=0)
        vae = build_random_module(AutoencoderKL, SD35_MEDIUM_VAE, device, dtype, seed=1)
        return transformer, vae, FlowMatchEulerDiscreteScheduler(shift=3.0)
    config = dict(QWEN_IMAGE_TRANSFORMER)
    if num_layers is not None:
        config["num_layers"] = num_layers
    transformer = build_random_module(QwenImageTransformer2DModel, config, device, dtype, seed=0)
    vae = build_random_module(AutoencoderKLQwenImage, QWEN_IMAGE_VAE, device, dtype, seed=1)
    return transformer, vae, FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)


def _tiny_modules(name: str, device: torch.device, dtype: torch.dtype):
    from flowrl.models.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline(ARCHITECTURES[name][0], seed=0)
    modules = [m.to(device=device, dtype=dtype).eval().requires_grad_(False) for m in (pipe.transformer, pipe.vae)]
    return modules[0], modules[1], pipe.scheduler


def _pipeline(family: str, transformer, vae, scheduler):
    """The family's diffusers pipeline over these modules, text encoders None (prompts are
    passed as embeddings)."""
    if family == "sd3":
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=scheduler,
            vae=vae,
            text_encoder=None,
            tokenizer=None,
            text_encoder_2=None,
            tokenizer_2=None,
            text_encoder_3=None,
            tokenizer_3=None,
        )
    else:
        from diffusers import QwenImagePipeline, ZImagePipeline

        cls = ZImagePipeline if family == "z_image" else QwenImagePipeline
        pipe = cls(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer)
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
    adapter = BENCH_ADAPTERS[family](pipe, device, dtype)
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


def pipeline_prompt_kwargs(bench: BenchModel, prompts: list[str], guidance_scale: float) -> dict:
    """Precomputed prompt embeddings as the family's pipeline takes them (batch = len(prompts)),
    with the empty negative prompt's embeddings when guidance_scale > 1."""
    adapter = bench.adapter
    encodings = adapter.encode_prompts(prompts)
    uses_cfg = guidance_scale > 1.0
    negatives = adapter.encode_prompts([""]) * len(prompts) if uses_cfg else None
    if bench.family == "z_image":
        # Unpadded captions, as the pipeline's own encoder gives them; its guidance_scale is
        # flowrl's minus 1 (flowrl.models.z_image), and 0 turns guidance off.
        kwargs = dict(prompt_embeds=[e.embeds for e in encodings], guidance_scale=max(guidance_scale - 1.0, 0.0))
        if uses_cfg:
            kwargs.update(negative_prompt_embeds=[e.embeds for e in negatives])
        return kwargs
    embeds, mask, pooled = pad_encodings(encodings)
    if bench.family == "sd3":
        kwargs = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, guidance_scale=guidance_scale)
        if uses_cfg:
            neg_embeds, _, neg_pooled = pad_encodings(negatives)
            kwargs.update(negative_prompt_embeds=neg_embeds, negative_pooled_prompt_embeds=neg_pooled)
        return kwargs
    # Qwen-Image: no mask when nothing is padded (what the pipeline does itself; keeps fast kernels).
    padded = len({e.embeds.shape[0] for e in encodings}) > 1
    kwargs = dict(prompt_embeds=embeds, prompt_embeds_mask=mask if padded else None, true_cfg_scale=guidance_scale)
    if uses_cfg:
        neg_embeds, _, _ = pad_encodings(negatives)
        kwargs.update(negative_prompt_embeds=neg_embeds, negative_prompt_embeds_mask=None)
    return kwargs
