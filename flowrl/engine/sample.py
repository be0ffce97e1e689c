"""Per-sample state: one object per in-flight sample, owned by the engine thread.

Holds everything that belongs to one sample (its generator, latents, position in its schedule,
SDE window, recorded trajectory and log-probs, the future its caller waits on), so the scheduler
can reason about samples without touching tensors and the executor can step any mix of them.
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

    @property
    def batch_key(self) -> tuple[int, int, int]:
        """Samples with the same key can share a forward (same latent shape)."""
        return (self.params.height, self.params.width, self.params.num_frames)

    @property
    def num_steps(self) -> int:
        return self.params.num_inference_steps

    @property
    def is_finished(self) -> bool:
        return self.step >= self.num_steps

    def in_window(self, step: int) -> bool:
        start, end = self.sde_window
        return start <= step < end
