"""The seam between the trainer and an RL algorithm, and the registry that names algorithms.

An `Algorithm` says what its rollouts need, how a step's rewards become per-row weights, and how
it updates the model; the trainer (flowrl.trainer.trainer) runs the phases of a step in order and
knows nothing of their insides:

    overrides = algorithm.sampling_overrides(step)        # the rollout's per-step settings
    with algorithm.rollout_weights(version): ...          # which weights roll out (and are published)
    weights = algorithm.advantages(rows, step)            # rewards -> per-row weights, rows kept
    algorithm.score_early(...)                            # optional: work while rewards are scored
    batch = algorithm.prepare(rollout, rows, weights, step)  # the old log-prob phase
    metrics = algorithm.update(batch)                     # the update phase

A second algorithm is a new module and an entry in ALGORITHMS (config: `algorithm.name`).
Implementations get what they train with in an `AlgorithmSetup`: the adapter, its trainable
parameters, their moving average and the data-parallel wrapper, and their own config slices.
"""

from __future__ import annotations

import contextlib
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

# algorithm.name -> "module:class" (imported when the algorithm is built).
ALGORITHMS = {
    "flow_grpo": "flowrl.trainer.flow_grpo:FlowGRPO",
    "diffusion_nft": "flowrl.trainer.diffusion_nft:DiffusionNFT",
    "awm": "flowrl.trainer.awm:AWM",
    "online_dpo": "flowrl.trainer.online_dpo:OnlineDPO",
}


@dataclass
class AlgorithmSetup:
    """What an algorithm trains with. cfg holds the slices it reads: `algorithm`, `trainer`,
    `rollout`, `engine` and `reward` (its components' weights; an algorithm reads nothing else)."""

    adapter: object
    params: list
    cfg: object
    parallel: object
    ema: object = None


@dataclass
class StepWeights:
    """A step's rewards as the update takes them, over every rank's rows: values (N,) float32 (for
    FlowGRPO the group advantages), keep (N,) bool (the rows the update trains), and metrics of
    how they were made."""

    values: np.ndarray
    keep: np.ndarray
    metrics: dict = field(default_factory=dict)


class Algorithm(ABC):
    """One RL algorithm (module docstring). `optimizer` and `num_optimizer_steps` belong to it (a
    checkpoint saves and restores both); `autocast_dtype` is the trainer's mixed precision, which
    the rollout engine shares so that both sides compute alike."""

    name: str

    def __init__(self, setup: AlgorithmSetup):
        self.setup = setup

    # -- rollouts --------------------------------------------------------------------------------
    def sampling_overrides(self, step: int) -> dict | None:
        """Settings every row of step `step`'s rollout is drawn with on top of rollout.sampling
        (None: none)."""
        return None

    def rollout_weights(self, policy_version: int):
        """A context in which the engine samples with the weights this algorithm rolls out with
        (by default the trained ones, as they are)."""
        return contextlib.nullcontext()

    def published_weights(self):
        """A context in which the trainable parameters hold what rollout servers are to serve (by
        default the trained weights)."""
        return contextlib.nullcontext()

    def averages(self) -> dict:
        """The algorithm's own averages of the trainable parameters (flowrl.trainer.ema.ParameterEMA
        by name), which checkpoints keep and restore (none by default)."""
        return {}

    # -- rewards -> weights ---------------------------------------------------------------------
    @abstractmethod
    def advantages(self, rows, step: int) -> StepWeights:
        """The step's per-row weights from `rows` (flowrl.distributed.step_rows.StepRows)."""

    # -- the update ------------------------------------------------------------------------------
    scores_early = False  # whether score_early does anything this step (the same on every rank)

    def score_early(self, rollout, rows, step: int, keep_going) -> None:
        """Optional work of the old log-prob phase done while the rewards are still being scored
        (while keep_going() holds), on provisional `rows` (every rank's, rewards not known yet)."""

    @abstractmethod
    def prepare(self, rollout, rows, weights: StepWeights, step: int):
        """The old log-prob phase: what the update compares against, from the weights that start
        it. Only called when some row is kept."""

    @abstractmethod
    def update(self, batch) -> dict:
        """The update phase; returns its metrics (the same on every rank)."""

    @abstractmethod
    def phase_flops(self, units, rows_trained: int, val_images: int = 0) -> dict[str, float]:
        """FLOPs of each phase of a step that trained `rows_trained` rows (and validated
        `val_images` images), from the run's units (flowrl.run.step_flops.UnitFlops)."""

    @property
    @abstractmethod
    def optimizer(self):
        """The optimizer over the trainable parameters."""

    num_optimizer_steps: int = 0
    autocast_dtype = None
    checkpointing = None  # trainer.gradient_checkpointing as the first update settled it (CheckpointingChoice)
    lora_merge_s = 0.0  # the last training rollout's LoRA merge (rollout.merge_lora), in seconds


def build_algorithm(setup: AlgorithmSetup) -> Algorithm:
    """The algorithm `setup.cfg.algorithm.name` names (ALGORITHMS)."""
    name = setup.cfg.algorithm.name
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm.name={name!r} is not registered; choose one of: {', '.join(ALGORITHMS)}")
    module, _, attribute = ALGORITHMS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)(setup)
