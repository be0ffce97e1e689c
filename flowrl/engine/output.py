"""DiffusionOutput: what the engine returns for one sample (FLOWGRPO.md section 3).

`sigmas[k]` is the noise level in [0, 1] at which SDE-window step k starts, `next_sigmas[k]` the
one it ends at. The trainer recomputes step k from (all_latents[k], sigmas[k], next_sigmas[k]) and
scores all_latents[k + 1] with the sample's own `transition_spec`: the settings it was drawn
with, so a request's per-row overrides are re-scored as they were sampled. This module is the
output's contract only: it knows nothing about models, scheduling or training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from flowrl.sampling_params import SamplingParams, SdeType


@dataclass(frozen=True)
class TransitionSpec:
    """The sampling settings a sample's SDE transitions were drawn with: everything, besides the
    stored tensors, that re-scoring a transition needs. The schedule (and so the sigma_1 that the
    "sde" step uses at sigma 1) is the model's function of (num_inference_steps, height, width).
    Rows with different sizes or step types cannot share a scoring pass (`group_key`).
    guidance_scale and true_cfg_scale: as SamplingParams; the adapter's guidance rule
    (flowrl.models.base: cfg_scale, rows_per_sample) reads them as the engine did."""

    height: int
    width: int
    num_inference_steps: int
    noise_level: float
    sde_type: SdeType
    guidance_scale: float
    true_cfg_scale: float = 1.0
    num_frames: int = 1

    @classmethod
    def of(cls, params: SamplingParams) -> "TransitionSpec":
        return cls(**{f.name: getattr(params, f.name) for f in dataclasses.fields(cls)})

    @property
    def group_key(self) -> tuple[int, int, int, str]:
        """Rows with equal keys can be scored in one forward and one sampler call."""
        return (self.height, self.width, self.num_frames, self.sde_type)

    @classmethod
    def to_columns(cls, specs: Sequence["TransitionSpec"]) -> dict[str, list]:
        """Per-row columns, one per field (a RolloutBatch's non-tensor fields of these names)."""
        return {f.name: [getattr(spec, f.name) for spec in specs] for f in dataclasses.fields(cls)}

    @classmethod
    def from_columns(cls, columns: Mapping[str, Sequence]) -> list["TransitionSpec"]:
        """The rows' specs from columns written by `to_columns` (e.g. a rollout's non_tensor_batch)."""
        # A field with a default (num_frames) may be absent: rollouts recorded before it existed.
        names = [f.name for f in dataclasses.fields(cls) if f.name in columns or f.default is dataclasses.MISSING]
        missing = [name for name in names if name not in columns]
        if missing:
            raise ValueError(
                f"the rollout has no per-row fields {missing}: it was not produced by the agent loop, "
                "which records the settings each sample was drawn with"
            )
        return [cls(**dict(zip(names, row))) for row in zip(*(columns[name] for name in names))]


@dataclass
class DiffusionOutput:
    """One generated sample.

    image: (3, H, W) uint8; a video (SamplingParams.num_frames, a video model) is (F, 3, H, W).
    all_latents: (W + 1, *latent_shape) float32: the latent entering the SDE window, then the
        latent after each window step (latent layout is the adapter's model-input layout). A
        deterministic request without log-probs and window settings has no window (W = 0): the
        final latent alone.
    all_log_probs: (W,) float32 log-prob of each window transition (mean over latent elements),
        or None when log-probs were not requested.
    sigmas / next_sigmas: (W,) float32 noise levels at the start / end of each window step.
    prompt_embeds (L, D) model dtype; prompt_embeds_mask (L,) bool; pooled_prompt_embeds (P,) or
        None (SD3 only). negative_*: the same for the uncond row, None without CFG.
    seed: the seed of this sample's generator. policy_version: the engine's policy version when
        the sample was admitted. sde_window: (start, end) step indices.
    transition_spec: the settings the sample was drawn with (TransitionSpec).
    timings: seconds spent queued, denoising and decoding.
    """

    prompt: str
    image: torch.Tensor
    all_latents: torch.Tensor
    all_log_probs: torch.Tensor | None
    sigmas: torch.Tensor
    next_sigmas: torch.Tensor
    prompt_embeds: torch.Tensor
    prompt_embeds_mask: torch.Tensor
    pooled_prompt_embeds: torch.Tensor | None
    negative_prompt_embeds: torch.Tensor | None
    negative_prompt_embeds_mask: torch.Tensor | None
    negative_pooled_prompt_embeds: torch.Tensor | None
    seed: int
    policy_version: int
    sde_window: tuple[int, int]
    transition_spec: TransitionSpec
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        # One home for the contract's invariants.
        num_window = self.sigmas.shape[0]
        assert self.image.dtype == torch.uint8 and self.image.dim() in (3, 4) and self.image.shape[-3] == 3
        assert self.all_latents.dtype == torch.float32
        assert self.all_latents.shape[0] == num_window + 1
        assert self.next_sigmas.shape == self.sigmas.shape
        if self.all_log_probs is not None:
            assert self.all_log_probs.shape == (num_window,)
            assert self.all_log_probs.dtype == torch.float32
        assert self.prompt_embeds_mask.dtype == torch.bool
        assert self.prompt_embeds_mask.shape[0] == self.prompt_embeds.shape[0]
