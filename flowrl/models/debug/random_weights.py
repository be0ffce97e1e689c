"""Random weights at a published architecture: `model.path=random:NAME`, for speed and memory work
without downloaded weights (`flowrl bench`, and whole training runs on a GPU).

`load_adapter("random:qwen-image", device, dtype)` (flowrl.models.registry, which calls
`load_random_adapter` with the family's classes) returns the family's ordinary adapter
(the same class the checkpoint would load, so the engine, the trainer and flowrl.accel treat it
as the real model) over modules with random weights, with one difference: `encode_prompts` returns
a fixed random embedding per prompt text (seeded by the text) in place of the text encoders, with
the encoders' shapes. The names and their configs are flowrl.models.debug.architectures; the `tiny-*`
names are the tiny pipelines of flowrl.models.debug.tiny.

Big models are built parameter by parameter directly on the target device in the target dtype
(constructing a 20 B model on the CPU takes minutes). Speed does not depend on the weights' values;
the initialisation only keeps activations finite (PyTorch's default scale). Images from random
weights are noise and rewards on them mean nothing, so loading one says so loudly, and the adapter
carries `random_weights` (the architecture's name) for the trainer's metrics and summary.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import zlib

import torch

from flowrl.models.base import FlowModelAdapter, PromptEncoding
from flowrl.models.debug.architectures import (
    ARCHITECTURES,
    FIXED_LENGTH_TEXT,
    PIPELINE_SETTINGS,
    RANDOM_WEIGHT_MODULES,
)

RANDOM_PREFIX = "random:"


def is_random_path(path) -> bool:
    """Whether a model path names a random-weight architecture (`random:NAME`)."""
    return str(path).startswith(RANDOM_PREFIX)


def architecture_name(path, key: str = "model.path") -> str:
    """NAME of `random:NAME` (or NAME itself), checked against the known architectures; errors name
    the setting the path came from as `key`."""
    name = str(path).removeprefix(RANDOM_PREFIX)
    if name not in ARCHITECTURES:
        raise ValueError(
            f"{key}={str(path)!r} names no random-weight architecture; use random:NAME with NAME one of "
            f"{', '.join(ARCHITECTURES)}, or a local diffusers folder"
        )
    return name


def random_family(path, key: str = "model.path") -> str:
    """The family ("sd3", "qwen_image", "flux", "z_image", "wan2.1", "wan2.2") of `random:NAME`."""
    return ARCHITECTURES[architecture_name(path, key)][0]


def has_two_random_experts(path) -> bool:
    """Whether `random:NAME` is an architecture with two experts (Wan2.2-T2V-A14B's)."""
    return _two_experts(architecture_name(path))


def _two_experts(name: str) -> bool:
    return "boundary_ratio" in PIPELINE_SETTINGS.get(name, {})


def published_parameter_count(name: str) -> int:
    """The parameters of architecture `name`'s transformer(s) and VAE, counted on the meta device
    (nothing allocated: a check can say what a build would need before it starts one)."""
    import diffusers
    from accelerate import init_empty_weights

    transformer_cls, config, vae_cls, vae_config, _ = RANDOM_WEIGHT_MODULES[name]
    with init_empty_weights():
        transformer = getattr(diffusers, transformer_cls)(**config)
        vae = getattr(diffusers, vae_cls)(**vae_config)
    experts = 2 if _two_experts(name) else 1
    return experts * sum(p.numel() for p in transformer.parameters()) + sum(p.numel() for p in vae.parameters())


def tiny_name(family: str) -> str:
    """The tiny architecture of a family (`random:tiny-...`: the size that runs on a CPU)."""
    return next(name for name, (kind, *_) in ARCHITECTURES.items() if kind == family and name.startswith("tiny-"))


class RandomPromptsMixin:
    """encode_prompts without a text encoder: a fixed random (L, D) embedding per prompt text."""

    text_tokens: int
    text_dim: int
    pooled_dim: int | None
    random_weights: str  # the architecture's name

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


@functools.cache
def random_adapter_class(adapter_class: type[FlowModelAdapter]) -> type[FlowModelAdapter]:
    """The family's adapter class with random prompt embeddings (one class per family)."""
    return type(f"Random{adapter_class.__name__}", (RandomPromptsMixin, adapter_class), {})


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


def _published_modules(name: str, device: torch.device, dtype: torch.dtype, num_layers: int | None):
    import diffusers

    transformer_cls, config, vae_cls, vae_config, scheduler_config = RANDOM_WEIGHT_MODULES[name]
    config = dict(config)
    if num_layers is not None:  # fewer main blocks of every kind, at the published widths
        for key in ("num_layers", "num_single_layers", "n_layers"):  # FLUX's single-stream; Z-Image's n_layers
            if key in config:
                config[key] = num_layers
        if "dual_attention_layers" in config:
            config["dual_attention_layers"] = tuple(i for i in config["dual_attention_layers"] if i < num_layers)
    transformer = build_random_module(getattr(diffusers, transformer_cls), config, device, dtype, seed=0)
    vae = build_random_module(getattr(diffusers, vae_cls), vae_config, device, dtype, seed=1)
    scheduler_config = dict(scheduler_config)  # its `_class_name`, when given, names another scheduler (Wan's)
    scheduler_cls = getattr(diffusers, scheduler_config.pop("_class_name", "FlowMatchEulerDiscreteScheduler"))
    settings = dict(PIPELINE_SETTINGS.get(name, {}))
    if _two_experts(name):  # the low-noise expert: the same architecture, other weights
        second = build_random_module(getattr(diffusers, transformer_cls), config, device, dtype, seed=2)
        settings["transformer_2"] = second
    return transformer, vae, scheduler_cls(**scheduler_config), settings


def _tiny_modules(family: str, device: torch.device, dtype: torch.dtype):
    from flowrl.models.debug.tiny import build_tiny_pipeline, tiny_kind

    pipe = build_tiny_pipeline(tiny_kind(family), seed=0)
    modules = [m.to(device=device, dtype=dtype).eval().requires_grad_(False) for m in (pipe.transformer, pipe.vae)]
    settings = {"expand_timesteps": True} if pipe.config.get("expand_timesteps") else {}  # tiny Wan2.2's
    return modules[0], modules[1], pipe.scheduler, settings


def pipeline_over(pipeline_class: str, transformer, vae, scheduler, **extra):
    """The diffusers pipeline `pipeline_class` over these modules (and `extra`: the checkpoint's
    pipeline settings, a second expert), every other component (text encoders, tokenizers) None:
    prompts are passed as embeddings."""
    import diffusers

    pipeline_cls = getattr(diffusers, pipeline_class)
    own = {"transformer": transformer, "vae": vae, "scheduler": scheduler, **extra}
    others = [p for p in inspect.signature(pipeline_cls.__init__).parameters if p not in ("self", *own)]
    pipe = pipeline_cls(**own, **dict.fromkeys(others))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_random_adapter(
    path: str,
    pipeline_class: str,
    adapter_class: type[FlowModelAdapter],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
    warn: bool = True,
    **options,
) -> FlowModelAdapter:
    """The adapter of `random:NAME` (or NAME) with random weights, built on `device` in `dtype`.

    pipeline_class, adapter_class: the family's entry of flowrl.models.registry.FAMILIES (its
    `load_adapter` passes them; that is the way in).
    num_layers: fewer transformer blocks at the published widths (smoke tests; not for tiny-*).
    options: the family adapter's own options (max_sequence_length, ...); with
    max_sequence_length, prompts are as long as the family's encoder would make them
    (flowrl.models.debug.architectures.FIXED_LENGTH_TEXT). warn: print the random-weights warning.
    """
    name = architecture_name(path)
    device = torch.device(device)
    family, tokens, width, pooled = ARCHITECTURES[name]
    if name.startswith("tiny-"):
        if num_layers is not None:
            raise ValueError(f"num_layers={num_layers} is for the published architectures, not {name!r}")
        transformer, vae, scheduler, settings = _tiny_modules(family, device, dtype)
    else:
        transformer, vae, scheduler, settings = _published_modules(name, device, dtype, num_layers)
    length, prefix = options.get("max_sequence_length"), FIXED_LENGTH_TEXT.get(family)
    if prefix is not None:  # fixed length: the adapter's setting and the prompts' length agree
        if length is None:
            options["max_sequence_length"] = tokens - prefix
        else:
            tokens = prefix + length
    elif length is not None:
        tokens = min(tokens, length)
    pipeline = pipeline_over(pipeline_class, transformer, vae, scheduler, **settings)
    adapter = random_adapter_class(adapter_class)(pipeline, device, dtype, **options)
    adapter.text_tokens, adapter.text_dim, adapter.pooled_dim = tokens, width, pooled
    adapter.random_weights = name
    if warn:
        print(
            f"WARNING: model.path=random:{name} is RANDOM WEIGHTS at the {name} architecture, with random prompt "
            "embeddings in place of the text encoders: images are noise and rewards mean nothing (for speed and "
            "memory measurements only)",
            file=sys.stderr,
            flush=True,
        )
    return adapter
