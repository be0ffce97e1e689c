"""The old-log-prob recompute, scored while the step's rewards are still being computed.

With `algorithm.old_log_prob: recompute` the update first re-scores the rows of its later
optimizer steps with the weights the rollout ran with (flowrl.trainer.update). Those forwards need
the rollout's latents, not its rewards; but which rows the update trains, and so which
micro-batches the recompute scores, can depend on the rewards (rows with no valid reward, and
zero-spread groups under `algorithm.zero_std_policy: drop`, are not trained). So while the scorer
still works (an OCR reward scores most images after the last denoising step, when they finish
together), the trainer has the updater score the micro-batches of the plan in which every row is
trained; the update then takes a denominator from here whenever it scores the same rows at the
same window steps with the same weights, which is the same forward and so gives the same values.
A micro-batch of another composition (some rows were not trained) is scored as before. Scoring
stops once the rewards are in, so at most the forwards then queued outlast them.

Not used with sharded weights (every forward there is a collective that all ranks must run in
step, and each rank's rewards finish at their own time), or before the process's first update
has settled `trainer.gradient_checkpointing` (which picks the graph the denominators come from).
"""

from __future__ import annotations

import torch


class EarlyDenominators:
    """Recompute log-probs of one training step, scored before its update, keyed by the forward
    they came from: its rows and each pair's window step. Valid for the weights of
    `optimizer_steps` (the updater's count when they were scored) only."""

    def __init__(self, step: int, optimizer_steps: int):
        self.step = step
        self.optimizer_steps = optimizer_steps
        self._log_probs: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def _key(pair_rows: torch.Tensor, step_index: torch.Tensor) -> tuple:
        return tuple(pair_rows.tolist()), tuple(step_index.tolist())

    def put(self, pair_rows: torch.Tensor, step_index: torch.Tensor, log_prob: torch.Tensor) -> None:
        self._log_probs[self._key(pair_rows, step_index)] = log_prob

    def take(self, pair_rows: torch.Tensor, step_index: torch.Tensor) -> torch.Tensor | None:
        """The log-probs of this forward if it was scored early (each is handed out once)."""
        return self._log_probs.pop(self._key(pair_rows, step_index), None)

    def __len__(self) -> int:
        return len(self._log_probs)
