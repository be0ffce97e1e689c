"""The model-adapter interface shared by the engine and the trainer.

An adapter wraps the diffusers modules of one model family (transformer, VAE, text encoders,
scheduler config) and exposes exactly what rollout and training need, in float32 at its
boundaries (latents, sigmas, velocities), whatever dtype the modules run in:

- `encode_prompts(prompts)` -> one `PromptEncoding` per prompt (unpadded, mask all True for
  families with variable-length text; SD3's fixed-length encoding keeps its full length).
- `sigmas(num_steps, height, width)` -> (T + 1,) float32 decreasing schedule ending at 0.
- `initial_noise(height, width, generator)` -> latent-shaped float32 noise.
- `velocity(latents, sigmas, cond, uncond, guidance_scale, height, width, sigma_values=None)` ->
  guided velocity for a batch of rows that may sit at different sigmas and use different prompts;
  CFG rows (cond and uncond) run in the same transformer forward. `guidance_scale` (B,): each
  row's classifier-free guidance weight, `cfg_scale(params)` (rows without an uncond encoding
  ignore it). `sigma_values`: the same sigmas as host floats, which the engine passes so that an
  adapter can decide per-timestep work without reading the device (Z-Image's CFG truncation);
  results do not depend on it. A guidance-distilled adapter also takes
  `embedded_guidance` (B,), the value of its guidance embedding (`guidance_embedding_kwargs`).
- `decode(latents, height, width)` -> (B, 3, H, W) uint8 images; a video family's (B, F, 3, H, W).
- `is_trained_sigma(sigmas)` -> bool per sigma: whether `transformer`, the module training changes,
  predicts there (every sigma, unless a second expert predicts some: Wan2.2-A14B).

Videos (`frame_factor` set: Wan): `SamplingParams.num_frames` frames of the form frame_factor * k
+ 1 (`check_frames`, the one home of that rule). `frame_kwargs(params)` is what `initial_noise`
and `latent_shape` take besides the size (the frame count for a video family, nothing for an
image family); the other methods read the frame count from the latents.

Guidance semantics (`guidance_kind`, one rule for every caller): "cfg" families (SD3, Qwen-Image,
Z-Image) read `SamplingParams.guidance_scale` as the classifier-free guidance weight, > 1 adding
an uncond row to the same forward; "distilled" families (FLUX.1 [dev]) feed guidance_scale to the
transformer's guidance embedding, one row per sample, and add an uncond row (the negative prompt)
only for `true_cfg_scale` > 1. `cfg_scale`, `rows_per_sample` and `check_guidance` are the one
home of that rule: the engine's scheduler and executor and the trainer's re-scoring ask them.

The adapter knows nothing about requests, scheduling or rewards, nor about compilation: the
engine's `compile` option hands an adapter to flowrl.accel.compile_adapter, which compiles its
modules in place (results stay the same function of the inputs). Which pipeline is which family:
flowrl.models.registry.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Literal

import torch

from flowrl.config.sections import MixedPrecision

# trainer.mixed_precision -> the torch.autocast dtype of the trainer's forward and of the rollout
# engine's (DiffusionEngine.set_mixed_precision), so that both sides compute alike.
MIXED_PRECISION_DTYPES: dict[MixedPrecision, torch.dtype | None] = {
    "no": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def mixed_precision(device: torch.device, dtype: torch.dtype | None):
    """The torch.autocast context of `dtype` on `device` (MIXED_PRECISION_DTYPES' values; None: a
    context that changes nothing): the one way the engine's and the trainer's forwards enter it."""
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


# How SamplingParams.guidance_scale acts on a family (see the module docstring).
GuidanceKind = Literal["cfg", "distilled"]


@dataclass
class PromptEncoding:
    """Text conditioning of one prompt: embeds (L, D) in the model dtype, mask (L,) bool,
    pooled (P,) or None."""

    embeds: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor | None = None

    def to(self, device) -> "PromptEncoding":
        pooled = None if self.pooled is None else self.pooled.to(device)
        return PromptEncoding(self.embeds.to(device), self.mask.to(device), pooled)


def pad_encodings(encodings: list[PromptEncoding]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stack encodings of different lengths: right-pad embeds with zeros and masks with False.

    Right padding is exact for both families: text positions start at 0 for every row, and padded
    positions are masked out of attention (Qwen-Image) or absent (SD3 has one fixed length).
    """
    max_len = max(e.embeds.shape[0] for e in encodings)
    dim = encodings[0].embeds.shape[1]
    ref = encodings[0].embeds
    embeds = ref.new_zeros((len(encodings), max_len, dim))
    mask = torch.zeros((len(encodings), max_len), dtype=torch.bool, device=ref.device)
    for row, enc in enumerate(encodings):
        length = enc.embeds.shape[0]
        embeds[row, :length] = enc.embeds
        mask[row, :length] = enc.mask
    pooled = None
    if encodings[0].pooled is not None:
        pooled = torch.stack([e.pooled for e in encodings])
    return embeds, mask, pooled


def host_to_device(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` on `device` (as `dtype`, when given) without a host sync.

    A copy from pageable host memory (`t.to("cuda")`, `torch.tensor(list, device="cuda")`) waits
    for the stream, a full host sync inside a loop of forwards; a host tensor staged in pinned
    memory and copied without blocking does not (the pinned block is reused only after its copy)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory().to(device, non_blocking=True)
    return t.to(device, dtype)


def free_memory_bytes(device: torch.device) -> int:
    """Memory a new allocation on `device` can use now: the device's free memory plus what the
    caching allocator holds unused (CUDA), or the host's available memory (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def rows_to_device(rows: list[int], device: torch.device) -> torch.Tensor:
    """A (len(rows),) int64 index tensor on `device` without a host sync (host_to_device)."""
    return host_to_device(torch.tensor(rows, dtype=torch.int64), device)


def with_cfg_rows(per_row: torch.Tensor, cfg_rows: list[int]) -> torch.Tensor:
    """`per_row` (B, ...) followed by its rows `cfg_rows`: the same input for each uncond row of a
    CFG forward. Every row using CFG (the usual case) is a plain concatenation, no index tensor."""
    if not cfg_rows:
        return per_row
    if len(cfg_rows) == per_row.shape[0]:
        return torch.cat([per_row, per_row])
    return torch.cat([per_row, per_row.index_select(0, rows_to_device(cfg_rows, per_row.device))])


def cfg_forward_inputs(
    latents: torch.Tensor, sigmas: torch.Tensor, cond: list[PromptEncoding], uncond: list[PromptEncoding | None]
):
    """Rows of one CFG forward: every row's cond input, then the uncond inputs of the rows that
    have an uncond encoding. Returns (latents, sigmas, encodings, cfg_rows)."""
    cfg_rows = [i for i, u in enumerate(uncond) if u is not None]
    encodings = list(cond) + [uncond[i] for i in cfg_rows]
    return with_cfg_rows(latents, cfg_rows), with_cfg_rows(sigmas, cfg_rows), encodings, cfg_rows


def combine_cfg(
    out: torch.Tensor, num_cond: int, cfg_rows: list[int], guidance_scale: torch.Tensor, renormalize: bool
) -> torch.Tensor:
    """Guided velocity from a forward whose first num_cond rows are cond and whose remaining rows
    are the uncond rows of `cfg_rows`: v = v_u + g (v_c - v_u). With renormalize (Qwen-Image true
    CFG), rescale each token's guided vector to the norm of its cond vector."""
    cond_v = out[:num_cond]
    if not cfg_rows:
        return cond_v
    every_row = len(cfg_rows) == num_cond
    index = None if every_row else rows_to_device(cfg_rows, out.device)
    c = cond_v if every_row else cond_v.index_select(0, index)
    u = out[num_cond:]
    g = guidance_scale.to(out.device, torch.float32)
    g = g if every_row else g.index_select(0, index)
    g = g.reshape(-1, *([1] * (c.dim() - 1)))
    guided = u + g * (c - u)
    if renormalize:
        guided = guided * (c.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
    return guided if every_row else cond_v.index_copy(0, index, guided)


def check_guidance(guidance_kind: GuidanceKind, params) -> None:
    """ValueError for guidance settings the family cannot honour (`params`: SamplingParams or
    anything with guidance_scale and true_cfg_scale). Errors name SamplingParams' fields."""
    for name in ("guidance_scale", "true_cfg_scale"):
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"SamplingParams.{name}={value!r} must be a finite number")
    if guidance_kind == "cfg" and params.true_cfg_scale != 1.0:
        raise ValueError(
            f"SamplingParams.true_cfg_scale={params.true_cfg_scale} applies to guidance-distilled "
            "models (FLUX.1 [dev]) only; this model's guidance_scale is classifier-free guidance "
            f"already: set guidance_scale={params.true_cfg_scale} and leave true_cfg_scale at 1.0"
        )


def check_frames(frame_factor: int | None, params, max_num_frames: int | None = None) -> None:
    """ValueError for a frame count the family cannot make (`params`: SamplingParams or anything
    with num_frames). frame_factor None: an image family (one frame); else the VAE's temporal
    compression f: the first frame, then groups of f, so num_frames = f k + 1."""
    n = params.num_frames
    if frame_factor is None:
        if n != 1:
            raise ValueError(
                f"SamplingParams.num_frames={n}: this model makes images (one frame); set num_frames=1, "
                "or use a video model (wan2.1, wan2.2)"
            )
        return
    if (n - 1) % frame_factor:
        lower = (n - 1) // frame_factor * frame_factor + 1
        raise ValueError(
            f"SamplingParams.num_frames={n} is not of the form {frame_factor}k+1 (the VAE keeps the first "
            f"frame and folds every {frame_factor} after it into one latent frame); use {lower} or "
            f"{lower + frame_factor}"
        )
    if max_num_frames is not None and n > max_num_frames:
        raise ValueError(f"SamplingParams.num_frames={n} is above this model's {max_num_frames}; use fewer frames")


def to_uint8(image: torch.Tensor) -> torch.Tensor:
    """VAE output in [-1, 1] -> uint8 of the same shape ((B, 3, H, W) for images), rounding
    clamp(x/2 + 0.5, 0, 1) * 255. Non-finite pixels are an error (a NaN would otherwise become a silent 0)."""
    image = image.float()
    if not bool(torch.isfinite(image).all()):
        raise FloatingPointError("VAE decode produced non-finite pixels; check the latents and dtype")
    return ((image / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)


class FlowModelAdapter:
    """Base class; see the module docstring for the contract. Subclasses set the attributes."""

    family: str = "base"
    size_multiple: int = 16  # height and width must be multiples of this
    # The largest height or width in pixels the transformer can take (its position table's
    # size), set by each family from its modules; None: no limit of the model's own.
    max_image_side: int | None = None
    transformer: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    # The pipeline component `transformer` is (its folder in a diffusers checkpoint): the trained
    # module's home when a run's weights are exported.
    trained_component: str = "transformer"

    # LoRA target modules that cover both text and image streams of the family's attention.
    default_lora_targets: tuple[str, ...] = ()
    # How SamplingParams.guidance_scale acts (module docstring).
    guidance_kind: GuidanceKind = "cfg"
    # The most text tokens the family's pipeline encodes (its own check_inputs limit).
    max_sequence_length_limit: int = 512
    # Video families: the VAE's temporal compression (num_frames = frame_factor * k + 1) and the most
    # frames the model takes; image families: None (one frame).
    frame_factor: int | None = None
    max_num_frames: int | None = 1

    def __init__(self, pipeline, device, dtype: torch.dtype, max_sequence_length: int):
        """Keep the pipeline (its encode_prompt is reused) and the modules the engine drives."""
        if not 1 <= max_sequence_length <= self.max_sequence_length_limit:
            raise ValueError(
                f"max_sequence_length={max_sequence_length} (model.max_sequence_length) is outside what the "
                f"{self.family} pipeline encodes; use a value in [1, {self.max_sequence_length_limit}]"
            )
        self.pipeline = pipeline
        self.transformer = pipeline.transformer
        self.vae = pipeline.vae
        self.scheduler = pipeline.scheduler
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_sequence_length = max_sequence_length

    # --- guidance: the one home of how many rows a sample takes and what weighs them ------------
    def cfg_scale(self, params) -> float:
        """The classifier-free guidance weight of a sample (`params`: SamplingParams or the
        trainer's TransitionSpec): guidance_scale for "cfg" families, true_cfg_scale for
        "distilled" ones. Above 1 the sample takes an uncond row."""
        return params.true_cfg_scale if self.guidance_kind == "distilled" else params.guidance_scale

    def rows_per_sample(self, params) -> int:
        """Rows a sample occupies in a forward: 2 with an uncond row (cfg_scale > 1), else 1."""
        return 2 if self.cfg_scale(params) > 1.0 else 1

    def check_guidance(self, params) -> None:
        """ValueError for guidance settings this model cannot honour (see `check_guidance`)."""
        check_guidance(self.guidance_kind, params)

    def guidance_embedding_kwargs(self, guidance_scale: torch.Tensor) -> dict:
        """velocity's keyword arguments for the rows' SamplingParams.guidance_scale (B,): the
        guidance embedding's value for "distilled" families, nothing for "cfg" ones (which read
        guidance_scale as the CFG weight, passed positionally)."""
        return {"embedded_guidance": guidance_scale} if self.guidance_kind == "distilled" else {}

    # --- frames: the one home of a family's frame rule ------------------------------------------
    def check_frames(self, params) -> None:
        """ValueError for a frame count this model cannot make (see `check_frames`)."""
        check_frames(self.frame_factor, params, self.max_num_frames)

    def frame_kwargs(self, params) -> dict:
        """`initial_noise`'s and `latent_shape`'s keyword arguments for a sample's SamplingParams:
        nothing for an image family, the frame count for a video family."""
        return {}

    def encode_prompts(self, prompts: list[str]) -> list[PromptEncoding]:
        raise NotImplementedError

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        raise NotImplementedError

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        raise NotImplementedError

    def initial_noise(self, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        shape = self.latent_shape(height, width)
        return torch.randn(shape, generator=generator, dtype=torch.float32, device=generator.device)

    def velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        cond: list[PromptEncoding],
        uncond: list[PromptEncoding | None],
        guidance_scale: torch.Tensor,
        height: int,
        width: int,
        sigma_values: list[float] | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        raise NotImplementedError

    def is_trained_sigma(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Whether `transformer` (the module training changes) predicts at each of `sigmas`: every
        one, unless the family routes some noise levels to another module (Wan2.2-A14B's experts)."""
        return torch.ones(sigmas.shape, dtype=torch.bool, device=sigmas.device)
