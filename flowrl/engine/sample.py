"""Per-sample state: one object per in-flight sample, owned by the engine thread.

Holds everything that belongs to one sample (its generator, latents, position in its schedule,
SDE window, recorded trajectory and log-probs, ODE solver history, the future its caller waits
on), so the scheduler can reason about samples without touching tensors and the executor can step
any mix of them.
It holds state only: it does no device work and knows nothing about scheduling policy.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from flowrl.models.base import PromptEncoding
from flowrl.sampling_params import SamplingParams

_ids = itertools.count()


@dataclass
class SampleState:
    prompt: str
    params: SamplingParams
    seed: int
    sde_window: tuple[int, int]
    future: Future
    # Rows this sample occupies in a forward (2 with an uncond row, else 1): the model's rule,
    # `adapter.rows_per_sample(params)`, which the engine asks when it creates the sample; the
    # scheduler and the executor read it here.
    num_rows: int = 1
    # The seed whose generator draws the starting noise: the sample's own, or its request's first
    # sample's (SamplingParams.shared_initial_noise).
    noise_seed: int | None = None
    sample_id: int = field(default_factory=lambda: next(_ids))
    submitted_at: float = field(default_factory=time.perf_counter)
    # Filled at admission (engine thread).
    cond: PromptEncoding | None = None
    uncond: PromptEncoding | None = None
    generator: torch.Generator | None = None
    latents: torch.Tensor | None = None
    sigmas: list[float] = field(default_factory=list)  # host copy of the schedule (T + 1 values)
    step: int = 0
    policy_version: int = 0
    admitted_at: float = 0.0
    last_stepped_tick: int = -1
    trajectory: list[torch.Tensor] = field(default_factory=list)
    log_probs: list[torch.Tensor] = field(default_factory=list)
    # The multistep ODE solver's history (SamplingParams.ode_solver): the data prediction of the
    # sample's previous step and the sigma it was made at. Per sample, so a sample's steps never
    # depend on which others share its forwards or when they joined.
    x0_prev: torch.Tensor | None = None
    sigma_prev: float | None = None

    @property
    def batch_key(self) -> tuple[int, int, int]:
        """Samples with the same key can share a forward (same latent shape)."""
        return (self.params.height, self.params.width, self.params.num_frames)

    @property
    def num_steps(self) -> int:
        """Steps of the sample's schedule: num_inference_steps, fewer with a compressed ODE tail."""
        return len(self.sigmas) - 1 if self.sigmas else self.params.num_inference_steps

    @property
    def is_finished(self) -> bool:
        return self.step >= self.num_steps

    def in_window(self, step: int) -> bool:
        start, end = self.sde_window
        return start <= step < end

    @property
    def tail_start(self) -> int:
        """The first step after the SDE window (0 without a window): where the ODE tail begins."""
        start, end = self.sde_window
        return end if start < end else 0

    @property
    def keeps_x0(self) -> bool:
        """Whether the sample's solver needs its previous step's data prediction."""
        return self.params.ode_solver != "euler"

    def multistep(self, step: int) -> bool:
        """Whether `step` takes the second-order multistep update: an ODE-tail step with a previous
        step's prediction, not the last step (to sigma 0, where the update is first order)."""
        return self.keeps_x0 and step >= self.tail_start and self.x0_prev is not None and self.sigmas[step + 1] > 0.0
