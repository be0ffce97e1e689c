"""Wan text-to-video adapters (Wan2.1-T2V 1.3B/14B, Wan2.2-TI2V-5B, Wan2.2-T2V-A14B) over the
diffusers WanPipeline components.

Samples are videos. Latent layout: (C, F', H/s, W/s), the transformer's own input layout (C = 16
for the Wan2.1 VAE, 48 for Wan2.2's; s its spatial factor, 8 or 16; F' = (F - 1) / 4 + 1 latent
frames for F video frames: the VAE keeps the first frame and folds every 4 after it into one).
A request's frame count is SamplingParams.num_frames; `frame_kwargs` hands it to `initial_noise`
and `latent_shape`, and the other methods read it from the latents' frame axis. `decode` returns
(B, F, 3, H, W) uint8 frames.

Text: UMT5 through the pipeline's own encoder; every prompt is zero-padded to max_sequence_length
and the transformer attends to the padding (the pipeline passes no mask), so every row has that
length and the stored mask is all True. Timestep scaling: sigma * 1000 in float32, one per row.
Wan2.2-TI2V's pipeline expands the timestep to one per latent token so that an image-conditioned
first frame can sit at 0; for text to video every token carries the row's timestep, so one per
row is the same function at a fraction of the time-embedding work. CFG rows run in the same
forward (WanPipeline runs two).

Schedule: the checkpoint scheduler's sigmas (UniPC over flow sigmas, shifted by its fixed
`flow_shift`), stepped by flowrl's own SDE/ODE steps as Flow-GRPO's Wan trainer does; a checkpoint
with a FlowMatchEulerDiscreteScheduler gets that one's sigmas, and then the ODE equals the pipeline.

Two experts (Wan2.2-A14B, `transformer_2` present): the checkpoint's `transformer` (the high
expert) predicts at sigma >= `boundary_ratio` and its `transformer_2` (the low expert) below it,
row by row, as the pipeline switches; a batch that straddles the boundary runs one forward per
expert. The low-noise expert uses the same guidance_scale (the pipeline's guidance_scale_2
default). Training takes one expert (model.trained_expert): the adapter's `transformer`, which
the rest of flowrl trains, shards, compiles, saves and syncs, is that expert, and `transformer_2`
the frozen other one; routing goes by role (`high_expert`, `low_expert`), so sampling is the same
function whichever expert trains. `is_trained_sigma` says which sigmas the trained expert
predicts: the steps worth training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from flowrl.models.base import (
    FlowModelAdapter,
    PromptEncoding,
    cfg_forward_inputs,
    combine_cfg,
    pad_encodings,
    rows_to_device,
    to_uint8,
)
from flowrl.models.schedule import schedule_sigmas

DEFAULT_TEXT_LENGTH = 512  # Wan's text length (UMT5 tokens), the length Flow-GRPO's Wan trainer encodes at

Expert = Literal["high", "low"]  # model.trained_expert's choices
# The checkpoint's component (its folder) each expert is: the home of that fact, which export,
# eval and the weight updates' check read.
EXPERT_COMPONENTS: dict[str, str] = {"high": "transformer", "low": "transformer_2"}


def check_trained_expert(trained_expert: str | None, has_two_experts: bool, where: str) -> None:
    """The one rule of model.trained_expert: a choice of two experts, so only a two-expert model
    takes it. `where` names the model in the message."""
    if trained_expert is None:
        return
    if trained_expert not in ("high", "low"):
        raise ValueError(f"model.trained_expert={trained_expert!r} is invalid: use 'high', 'low' or null")
    if not has_two_experts:
        raise ValueError(
            f"model.trained_expert={trained_expert!r} picks one expert of a two-expert Wan2.2 model (A14B), and "
            f"{where} has one transformer; leave model.trained_expert null (unset)"
        )


class WanAdapter(FlowModelAdapter):
    family = "wan"
    max_sequence_length_limit = 512
    frame_factor = 4  # every Wan VAE's temporal compression (the instance reads its VAE's)
    # Flow-GRPO's Wan LoRA targets that the text-to-video transformer has: the projections of
    # self-attention (attn1) and cross-attention (attn2). Its other names (add_q_proj, add_k_proj,
    # add_v_proj, to_add_out) exist only in image-conditioned Wan transformers.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(
        self,
        pipeline,
        device,
        dtype,
        max_sequence_length: int | None = None,
        trained_expert: Expert | None = None,
    ):
        if max_sequence_length is None:
            declared = getattr(getattr(pipeline, "tokenizer", None), "model_max_length", None)
            max_sequence_length = min(DEFAULT_TEXT_LENGTH, int(declared)) if declared else DEFAULT_TEXT_LENGTH
        super().__init__(pipeline, device, dtype, max_sequence_length)
        second = getattr(pipeline, "transformer_2", None)
        check_trained_expert(trained_expert, second is not None, f"the {type(pipeline).__name__}")
        self.trained_expert: Expert | None = trained_expert
        # `transformer`: the trained expert (the high one unless trained_expert="low"); `transformer_2`: the other.
        self.transformer_2 = second
        if trained_expert == "low":
            self.transformer, self.transformer_2 = second, pipeline.transformer
            self.trained_component = EXPERT_COMPONENTS["low"]
        ratio = pipeline.config.get("boundary_ratio") if second is not None else None
        self.boundary_sigma: float | None = None if ratio is None else float(ratio)
        config = self.transformer.config
        self.latent_channels = config.in_channels
        self.frame_factor = int(self.vae.config.scale_factor_temporal or 4)
        self.vae_scale_factor = int(self.vae.config.scale_factor_spatial or 8)
        _, patch_h, _ = config.patch_size
        self.size_multiple = self.vae_scale_factor * patch_h
        # RoPE tables hold rope_max_seq_len positions per axis (frames, height and width patches).
        self.max_image_side = config.rope_max_seq_len * patch_h * self.vae_scale_factor
        self.max_num_frames = (config.rope_max_seq_len - 1) * self.frame_factor + 1
        self._sigma_cache: dict[int, torch.Tensor] = {}

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device="cpu",
        dtype=torch.float32,
        max_sequence_length: int | None = None,
        trained_expert: Expert | None = None,
    ):
        from diffusers import WanPipeline

        from flowrl.models.loading import load_pipeline

        pipeline = load_pipeline(WanPipeline, path, dtype)
        pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        for module in (pipeline.transformer, pipeline.transformer_2, pipeline.vae, pipeline.text_encoder):
            if module is not None:
                module.requires_grad_(False).eval()
        return cls(pipeline, device, dtype, max_sequence_length, trained_expert)

    # --- experts -------------------------------------------------------------------------------
    @property
    def high_expert(self) -> torch.nn.Module:
        """The checkpoint's `transformer`: predicts at sigma >= boundary_sigma."""
        return self.transformer_2 if self.trained_expert == "low" else self.transformer

    @property
    def low_expert(self) -> torch.nn.Module | None:
        """The checkpoint's `transformer_2`: predicts below boundary_sigma (None: one transformer)."""
        return self.transformer if self.trained_expert == "low" else self.transformer_2

    def is_trained_sigma(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Whether `transformer` predicts at each of `sigmas`: every sigma for one transformer,
        else those on its expert's side of the boundary (the rule `_two_expert_forward` routes by)."""
        if self.transformer_2 is None:
            return super().is_trained_sigma(sigmas)
        high = sigmas.double() >= self.boundary_sigma  # as the routing compares host floats
        return ~high if self.trained_expert == "low" else high

    # --- frames -------------------------------------------------------------------------------
    def frame_kwargs(self, params) -> dict:
        return {"num_frames": params.num_frames}

    def latent_frames(self, num_frames: int) -> int:
        return (num_frames - 1) // self.frame_factor + 1

    # --- text -------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[PromptEncoding]:
        embeds, _ = self.pipeline.encode_prompt(
            prompt=list(prompts),
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        mask = torch.ones(embeds.shape[1], dtype=torch.bool, device=self.device)
        return [PromptEncoding(embeds[i], mask, None) for i in range(len(prompts))]

    # --- latents and schedule ----------------------------------------------------------------
    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        s = self.vae_scale_factor
        return (self.latent_channels, self.latent_frames(num_frames), height // s, width // s)

    def initial_noise(self, height: int, width: int, generator: torch.Generator, num_frames: int = 1) -> torch.Tensor:
        shape = self.latent_shape(height, width, num_frames)
        return torch.randn(shape, generator=generator, dtype=torch.float32, device=generator.device)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        if num_steps not in self._sigma_cache:  # fixed shift: independent of the size and frames
            self._sigma_cache[num_steps] = schedule_sigmas(self.scheduler, num_steps)
        return self._sigma_cache[num_steps]

    # --- transformer ---------------------------------------------------------------------------
    def _forward(self, transformer, hidden, sigma, embeds) -> torch.Tensor:
        return transformer(
            hidden_states=hidden.to(self.dtype),
            timestep=sigma.float() * 1000.0,
            encoder_hidden_states=embeds.to(self.dtype),
            return_dict=False,
        )[0].float()

    def velocity(self, latents, sigmas, cond, uncond, guidance_scale, height, width, sigma_values=None):
        hidden, sigma, encodings, cfg_rows = cfg_forward_inputs(latents, sigmas, cond, uncond)
        embeds, _, _ = pad_encodings(encodings)
        if self.transformer_2 is None:
            out = self._forward(self.transformer, hidden, sigma, embeds)
        else:
            out = self._two_expert_forward(hidden, sigma, embeds, sigmas, sigma_values, cfg_rows)
        return combine_cfg(out, len(cond), cfg_rows, guidance_scale, renormalize=False)

    def _two_expert_forward(self, hidden, sigma, embeds, sigmas, sigma_values, cfg_rows) -> torch.Tensor:
        """Each forward row through its expert: the high expert at sigma >= boundary, else the low one."""
        values = sigma_values if sigma_values is not None else sigmas.tolist()
        values = list(values) + [values[i] for i in cfg_rows]  # the uncond rows follow the cond rows
        high = [i for i, s in enumerate(values) if s >= self.boundary_sigma]
        if len(high) == len(values):
            return self._forward(self.high_expert, hidden, sigma, embeds)
        if not high:
            return self._forward(self.low_expert, hidden, sigma, embeds)
        low = [i for i in range(len(values)) if i not in set(high)]
        out = None
        for expert, rows in ((self.high_expert, high), (self.low_expert, low)):
            index = rows_to_device(rows, hidden.device)
            part = self._forward(expert, hidden.index_select(0, index), sigma.index_select(0, index), embeds[rows])
            out = part.new_empty((len(values), *part.shape[1:])) if out is None else out
            out = out.index_copy(0, index, part)
        return out

    # --- VAE -----------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """(B, C, F', h, w) latents -> (B, F, 3, H, W) uint8 frames."""
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean, device=latents.device, dtype=torch.float32).view(shape)
        std = torch.tensor(config.latents_std, device=latents.device, dtype=torch.float32).view(shape)
        x = latents.float() * std + mean
        video = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        return to_uint8(video).permute(0, 2, 1, 3, 4).contiguous()


class Wan21Adapter(WanAdapter):
    """Wan2.1 text to video (the 16-channel VAE, one transformer)."""

    family = "wan2.1"


class Wan22Adapter(WanAdapter):
    """Wan2.2: TI2V-5B (the 48-channel VAE) or T2V-A14B (two experts over the Wan2.1 VAE)."""

    family = "wan2.2"


def has_two_experts(index: dict) -> bool:
    """Whether a WanPipeline model_index.json lists a second transformer (Wan2.2-T2V-A14B)."""
    second = index.get("transformer_2")
    return isinstance(second, list) and bool(second) and second[0] is not None


def wan_version(index: dict) -> str:
    """ "wan2.2" for a WanPipeline model_index.json that declares Wan2.2's settings (per-token
    timesteps, an expert boundary, or a second transformer), else "wan2.1"."""
    if index.get("expand_timesteps") or index.get("boundary_ratio") is not None or has_two_experts(index):
        return "wan2.2"
    return "wan2.1"
