"""Sampling parameters of one request, and their validation.

`SamplingParams` is plain data shared by the config, the agent loop, the engine and the sampler.
It knows nothing about torch, models or engines and imports only the standard library, so
importing it never pulls in the engine or torch's compiler. `validate()` checks everything that
does not depend on the model; the engine adds the model's size multiple and its guidance rule
(how many rows a sample takes: flowrl.models.base). Every error names the field, the value and
the fix.

`SdeType` is the one list of step types; `flowrl.sampler` implements each of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

# "sde": Flow-GRPO's SDE step; "cps": the coefficient-preserving step (FLOWGRPO.md section 1).
SdeType = Literal["sde", "cps"]


@dataclass
class SamplingParams:
    """How to sample one image.

    height, width: image size in pixels (a multiple of the model's size factor: 16 for SD3 and
        Qwen-Image).
    num_inference_steps: denoising steps T (the schedule has T + 1 sigmas, ending at 0).
    guidance_scale: the model's guidance g. On classifier-free-guidance models (SD3, Qwen-Image)
        g > 1 runs cond and uncond rows in one forward (Qwen-Image "true CFG") and g <= 1 the
        cond row only; on guidance-distilled models (FLUX.1 [dev]) g is the value of the
        transformer's guidance embedding, one row per sample (flowrl.models.base says which).
    true_cfg_scale: classifier-free guidance on top of a guidance-distilled model: > 1 adds the
        uncond row (negative_prompt) to the same forward, as FluxPipeline's true_cfg_scale does.
        Must stay 1.0 on classifier-free-guidance models (their guidance_scale is that already).
    negative_prompt: text of the uncond row, when there is one (None means the empty string).
    noise_level: the SDE noise level a; 0 makes every step the Euler ODE step.
    sde_type: "sde" (Flow-GRPO) or "cps" (coefficient-preserving).
    sde_window: explicit [start, end) step indices that are stochastic; None lets the engine
        choose (see sde_window_size).
    sde_window_size, sde_window_range: when sde_window is None and sde_window_size is set, the
        engine draws start ~ U{lo .. hi - size} once per engine call (shared by all samples of a
        generate_batched call), from a generator seeded by `seed`. When both are None, every step
        but the last is stochastic.
    seed: seed of the sample's own noise generator (None: fresh randomness).
    logprobs: record the per-step log-prob of the window steps.
    """

    height: int = 512
    width: int = 512
    num_inference_steps: int = 10
    guidance_scale: float = 1.0
    true_cfg_scale: float = 1.0
    negative_prompt: str | None = None
    noise_level: float = 0.7
    sde_type: SdeType = "sde"
    sde_window: tuple[int, int] | None = None
    sde_window_size: int | None = None
    sde_window_range: tuple[int, int] | None = None
    seed: int | None = None
    logprobs: bool = True

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def validate(self, size_multiple: int = 1) -> "SamplingParams":
        """Raise ValueError naming the bad field; return self when all is well."""
        for name in ("height", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SamplingParams.{name}={value!r} must be a positive integer")
            if value % size_multiple:
                lower = max(size_multiple, value // size_multiple * size_multiple)
                raise ValueError(
                    f"SamplingParams.{name}={value} is not a multiple of {size_multiple}, the "
                    f"model's size factor; use for example {lower} or {lower + size_multiple}"
                )
        if not isinstance(self.num_inference_steps, int) or self.num_inference_steps < 1:
            raise ValueError(f"SamplingParams.num_inference_steps={self.num_inference_steps!r} must be an integer >= 1")
        if self.sde_type not in get_args(SdeType):
            raise ValueError(f"SamplingParams.sde_type={self.sde_type!r} is unknown; use one of {get_args(SdeType)}")
        if not (self.noise_level >= 0.0):
            raise ValueError(f"SamplingParams.noise_level={self.noise_level!r} must be >= 0")
        if self.sde_type == "cps" and self.noise_level > 1.0:
            raise ValueError(
                f"SamplingParams.noise_level={self.noise_level} is above 1, which the 'cps' step "
                "does not allow (its std is sigma_next * sin(a*pi/2)); use a value in [0, 1]"
            )
        if self.logprobs and self.noise_level == 0.0:
            raise ValueError(
                "SamplingParams.logprobs=True with noise_level=0: an ODE step has no density; "
                "set logprobs=False for deterministic (ODE) sampling, or noise_level > 0"
            )
        steps = self.num_inference_steps
        if self.sde_window is not None:
            start, end = self.sde_window
            if not (0 <= start < end <= steps - 1):
                raise ValueError(
                    f"SamplingParams.sde_window={tuple(self.sde_window)} must satisfy "
                    f"0 <= start < end <= num_inference_steps - 1 = {steps - 1} (the last step, "
                    "which ends at sigma 0, is always an ODE step)"
                )
        if self.sde_window_size is not None:
            lo, hi = self.sde_window_range or (0, steps - 1)
            if not (1 <= self.sde_window_size and 0 <= lo and lo + self.sde_window_size <= hi <= steps - 1):
                raise ValueError(
                    f"SamplingParams.sde_window_size={self.sde_window_size} with "
                    f"sde_window_range={(lo, hi)} must satisfy size >= 1 and "
                    f"0 <= lo <= hi - size, hi <= num_inference_steps - 1 = {steps - 1}"
                )
        elif self.sde_window_range is not None:
            raise ValueError(
                "SamplingParams.sde_window_range is set but sde_window_size is None; set "
                "sde_window_size too (the window length to draw inside the range)"
            )
        return self
