"""What one FlowGRPO update trains, in which order, on this rank: its plan, and the forwards the
plan runs.

`plan_update(tensors, specs, trained, ...)` draws, from (trainer.seed, step) alone:
- the trained window steps of every sample (all of them, or a random `train_timestep_fraction` of
  them per sample);
- for each update epoch, a sample order cut into `trainer.updates_per_step` mini-batches, one
  optimizer step each, and each mini-batch into micro-batches of rows that can share a forward
  (the same `TransitionSpec.group_key`).

Over several ranks the plan is drawn over the trained rows of EVERY rank, in the order one process
holding them all would have them (flowrl.distributed.trained_rows), so the same samples are drawn,
mini-batches cut and trained steps chosen as in one process; each rank then runs the micro-batches
of its own rows. With sharded weights every rank runs as many micro-batches per optimizer step:
ranks with fewer add weight-0 ones (`padding`), which change nothing.

`Forward` is one forward of the update: a micro-batch's rows at one trained step each.

This module is indices and random draws only; it knows nothing of models or losses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flowrl.distributed.trained_rows import TrainedRows, with_padding
from flowrl.engine.output import TransitionSpec


def seeded_generator(seed: int, *keys: int) -> torch.Generator:
    """A torch generator seeded from (seed, *keys): every random choice of an update derives from
    (trainer.seed, step, ...), so a resumed run repeats the straight run exactly."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0]))


@dataclass(frozen=True)
class Forward:
    """One forward of the update: `rows` (this rank's row indices) at trained step `k`, their
    window-step indices `step_index` and settings `specs`; `is_padding`: a weight-0 micro-batch a
    rank with sharded weights runs only to keep pace with the busiest rank."""

    rows: torch.Tensor
    k: int
    step_index: torch.Tensor
    specs: list
    is_padding: bool = False


@dataclass
class Plan:
    """What one update trains, in which order, on this rank.

    train_steps: (N, K) window-step indices trained per row of this rank's tensors (rows it does
    not train keep the first K). epochs: per update epoch, its optimizer steps, each a list of this
    rank's micro-batches (row-index tensors). step_weights: per optimizer step (all epochs in
    order), the loss weight of its rows on every rank (its normalizer is that times K). padding:
    per optimizer step, the weight-0 micro-batches this rank adds to run as many as the busiest
    rank (sharded weights only; else 0)."""

    train_steps: torch.Tensor
    epochs: list[list[list[torch.Tensor]]]
    step_weights: list[float]
    padding: list[int]
    specs: Sequence[TransitionSpec]

    @property
    def num_trained_steps(self) -> int:
        return self.train_steps.shape[1]

    @property
    def optimizer_steps(self) -> list[list[torch.Tensor]]:
        return [micro_batches for epoch in self.epochs for micro_batches in epoch]

    def forwards(self, micro_batches: list[torch.Tensor], padding: int = 0) -> list[Forward]:
        """The forwards of `micro_batches` (and `padding` weight-0 ones), micro-batch by
        micro-batch, each at every trained step in turn."""
        return [
            Forward(rows, k, self.train_steps[rows, k], [self.specs[i] for i in rows.tolist()], is_padding)
            for rows, is_padding in with_padding(micro_batches, padding)
            for k in range(self.num_trained_steps)
        ]

    def step_forwards(self, index: int) -> list[Forward]:
        """The forwards of optimizer step `index` (over every epoch), padding included."""
        return self.forwards(self.optimizer_steps[index], self.padding[index])

    def recompute_forwards(self) -> list[Forward]:
        """The forwards the old-log-prob recompute scores: those of epoch 0's optimizer steps
        after the first (the first one's grad passes give its rows' denominators), in their order,
        so each row is recomputed in the batch composition it is trained in; then the weight-0
        ones of those steps (sharded weights)."""
        micro_batches = [rows for step in self.epochs[0][1:] for rows in step]
        return self.forwards(micro_batches, sum(self.padding[1 : len(self.epochs[0])]))


def plan_update(
    tensors: dict[str, torch.Tensor],
    specs: Sequence[TransitionSpec],
    trained: TrainedRows,
    step: int,
    trainer_cfg,
    train_timestep_fraction: float,
    pads_micro_batches: bool,
) -> Plan:
    """The update's trained steps and this rank's micro-batches of each optimizer step, drawn over
    the rows trained on every rank (module docstring)."""
    num_local, window = tensors["sigmas"].shape
    if window == 0:
        raise ValueError("the rollouts have no SDE window steps; set rollout.sampling.sde_window_size >= 1")
    if len(specs) != num_local:
        raise ValueError(f"{len(specs)} transition specs for {num_local} rollout rows; pass one per row")
    num_rows = len(trained.owner)
    seed, size = trainer_cfg.seed, trainer_cfg.micro_batch_size
    epochs, step_weights, padding = [], [], []
    for epoch in range(trainer_cfg.update_epochs):
        order = torch.randperm(num_rows, generator=seeded_generator(seed, step, 2, epoch))
        mini_batches = [m.numpy() for m in torch.tensor_split(order, trainer_cfg.updates_per_step) if m.numel()]
        steps = []
        for rows in mini_batches:
            mine = torch.from_numpy(trained.index[trained.held_by(rows, trained.rank)])
            steps.append(_micro_batches(mine, specs, size))
            step_weights.append(float(trained.weight[rows].sum()))
            padding.append(trained.most_micro_batches(rows, size) - len(steps[-1]) if pads_micro_batches else 0)
        epochs.append(steps)
    global_steps = trained_steps(num_rows, window, train_timestep_fraction, seeded_generator(seed, step, 1))
    train_steps = torch.arange(global_steps.shape[1]).expand(num_local, -1).clone()
    mine = np.flatnonzero(trained.owner == trained.rank)
    train_steps[torch.from_numpy(trained.index[mine])] = global_steps[torch.from_numpy(mine)]
    return Plan(train_steps, epochs, step_weights, padding, specs)


def trained_steps(num_rows: int, window: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """(N, K) window-step indices to train per sample (sorted), K = max(1, int(W * fraction))."""
    count = max(1, int(window * float(fraction) + 1e-9))
    if count >= window:
        return torch.arange(window).expand(num_rows, window).clone()
    return torch.stack([torch.randperm(window, generator=generator)[:count].sort().values for _ in range(num_rows)])


def _micro_batches(rows: torch.Tensor, specs: Sequence[TransitionSpec], size: int) -> list[torch.Tensor]:
    """`rows` cut into micro-batches of at most `size` rows, each holding rows of one group_key (in
    their order; one group is the plain cut of `rows`)."""
    groups: dict[tuple, list[int]] = {}
    for row in rows.tolist():
        groups.setdefault(specs[row].group_key, []).append(row)
    return [torch.tensor(g[i : i + size]) for g in groups.values() for i in range(0, len(g), size)]
