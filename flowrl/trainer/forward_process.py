"""What a forward-process update trains: its (sample, timestep) pairs and their noised latents.

The forward-process algorithms (DiffusionNFT; next AWM and online Diffusion-DPO) train on each
sample's final latent x0, re-noised at timesteps of the sample's own rollout schedule (the
reference trains int(fraction * T) of its T timesteps, drawn per sample):

- `rollout_timesteps(adapter, specs)`: (N, T') each row's schedule without its final 0, only the
  timesteps the trained module predicts (all T, except for a two-expert model: Wan2.2-A14B's
  model.trained_expert predicts one side of its boundary, the other expert's steps have no grad);
- `plan_pairs(...)`: the update's plan (flowrl.trainer.plan, the same optimizer steps and micro-
  batches FlowGRPO's update cuts, drawn over every rank's trained rows), whose "steps" are indices
  into those timesteps;
- `PairNoise`: the noise of each pair, drawn from (trainer.seed, step, epoch, the row's index
  among every rank's trained rows, the pair's k), so a run over K ranks draws what one process does
  and a resumed run what the straight run did.

This module is indices, draws and tensors; it knows the adapter only for its schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flowrl.distributed.trained_rows import TrainedRows
from flowrl.engine.output import TransitionSpec
from flowrl.trainer.plan import Plan, plan_update, seeded_generator


def rollout_timesteps(adapter, specs: Sequence[TransitionSpec]) -> torch.Tensor:
    """(N, T') float32: each row's rollout schedule (adapter.sigmas) without its final 0, and
    without the timesteps the trained module does not predict (adapter.is_trained_sigma). Every
    row needs the same step count T, and keeps as many timesteps."""
    counts = {s.num_inference_steps for s in specs}
    if len(counts) != 1:
        raise ValueError(
            f"the step's rollouts used different rollout.sampling.num_inference_steps {sorted(counts)}; "
            "a forward-process update trains rows of one schedule length"
        )
    schedules = torch.stack(
        [adapter.sigmas(s.num_inference_steps, s.height, s.width)[:-1].float().cpu() for s in specs]
    )
    trained = adapter.is_trained_sigma(schedules)
    if bool(trained.all()):
        return schedules
    kept = set(trained.sum(dim=1).tolist())
    if kept == {0} or len(kept) != 1:
        raise ValueError(
            f"of the step's rollout schedules ({counts.pop()} steps) the trained expert (model.trained_expert) "
            f"predicts {sorted(kept)} timesteps per row; it needs the same number, at least 1, in every row: "
            "use more rollout.sampling.num_inference_steps"
        )
    return schedules[trained].view(len(specs), kept.pop())


def trained_timesteps(adapter, sampling) -> int:
    """T', the timesteps of the schedule of `sampling` (rollout.sampling) that a forward-process
    update draws from: the ones the trained module predicts (`rollout_timesteps`)."""
    sigmas = adapter.sigmas(sampling.num_inference_steps, sampling.height, sampling.width)[:-1]
    return int(adapter.is_trained_sigma(sigmas).sum())


def trained_pairs_per_sample(num_steps: int, fraction: float) -> int:
    """K, the timesteps trained per sample of `num_steps` candidates (T', `trained_timesteps`):
    int(fraction * T'), at least 1 (as flowrl.trainer.plan)."""
    return min(num_steps, max(1, int(num_steps * float(fraction) + 1e-9)))


def plan_pairs(
    timesteps: torch.Tensor,
    specs: Sequence[TransitionSpec],
    trained: TrainedRows,
    step: int,
    trainer_cfg,
    fraction: float,
    pads_micro_batches: bool,
) -> Plan:
    """The update's plan over `trained` (every rank's trained rows), its trained steps indexing
    `timesteps` (module docstring)."""
    return plan_update({"sigmas": timesteps}, specs, trained, step, trainer_cfg, fraction, pads_micro_batches)


def global_rows(trained: TrainedRows, num_local: int) -> np.ndarray:
    """(num_local,) each of this rank's rows' index among every rank's trained rows (-1: not trained)."""
    out = np.full(num_local, -1, dtype=np.int64)
    mine = np.flatnonzero(trained.owner == trained.rank)
    out[trained.index[mine]] = mine
    return out


class PairNoise:
    """The noise of each (row, k) pair of one update (module docstring)."""

    def __init__(self, seed: int, step: int, global_index: np.ndarray, shape: tuple[int, ...]):
        self.seed, self.step, self.global_index, self.shape = seed, step, global_index, tuple(shape)

    def __call__(self, rows: torch.Tensor, k: int, epoch: int) -> torch.Tensor:
        """(B, *shape) float32 host noise of `rows` (this rank's indices) at trained step k (an untrained
        row, as a weight-0 padding forward holds, draws from index -1)."""
        return torch.stack(
            [
                torch.randn(self.shape, generator=seeded_generator(self.seed, self.step, 17, epoch, int(g) + 1, k))
                for g in self.global_index[rows.numpy()]
            ]
        )
