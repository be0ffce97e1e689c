"""The one home of the sampling math shared by the rollout engine and the trainer.

Vocabulary (FLOWGRPO.md section 1):
- `sigma` in [0, 1] is the noise level: x_sigma = (1 - sigma) * x0 + sigma * noise.
- The transformer predicts a velocity v (about noise - x0); a step goes from sigma s to
  s' < s with dt = s' - s < 0.
- `noise_level` a scales the injected noise; a = 0 turns every step type into the Euler ODE step
  x' = x + v * dt.

Every tensor argument is per row: x, v are (B, ...) and s, s', a are (B,), so one call steps rows
that sit at different points of their schedules. All math runs in float32. The log-prob is
reduced by a MEAN over the non-batch dims, one scalar per (row, step).

`sde_step` either samples the next latent from caller-supplied standard-normal noise (rollout: each
sample owns its generator, so the engine draws the noise) or scores a given next latent (training:
`next_latents=` the stored one). Both paths share the same mean/std code, which is what keeps
rollout and trainer log-probs equal.

`data_prediction`, `dpmpp_2m_coefficients` and `multistep_update` make MixGRPO-Flash's
second-order multistep ODE step (DPM-Solver++(2M)) from a sample's previous data prediction, which
the caller keeps per sample; `compress_tail` gives the shorter schedule after its SDE window.

This module is tensor math only: it knows nothing about models, engines, configs or training
(the list of step types is `flowrl.sampling_params.SdeType`, plain data).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

import torch

from flowrl.sampling_params import SdeType

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass
class StepResult:
    """next_latents (B, ...); log_prob (B,) (undefined where std == 0: those rows are ODE steps);
    mean (B, ...) the Gaussian mean; std (B,) the transition std; kl_std (B,) the std the KL term
    divides by (`kl_to_reference`): for "sde" the diffusion coefficient std_t = a * sqrt(s / (1 - s))
    without the step's sqrt(-dt), as Flow-GRPO's KL (and the betas tuned with it) has it (for
    "dance" its constant a); for "cps" the transition std itself. velocity (B, ...): the velocity
    the step took (float32), for a KL on the velocity."""

    next_latents: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    kl_std: torch.Tensor
    velocity: torch.Tensor | None = None


def _per_row(t: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a (B,) tensor or a float to like's rank: (B, 1, 1, ...), float32."""
    t = torch.as_tensor(t, dtype=torch.float32, device=like.device)
    if t.dim() == 0:
        t = t.expand(like.shape[0])
    return t.reshape(-1, *([1] * (like.dim() - 1)))


def _mean_over_elements(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).mean(dim=1)


def sde_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: torch.Tensor | float,
    sde_type: SdeType = "sde",
    noise: torch.Tensor | None = None,
    next_latents: torch.Tensor | None = None,
    sigma_first_step: torch.Tensor | float | None = None,
) -> StepResult:
    """One denoising step with the log-prob of the transition.

    latents, velocity: (B, ...) (cast to float32). sigma, sigma_next: (B,) noise levels.
    noise_level: a, float or (B,). sde_type: "sde" (Flow-GRPO), "dance" (DanceGRPO: "sde"'s mean
        with the constant diffusion coefficient a, std = a * sqrt(s - s')) or "cps"
        (coefficient-preserving).
    noise: standard normal (B, ...) used to sample next latents (None with next_latents given).
    next_latents: score these instead of sampling (training recompute).
    sigma_first_step: for "sde", the schedule's second sigma (sigma_1), used in place of s in
        std_t = a * sqrt(s / (1 - s)) where s == 1, as Flow-GRPO does (the ratio is infinite there).
        None uses s itself, so callers whose schedule starts at 1 must pass it (the engine and
        the trainer pass schedule[1]).
    """
    if sde_type not in get_args(SdeType):
        raise ValueError(f"sde_type={sde_type!r} is unknown; use one of {get_args(SdeType)}")
    if (noise is None) == (next_latents is None):
        raise ValueError("pass exactly one of noise= (sample the next latent) or next_latents= (score it)")
    x = latents.float()
    v = velocity.float()
    s = _per_row(sigma, x)
    s_next = _per_row(sigma_next, x)
    a = _per_row(noise_level, x)
    dt = s_next - s

    if sde_type == "sde":
        if sigma_first_step is None:
            s_den = s
        else:
            s_den = torch.where(s >= 1.0, _per_row(sigma_first_step, x), s)
        # where(): a = 0 (ODE rows) must give std 0 even where the ratio is infinite.
        std_t = torch.where(a > 0, a * torch.sqrt(s / (1.0 - s_den)), torch.zeros_like(s))
    elif sde_type == "dance":
        # DanceGRPO: the same drift with a constant diffusion coefficient eta = a, finite at s = 1.
        std_t = a.expand_as(s)
    if sde_type in ("sde", "dance"):
        mean = x + v * dt + (std_t**2 / (2.0 * s)) * (x + (1.0 - s) * v) * dt
        std = std_t * torch.sqrt(-dt)
        kl_std = std_t
    else:  # cps
        angle = a * (math.pi / 2.0)
        std = s_next * torch.sin(angle)
        x0_hat = x - s * v
        x1_hat = x + (1.0 - s) * v
        mean = (1.0 - s_next) * x0_hat + s_next * torch.cos(angle) * x1_hat
        kl_std = std

    if next_latents is None:
        nxt = mean + std * noise.float()
    else:
        nxt = next_latents.float()

    diff_sq = (nxt - mean) ** 2
    if sde_type in ("sde", "dance"):
        # Rows with std == 0 (ODE rows) get a harmless std of 1 here; their log-prob is unused.
        safe_std = torch.where(std > 0, std, torch.ones_like(std))
        log_prob = -diff_sq / (2.0 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    else:
        # Constants dropped on purpose (the cps log-prob is a scaled squared distance).
        log_prob = -diff_sq
    return StepResult(
        next_latents=nxt,
        log_prob=_mean_over_elements(log_prob),
        mean=mean,
        std=std.reshape(-1),
        kl_std=kl_std.reshape(-1),
        velocity=v,
    )


def ode_step(
    latents: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
) -> torch.Tensor:
    """The Euler ODE step x' = x + v * (s' - s), in float32."""
    x = latents.float()
    return x + velocity.float() * (_per_row(sigma_next, x) - _per_row(sigma, x))


def data_prediction(latents: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The model's prediction of the clean sample, x0 = x - sigma * v, in float32 (B, ...)."""
    x = latents.float()
    return x - _per_row(sigma, x) * velocity.float()


def dpmpp_2m_coefficients(sigma_prev: float, sigma: float, sigma_next: float) -> tuple[float, float, float]:
    """(c_x, c_0, c_prev) of one DPM-Solver++(2M) step from sigma to sigma_next (0 < sigma_next <
    sigma < sigma_prev <= 1): x' = c_x * x + c_0 * x0 + c_prev * x0_prev, with x0 the data
    prediction at sigma and x0_prev the one at sigma_prev (the previous step's).

    DPM-Solver++ (arXiv 2211.01095, the multistep second-order update) on the rectified flow's
    alpha = 1 - sigma, with lambda = log(alpha / sigma), h = lambda' - lambda,
    r = (lambda - lambda_prev) / h, D = x0 + (x0 - x0_prev) / (2 r):
    x' = (sigma' / sigma) x + alpha' (1 - exp(-h)) D. At sigma_prev = 1 (lambda_prev = -inf) the
    correction vanishes and the step is first order, which on a rectified flow is the Euler step.
    Host floats in double precision: the caller sends them to the device with the step's scalars.
    """
    if not 0.0 < sigma_next < sigma < sigma_prev <= 1.0:
        raise ValueError(
            f"dpmpp_2m_coefficients needs 0 < sigma_next < sigma < sigma_prev <= 1, got "
            f"({sigma_prev}, {sigma}, {sigma_next})"
        )
    alpha, alpha_next = 1.0 - sigma, 1.0 - sigma_next
    first_order = alpha_next - sigma_next * alpha / sigma  # alpha' (1 - exp(-h))
    if sigma_prev >= 1.0:
        return sigma_next / sigma, first_order, 0.0
    lam = math.log(alpha / sigma)
    h = math.log(alpha_next / sigma_next) - lam
    half_inverse_r = h / (2.0 * (lam - math.log((1.0 - sigma_prev) / sigma_prev)))
    return sigma_next / sigma, first_order * (1.0 + half_inverse_r), -first_order * half_inverse_r


def multistep_update(
    latents: torch.Tensor, x0: torch.Tensor, x0_prev: torch.Tensor, coefficients: torch.Tensor
) -> torch.Tensor:
    """x' = c_x * x + c_0 * x0 + c_prev * x0_prev per row, in float32; coefficients (3, B) as
    `dpmpp_2m_coefficients` gives them, one column per row."""
    x = latents.float()
    c_x, c_0, c_prev = (_per_row(c, x) for c in coefficients.float())
    return c_x * x + c_0 * x0.float() + c_prev * x0_prev.float()


def compress_tail(sigmas: list[float], start: int, ratio: float) -> list[float]:
    """MixGRPO-Flash's shorter ODE tail: the schedule `sigmas` (T + 1 values ending at 0) with its
    n = T - start steps from step `start` (the SDE window's end) to sigma 0 replaced by
    max(int((n + 1) * ratio), 2) - 1 steps. As MixGRPO-Flash's dpm_post_compress_ratio, the new
    points lie evenly spaced in the schedule's step index from `start` to T; between two of the
    schedule's sigmas a point's sigma is interpolated linearly (MixGRPO evaluates its time shift
    there instead). sigmas[:start + 1] are kept as they are."""
    steps = len(sigmas) - 1
    tail = steps - start
    points = max(int((tail + 1) * ratio), 2)
    if not 0 <= start < steps or points >= tail + 1:
        return list(sigmas)
    out = list(sigmas[: start + 1])
    for j in range(1, points - 1):
        position = start + j * tail / (points - 1)
        i = int(position)
        out.append(sigmas[i] + (position - i) * (sigmas[i + 1] - sigmas[i]))
    out.append(sigmas[-1])
    return out


def kl_to_reference(step: StepResult, mean_ref: torch.Tensor) -> torch.Tensor:
    """The KL term of `step` (the policy's) to the reference policy's step mean `mean_ref`, per row
    (B,): mean over elements of (mu - mu_ref)^2 / (2 kl_std^2) (see StepResult.kl_std). For "sde"
    this is Flow-GRPO's form, which divides by std_t^2 and not by the transition variance
    std_t^2 * (-dt): the published KL weights (e.g. 0.04 for SD3.5) were tuned with it."""
    sq = _mean_over_elements((step.mean.float() - mean_ref.float()) ** 2)
    return sq / (2.0 * step.kl_std.float() ** 2)


def default_sde_window(num_steps: int) -> tuple[int, int]:
    """With no window configured every step but the last is stochastic (the last step, whose
    sigma_next is 0, has a degenerate Gaussian)."""
    return (0, max(num_steps - 1, 0))


def draw_sde_window(
    num_steps: int, size: int, window_range: tuple[int, int] | None, generator: torch.Generator
) -> tuple[int, int]:
    """Draw start ~ U{lo .. hi - size} and return [start, start + size)."""
    lo, hi = window_range if window_range is not None else (0, num_steps - 1)
    start = int(torch.randint(lo, hi - size + 1, (1,), generator=generator).item())
    return (start, start + size)


def progressive_sde_window(
    num_steps: int, size: int, window_range: tuple[int, int] | None, position: int, shift: int
) -> tuple[int, int]:
    """MixGRPO's progressive window: the `position`-th (from 0) of the windows of `size` steps
    starting at lo, lo + shift, lo + 2 * shift, ..., starting over at lo once a window would end
    past hi ([lo, hi): window_range, default every step but the last)."""
    lo, hi = window_range if window_range is not None else (0, num_steps - 1)
    count = (hi - size - lo) // shift + 1
    start = lo + (position % count) * shift
    return (start, start + size)
