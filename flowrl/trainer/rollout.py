"""A training step's samples: its prompt rows drawn, rolled out, and their rewards collected.

`StepSamples.roll_out(step)` takes `trainer.prompts_per_step` dataset rows (every rank draws the
same ones), gives each a group id and the algorithm's per-step settings, and rolls out this rank's
contiguous share of the groups, each row repeated rollout.n times (interleaved), each with the seed
it has in one process. Every finished sample goes to the reward scorer at once, so scoring runs
while other samples still denoise. `StepSamples.rewards(sampled)` waits for the scores and gathers
the step's rows from every rank (flowrl.distributed.step_rows); while it waits, the algorithm may
start its old log-prob phase (`Algorithm.score_early`), on provisional rows that do not know the
rewards yet.

A schedule (flowrl.rollout.schedule) decides when `roll_out` runs: with trainer.async_rollout, on
a thread of its own while the previous step trains, so it shows no progress and is never
abortable. This module knows the agent loop, the scorer and the world; nothing of the update.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from flowrl.distributed.step_rows import StepRows, gather_step_rows
from flowrl.rollout.batch import RolloutBatch
from flowrl.run.progress import NO_PROGRESS

# The engine counters gathered over ranks (flowrl.distributed.step_rows).
_ENGINE_COUNTERS = ("num_rows", "num_forwards", "images_per_second")


@dataclass
class SampledStep:
    """One step's rollout on this rank: the batch, the seconds it took where it ran, and the
    engine's batching counters over it (empty for an engine that keeps none)."""

    batch: RolloutBatch
    seconds: float
    counters: dict


@dataclass
class ScoredStep:
    """The step's rows of every rank with their rewards, the seconds spent waiting for the rewards
    after the rollout, and the seconds of old log-prob work done during that wait."""

    rows: StepRows
    reward_wait_s: float
    early_s: float = 0.0


class StepSamples:
    """Rolls out and scores the samples of each training step (module docstring).

    prompts: the run's flowrl.data.prompts.PromptSampler; agent_loop: the AgentLoop over the
    rollout backend's replicas; backend: that backend (its batching counters); scorer: the
    AsyncRewardScorer; algorithm: what the rows are drawn with (`sampling_overrides`,
    `rollout_weights`, `score_early`); rollout_weights(): the context the trainer rolls out in."""

    def __init__(self, prompts, agent_loop, backend, scorer, world, rollout_cfg, algorithm, rollout_weights):
        self.prompts, self.agent_loop, self.backend, self.scorer = prompts, agent_loop, backend, scorer
        self.world, self.n, self.algorithm = world, rollout_cfg.n, algorithm
        self.rollout_weights = rollout_weights
        self.progress = NO_PROGRESS  # the run's bar (flowrl.run.progress); none for async rollouts
        self.stop_check = None  # a stop signal's check while a phase may be dropped (flowrl.waiting)
        self.is_async = False  # rollouts run one step ahead (trainer.async_rollout): no early scoring

    def prepare_rows(self, rows: list[dict], step: int) -> None:
        """Give step `step`'s prompt rows, in place, their group ids and the algorithm's settings."""
        overrides = self.algorithm.sampling_overrides(step)
        for i, row in enumerate(rows):
            row["uid"] = f"step{step}-prompt{i}"
            if overrides is not None:
                row["sampling_overrides"] = dict(overrides)

    def roll_out(self, step: int) -> SampledStep:
        """Step `step`'s rows rolled out, this rank's share, each finished sample submitted to the
        scorer (generate_sequences returns after every submission has returned)."""
        t0 = time.perf_counter()
        rows = self.prompts.next_rows()
        self.prepare_rows(rows, step)
        first_prompt, my_rows = self.world.share(rows)  # whole groups: a group never spans ranks
        batch = RolloutBatch.from_rows(my_rows).repeat(self.n)
        first_row = self.agent_loop.rows_generated
        self.backend.reset_stats()
        progress = self.progress

        def submit(row: int, output) -> None:
            self.scorer.submit(row, output.image, output.prompt, batch.row_metadata(row))
            progress.advance()

        progress.phase("rollout", len(batch))
        with self.rollout_weights():
            rollout = self.agent_loop.generate_sequences(
                batch, on_sample_done=submit, row_offset=first_prompt * self.n, stop_check=self.stop_check
            )
        self.agent_loop.rows_generated = first_row + len(rows) * self.n
        stats = self.backend.stats()
        counters = {} if stats is None else {name: stats.get(name, 0) for name in _ENGINE_COUNTERS}
        return SampledStep(rollout, time.perf_counter() - t0, counters)

    def rewards(self, sampled: SampledStep, step: int) -> ScoredStep:
        """Wait for the step's rewards and gather every rank's rows (a collective); while waiting,
        the algorithm's early old log-prob work on provisional rows (a collective too, run by every
        rank alike: whether it runs is the same on all of them)."""
        t0 = t_early = time.perf_counter()
        stop_check = self.stop_check
        if self.algorithm.scores_early and not self.is_async:
            provisional = gather_step_rows(self.world, sampled.batch, np.zeros(len(sampled.batch)), {}, {})

            def keep_going() -> bool:
                if stop_check is not None:
                    stop_check()  # a stop signal ends the wait for rewards, this included
                return not self.scorer.is_done()

            self.algorithm.score_early(sampled.batch, provisional, step, keep_going)
            t_early = time.perf_counter()
        rewards, components = self.scorer.results_with_components(len(sampled.batch), stop_check=stop_check)
        t_rewards = time.perf_counter()
        rows = gather_step_rows(self.world, sampled.batch, rewards, components, sampled.counters)
        return ScoredStep(rows, t_rewards - t_early, t_early - t0)
