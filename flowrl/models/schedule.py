"""Sigma schedules read from the checkpoint's own FlowMatchEulerDiscreteScheduler config.

The scheduler config in the checkpoint folder is the one home of the shift settings; we let a
private copy of diffusers' scheduler compute the schedule so it matches the family's pipeline
exactly (SD3: fixed shift; Qwen-Image: resolution-dependent "dynamic" shift through mu), then keep
only the sigmas as a float32 tensor. The stateful `scheduler.step` is never used: stepping is
`flowrl.sampler.sde_step`, per row.
"""

from __future__ import annotations

import copy

import numpy as np
import torch


def dynamic_shift_mu(image_seq_len: int, config) -> float:
    """mu of the resolution-dependent shift: linear in the packed image token count between
    (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift)."""
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + (base_shift - slope * base_len)


_ROUND_OFF = 1e-5  # a first sigma this close to 1 is 1


def schedule_sigmas(
    scheduler,
    num_steps: int,
    image_seq_len: int | None = None,
    linear_base: bool = False,
    base_sigmas: list[float] | None = None,
) -> torch.Tensor:
    """Return (num_steps + 1,) float32 sigmas, decreasing from the first sigma to 0.

    linear_base: pass sigmas = linspace(1, 1/T, T) as the unshifted base (what the Qwen-Image
    pipeline does); otherwise the scheduler's default base (what the SD3 pipeline does).
    base_sigmas: the unshifted base as the family's pipeline computes it, where its rounding
    differs from numpy's linspace (Z-Image: torch.linspace in float32); overrides linear_base.
    """
    sched = copy.deepcopy(scheduler)
    kwargs = {}
    if sched.config.get("use_dynamic_shifting", False):
        if image_seq_len is None:
            raise ValueError("a dynamically shifted schedule needs image_seq_len")
        kwargs["mu"] = dynamic_shift_mu(image_seq_len, sched.config)
    if base_sigmas is not None:
        kwargs["sigmas"] = base_sigmas
    elif linear_base:
        kwargs["sigmas"] = np.linspace(1.0, 1.0 / num_steps, num_steps)
    sched.set_timesteps(num_steps, device="cpu", **kwargs)
    sigmas = sched.sigmas.to(torch.float32)
    assert sigmas.shape == (num_steps + 1,) and float(sigmas[-1]) == 0.0
    # UniPC's flow sigmas (Wan) start at 1 - 1e-6, round-off of 1: the SDE step's
    # sqrt(s / (1 - s)) is then about 1000 instead of the first-step rule sampler.sde_step applies at
    # s == 1, and a first SDE step multiplies the latents' scale by thousands.
    if 1.0 - _ROUND_OFF < float(sigmas[0]) < 1.0:
        sigmas[0] = 1.0
    # Some configs degenerate for tiny step counts (Qwen-Image's shift_terminal stretch divides
    # by zero at T = 1): a clear error instead of NaN latents.
    if not bool(torch.isfinite(sigmas).all()) or not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError(
            f"num_inference_steps={num_steps} gives an invalid sigma schedule for this model's "
            f"scheduler config ({[round(float(x), 4) for x in sigmas]}); use more steps (>= 2)"
        )
    return sigmas
