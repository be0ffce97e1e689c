"""Sampling parameters of one request, and their validation.

`SamplingParams` is plain data shared by the config, the agent loop, the engine and the sampler.
It knows nothing about torch, models or engines and imports only the standard library, so
importing it never pulls in the engine or torch's compiler. `validate()` is the one home of every
field's rules: the config, the engine and the servers call it before anything is queued or loaded
(the engine passes its model's size limits and adds its guidance rule: how many rows a sample
takes, flowrl.models.base). Every error names the field, the value and the fix.

`SdeType` is the one list of step types; `flowrl.sampler` implements each of them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Literal, get_args

# "sde": Flow-GRPO's SDE step; "cps": the coefficient-preserving step (FLOWGRPO.md section 1);
# "dance": DanceGRPO's step, "sde"'s mean with a constant diffusion coefficient (ALGORITHMS.md 1.1).
SdeType = Literal["sde", "cps", "dance"]

# The solvers of the deterministic steps after the SDE window: "euler", or "dpmpp_2m",
# MixGRPO-Flash's second-order multistep DPM-Solver++ (flowrl.sampler.dpmpp_2m_coefficients).
OdeSolver = Literal["euler", "dpmpp_2m"]

# Limits for any model, so an absurd request fails at once instead of in a giant allocation: a
# side of MAX_IMAGE_SIDE pixels, MAX_IMAGE_PIXELS pixels per image (a 2048 x 4096 image), and
# MAX_INFERENCE_STEPS denoising steps. Seeds are non-negative and below 2**63 (int64 everywhere).
MAX_IMAGE_SIDE = 4096
MAX_IMAGE_PIXELS = 2048 * 4096
MAX_INFERENCE_STEPS = 1000
MAX_NUM_FRAMES = 1025  # a video's frames (a model's own rule, e.g. 4k + 1 for Wan, is its adapter's)
MAX_SEED = 2**63 - 1


@dataclass
class SamplingParams:
    """How to sample one image (every field's rules live in `validate`)."""

    height: int = 512
    """Image height in pixels: a multiple of the model's size factor (16 for every family flowrl
    supports), at most MAX_IMAGE_SIDE (or the model's own, smaller limit), MAX_IMAGE_PIXELS per image."""
    width: int = 512
    """Image width in pixels (the same rules)."""
    num_frames: int = 1
    """Frames per sample: 1 for an image model; for a video model (Wan) of the form 4k+1, e.g. 33 or
    81 (the model's rule, flowrl.models.base.check_frames), at most MAX_NUM_FRAMES."""
    num_inference_steps: int = 10
    """Denoising steps T (the schedule has T + 1 sigmas, ending at 0), at most MAX_INFERENCE_STEPS."""
    guidance_scale: float = 1.0
    """The model's guidance g. On classifier-free-guidance models (SD3, Qwen-Image, Z-Image) g > 1
    runs cond and uncond rows in one forward and g <= 1 the cond row only; on guidance-distilled
    models (FLUX.1 [dev]) g is the value of the transformer's guidance embedding, one row per
    sample (flowrl.models.base says which). Z-Image's pipeline counts from the cond prediction, so
    its guidance_scale=g is g + 1 here."""
    true_cfg_scale: float = 1.0
    """Classifier-free guidance on top of a guidance-distilled model: > 1 adds the uncond row
    (negative_prompt) to the same forward, as FluxPipeline's true_cfg_scale does. Must stay 1.0 on
    classifier-free-guidance models (their guidance_scale is that already)."""
    negative_prompt: str | None = None
    """Text of the uncond row, when there is one (null means the empty string)."""
    noise_level: float = 0.7
    """The SDE noise level a; 0 makes every step the Euler ODE step. For `dance` it is DanceGRPO's
    eta (transition std eta * sqrt(sigma - sigma'); 0.3 in its FLUX recipe)."""
    sde_type: SdeType = "sde"
    """`sde` (Flow-GRPO's step), `cps` (coefficient-preserving) or `dance` (DanceGRPO's: the `sde`
    mean with a constant diffusion coefficient, finite at sigma 1)."""
    sde_window: tuple[int, int] | None = None
    """Explicit [start, end) step indices that are stochastic; null lets sde_window_size choose."""
    sde_window_size: int | None = None
    """With sde_window null: the window's length, its start drawn uniformly from sde_window_range
    (default: every start that fits) for each sample, from a generator seeded by the sample's seed
    (sample j of a batched call: seed + j). Both null: every step but the last is stochastic; with
    noise_level 0 and logprobs false, none, and only the final latent is kept."""
    sde_window_range: tuple[int, int] | None = None
    """[lo, hi): where a drawn window may lie (null: every step but the last)."""
    seed: int | None = None
    """Seed of the sample's own noise generator, in [0, MAX_SEED] (null: fresh randomness). In the
    config it stays null: per-row seeds come from rollout.seed / rollout.val_seed."""
    logprobs: bool = True
    """Record the per-step log-prob of the window steps."""
    shared_initial_noise: bool = False
    """The samples of one request (generate_batched's n samples of a prompt) all start from the
    noise of its first sample; each still draws its own SDE noise (DanceGRPO's init_same_noise). A
    request of one sample starts from its own noise either way."""

    ode_solver: OdeSolver = "euler"
    """The solver of the deterministic steps after the SDE window (of every step, for an ODE
    request without a window): `euler`, or `dpmpp_2m`, MixGRPO-Flash's DPM-Solver++(2M): a
    second-order multistep step on the data prediction x0 = x - sigma * v and the sample's
    previous step's (at the first step after the window, the window's last step's, as
    MixGRPO-Flash does); first order, which is the Euler step, where there is no previous step and
    on the last step, to sigma 0. Steps before the window stay Euler, as in MixGRPO-Flash. Needs
    sde_window or sde_window_size, or an ODE request (noise_level 0, logprobs false)."""
    ode_tail_ratio: float = 1.0
    """MixGRPO-Flash's time-step compression (its dpm_post_compress_ratio: 0.4, 0.2 for Flash*):
    the n steps from the SDE window's end to sigma 0 become max(int((n + 1) * ratio), 2) - 1 steps
    over the same stretch of the schedule, evenly spaced in its step index (sigmas interpolated
    linearly between the schedule's own). In (0, 1]; 1.0 keeps every step. Needs sde_window or
    sde_window_size."""

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def validate(
        self, size_multiple: int = 1, max_image_side: int | None = None, num_samples: int = 1
    ) -> "SamplingParams":
        """Raise ValueError naming the bad field, its value and the fix; return self when all is well.

        size_multiple, max_image_side: the model's limits on height and width (its adapter's
        `size_multiple` and `max_image_side`; None: only the general MAX_IMAGE_SIDE).
        num_samples: how many consecutive seeds (seed, seed + 1, ...) the request draws.
        """
        self._validate_size(size_multiple, max_image_side)
        _check_int("num_frames", self.num_frames, 1, MAX_NUM_FRAMES)
        _check_int("num_inference_steps", self.num_inference_steps, 1, MAX_INFERENCE_STEPS)
        _check_real("guidance_scale", self.guidance_scale, "e.g. 1.0 (no CFG) or 4.5")
        _check_real("noise_level", self.noise_level, "e.g. 0.7 (SDE) or 0.0 (ODE)")
        if self.sde_type not in get_args(SdeType):
            _fail("sde_type", self.sde_type, f"is unknown; use one of {get_args(SdeType)}")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            _fail("negative_prompt", self.negative_prompt, "must be a string or None (the empty prompt)")
        if not isinstance(self.logprobs, bool):
            _fail("logprobs", self.logprobs, "must be True or False")
        if not isinstance(self.shared_initial_noise, bool):
            _fail("shared_initial_noise", self.shared_initial_noise, "must be True or False")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED - (num_samples - 1))
        if self.noise_level < 0.0:
            _fail("noise_level", self.noise_level, "must be >= 0")
        if self.sde_type == "cps" and self.noise_level > 1.0:
            _fail(
                "noise_level",
                self.noise_level,
                "is above 1, which the 'cps' step does not allow (its std is sigma_next * sin(a*pi/2)); "
                "use a value in [0, 1]",
            )
        if self.logprobs and self.noise_level == 0.0:
            raise ValueError(
                "SamplingParams.logprobs=True with SamplingParams.noise_level=0: an ODE step has no density; "
                "set logprobs=False for deterministic (ODE) sampling, or noise_level > 0"
            )
        self._validate_window()
        self._validate_ode_tail()
        return self

    def _validate_ode_tail(self) -> None:
        if self.ode_solver not in get_args(OdeSolver):
            _fail("ode_solver", self.ode_solver, f"is unknown; use one of {get_args(OdeSolver)}")
        _check_real("ode_tail_ratio", self.ode_tail_ratio, "in (0, 1], e.g. 0.4 (MixGRPO-Flash's) or 1.0 (every step)")
        if not 0.0 < self.ode_tail_ratio <= 1.0:
            _fail("ode_tail_ratio", self.ode_tail_ratio, "must be in (0, 1], e.g. 0.4 (MixGRPO-Flash's) or 1.0")
        windowed = self.sde_window is not None or self.sde_window_size is not None
        ode_request = self.noise_level == 0.0 and not self.logprobs
        if self.ode_tail_ratio < 1.0 and not windowed:
            fix = (
                "an ODE request without a window has no tail to compress: use fewer num_inference_steps"
                if ode_request
                else "without sde_window or sde_window_size the window covers every step but the last, "
                "which leaves no tail to compress: set sde_window_size (e.g. 4, MixGRPO-Flash's) or ode_tail_ratio=1.0"
            )
            _fail("ode_tail_ratio", self.ode_tail_ratio, fix)
        if self.ode_solver != "euler" and not windowed and not ode_request:
            _fail(
                "ode_solver",
                self.ode_solver,
                "solves the steps after the SDE window, and without sde_window or sde_window_size the window "
                "covers every step but the last (a first-order step either way): set sde_window_size (e.g. 4, "
                "MixGRPO-Flash's), or noise_level=0 and logprobs=false for ODE sampling, or ode_solver='euler'",
            )

    def _validate_size(self, size_multiple: int, max_image_side: int | None) -> None:
        side_limit = MAX_IMAGE_SIDE if max_image_side is None else min(MAX_IMAGE_SIDE, max_image_side)
        for name in ("height", "width"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                _fail(name, value, "must be a positive integer (pixels)")
            if value > side_limit:
                whose = "this model's" if side_limit < MAX_IMAGE_SIDE else "flowrl's (MAX_IMAGE_SIDE)"
                _fail(name, value, f"is above {side_limit}, {whose} largest image side; use at most {side_limit}")
            if value % size_multiple:
                lower = max(size_multiple, value // size_multiple * size_multiple)
                upper = lower + size_multiple if lower + size_multiple <= side_limit else lower - size_multiple
                raise ValueError(
                    f"SamplingParams.{name}={value} is not a multiple of {size_multiple}, the "
                    f"model's size factor; use for example {lower} or {upper}"
                )
        if self.height * self.width > MAX_IMAGE_PIXELS:
            raise ValueError(
                f"SamplingParams.height x SamplingParams.width = {self.height} x {self.width} = "
                f"{self.height * self.width} pixels is above MAX_IMAGE_PIXELS = {MAX_IMAGE_PIXELS}; "
                "use a smaller size, e.g. 2048 x 2048"
            )

    def _validate_window(self) -> None:
        steps = self.num_inference_steps
        if self.sde_window is not None:
            if not _is_int_pair(self.sde_window):
                _fail("sde_window", self.sde_window, "must be None or a pair of step indices [start, end)")
            start, end = self.sde_window
            if not (0 <= start < end <= steps - 1):
                raise ValueError(
                    f"SamplingParams.sde_window={tuple(self.sde_window)} must satisfy "
                    f"0 <= start < end <= num_inference_steps - 1 = {steps - 1} (the last step, "
                    "which ends at sigma 0, is always an ODE step)"
                )
        if self.sde_window_range is not None and not _is_int_pair(self.sde_window_range):
            _fail("sde_window_range", self.sde_window_range, "must be None or a pair of step indices [lo, hi]")
        if self.sde_window_size is not None:
            if not _is_int(self.sde_window_size):
                _fail("sde_window_size", self.sde_window_size, "must be None or an integer >= 1")
            lo, hi = self.sde_window_range or (0, steps - 1)
            if not (1 <= self.sde_window_size and 0 <= lo and lo + self.sde_window_size <= hi <= steps - 1):
                raise ValueError(
                    f"SamplingParams.sde_window_size={self.sde_window_size} with "
                    f"SamplingParams.sde_window_range={(lo, hi)} must satisfy size >= 1 and "
                    f"0 <= lo <= hi - size, hi <= num_inference_steps - 1 = {steps - 1}"
                )
        elif self.sde_window_range is not None:
            raise ValueError(
                "SamplingParams.sde_window_range is set but SamplingParams.sde_window_size is None; set "
                "sde_window_size too (the window length to draw inside the range)"
            )


def _fail(name: str, value, fix: str):
    raise ValueError(f"SamplingParams.{name}={value!r} {fix}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_int_pair(value) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(v) for v in value)


def _check_int(name: str, value, minimum: int, maximum: int) -> None:
    if not _is_int(value) or not minimum <= value <= maximum:
        _fail(name, value, f"must be an integer in [{minimum}, {maximum}]")


def _check_real(name: str, value, example: str) -> None:
    try:
        finite = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        _fail(name, value, f"must be a finite number, {example}")
