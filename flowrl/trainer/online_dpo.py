"""Online Diffusion-DPO (arXiv 2311.12908; online as flow_grpo's scripts/train_sd3_dpo.py with
config/dpo.py and verl-omni's online Qwen-Image recipe).

- Rollouts: deterministic, CFG-free, the final latent alone (as the other forward-process
  algorithms), from the trained weights, or, with algorithm.dpo.ref_update_every = K > 0, from
  the reference snapshot (flow_grpo's online DPO samples with its `ref` adapter).
- Pairs: in each prompt's group the best-rewarded sample is chosen and the worst rejected (a group
  whose rewards are all equal gives none); with algorithm.shuffle_advantages (the control run) each
  pair's roles are swapped with probability 1/2.
- Reference: the LoRA-disabled model (K = 0, verl-omni's), or a snapshot of the trained weights
  taken every K training steps (flow_grpo's `ref_update_step`; full fine-tuning needs it).
- The update (flowrl.trainer.forward_update): a fraction of each pair's rollout timesteps, the
  chosen and rejected sample re-noised with the same noise and timestep in one forward, the
  reference's velocities with no grad, the DPO loss (flowrl.trainer.dpo_loss) with
  algorithm.dpo.beta.
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.engine.output import TransitionSpec
from flowrl.models.lora import adapter_disabled
from flowrl.trainer.algorithm import AlgorithmSetup, StepWeights
from flowrl.trainer.dpo_loss import dpo_loss, flow_errors
from flowrl.trainer.forward_update import ForwardProcessAlgorithm, Pair
from flowrl.trainer.plan import Forward
from flowrl.trainer.scheduled_average import ScheduledAverage


def preference_pairs(rewards: np.ndarray, uids, shuffle_seed: tuple | None = None) -> np.ndarray:
    """(N,) each chosen row's rejected partner (-1 elsewhere): per group, its best and worst valid
    (non-NaN) rewards, the first of equals; none where they are equal. shuffle_seed: swap each
    pair's roles with probability 1/2 (the control run)."""
    partner = np.full(len(rewards), -1, dtype=np.int64)
    groups: dict = {}
    for row, uid in enumerate(uids):
        if not np.isnan(rewards[row]):
            groups.setdefault(uid, []).append(row)
    rng = None if shuffle_seed is None else np.random.default_rng(list(shuffle_seed))
    for rows in groups.values():
        values = rewards[rows]
        best, worst = rows[int(np.argmax(values))], rows[int(np.argmin(values))]
        if values.max() <= values.min():
            continue
        if rng is not None and rng.random() < 0.5:
            best, worst = worst, best
        partner[best] = worst
    return partner


class OnlineDPO(ForwardProcessAlgorithm):
    name = "online_dpo"
    metric_names = ("dpo_loss", "margin", "accuracy")
    rows_per_pair = 2  # the chosen sample and its rejected partner

    def __init__(self, setup: AlgorithmSetup):
        super().__init__(setup)
        self.dpo = setup.cfg.algorithm.dpo
        # K > 0: the reference is a snapshot of the trained weights (decay 0: a copy when it moves).
        self.snapshot = ScheduledAverage(self.trainable(), 0, 0.0, 0.0) if self.dpo.ref_update_every else None
        self.rollout_average = self.snapshot  # flow_grpo's online DPO samples with its reference
        self.partners: np.ndarray | None = None  # the step's, over every rank's rows
        self.local_partner: dict[int, int] = {}  # this rank's chosen row -> its rejected row
        self.specs: list = []
        self.step = 0

    def averages(self) -> dict:
        return {} if self.snapshot is None else {"dpo_reference": self.snapshot}

    # -- rewards -> pairs ------------------------------------------------------------------------
    def advantages(self, rows, step: int) -> StepWeights:
        shuffle = (self.seed, step, 11) if self.algorithm.shuffle_advantages else None
        partner = preference_pairs(np.asarray(rows.rewards, dtype=np.float64), rows.uids, shuffle)
        keep = partner >= 0
        values = np.zeros(len(partner), dtype=np.float32)
        values[keep], values[partner[keep]] = 1.0, -1.0
        self.partners = partner
        metrics = {"adv/num_rows_trained": int(keep.sum()) * 2, "dpo/num_pairs": int(keep.sum())}
        return StepWeights(values, keep, metrics)

    def prepare(self, rollout, rows, weights: StepWeights, step: int):
        self.step = step
        self.specs = TransitionSpec.from_columns(rollout.non_tensor_batch)
        chosen = np.flatnonzero(self.partners >= 0)
        # Both rows of a pair belong to one group, which one rank holds (flowrl.distributed).
        self.local_partner = {
            int(rows.index[g]): int(rows.index[self.partners[g]]) for g in chosen if rows.owner[g] == rows.rank
        }
        return super().prepare(rollout, rows, weights, step)

    def widen(self, forward: Forward) -> tuple[Forward, torch.Tensor]:
        """The chosen rows, then their rejected partners at the same timesteps on the same noise."""
        # A weight-0 padding forward's row has no partner: it runs with itself.
        partners = [self.local_partner.get(r, r) for r in forward.rows.tolist()]
        wide = Forward(
            torch.cat([forward.rows, torch.tensor(partners, dtype=torch.long)]),
            forward.k,
            torch.cat([forward.step_index, forward.step_index]),
            [*forward.specs, *(self.specs[r] for r in partners)],
            forward.is_padding,
        )
        same = torch.arange(len(partners))
        return wide, torch.cat([same, same])

    # -- the update ------------------------------------------------------------------------------
    def reference_passes(self) -> list[tuple[str, object]]:
        if self.snapshot is not None:
            return [("reference", self.snapshot.applied)]
        return [("reference", lambda: adapter_disabled(self.setup.adapter.transformer))]

    def pair_loss(self, velocity: torch.Tensor, pair: Pair) -> dict[str, torch.Tensor]:
        errors = flow_errors(velocity, pair.x0, pair.noise)
        reference = flow_errors(pair.velocities["reference"], pair.x0, pair.noise)
        loss, margin = dpo_loss(errors, reference, self.dpo.beta)
        return {"loss": loss, "dpo_loss": loss, "margin": margin, "accuracy": (margin > 0).float()}

    def after_update(self) -> dict:
        """Every algorithm.dpo.ref_update_every training steps the reference snapshot becomes
        the trained weights."""
        if self.snapshot is None:
            return {}
        refreshed = self.step % self.dpo.ref_update_every == 0
        if refreshed:
            self.snapshot.step(self.num_optimizer_steps)
        return {"dpo/reference_refreshed": float(refreshed)}
