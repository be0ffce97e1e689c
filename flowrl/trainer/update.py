"""FlowGRPO's update of one training step: clipped PPO over the stored SDE transitions.

Two phases, each a call of `PolicyUpdater`:
- `prepare(tensors, specs, advantages, step, trained)` (the old log-prob phase): plans the update
  (flowrl.trainer.plan), settles `trainer.gradient_checkpointing` at the process's first update
  ("auto" is measured: flowrl.trainer.grad_checkpointing), and takes the PPO denominator: the
  rollout's log-probs (`algorithm.old_log_prob=rollout`), or the current policy's before any
  update (`recompute`). The first optimizer step scores its own rows with exactly those weights,
  so its values are its rows' denominators (its ratios are exactly 1); only the rows of the later
  optimizer steps are re-scored here, or earlier, while the step's rewards were still being scored
  (`score_early`, flowrl.trainer.early_denominators);
- rows drawn by older weights than the update starts from (trainer.async_rollout: the row's
  policy version is below the optimizer steps taken) train with decoupled PPO
  (flowrl.trainer.loss): the recomputed denominator centres the clip on the update's starting
  weights and each such row is weighted by its truncated behaviour weight against its rollout
  log-prob (algorithm.behaviour_weight_cap); rows of the current weights train exactly as before;
- `update(batch)`: for each optimizer step, each of its forwards (a micro-batch at one trained
  step) scores with grad, takes the ratio to its denominator, the objective of
  `algorithm.policy_loss` (flowrl.trainer.objectives: the clipped loss, or GRPO-Guard's or
  Flow-DPPO's, which also compare the step's mean with the old policy's, recomputed and kept beside
  the denominators) and the KL, and backpropagates; then the gradient is clipped and one AdamW step
  taken (and the EMA stepped; flowrl.trainer.optim).

Every valid (sample, trained step) pair of an optimizer step weighs the same: each forward's loss
is its share of the mean over the whole step's pairs (flowrl.trainer.loss, `normalizer`), so a
short last micro-batch counts as little as it holds. Over several ranks the gradients are summed
before the clip and every rank takes the same optimizer step: a run over W ranks computes the
one-process update (up to the rounding of smaller forwards).

What changes between the calls of the inner loop is chosen before it: where a scored log-prob's
value comes from (flowrl.trainer.logprob.Scoring), each optimizer step's denominators (its own
first log-probs, or the prepared ones), the objective, the KL term (none, or to the LoRA-disabled
reference, on the step's mean or on the velocity), and
which gaps are recorded. The rollout-vs-trainer log-prob gap is measured on transitions scored by
the policy that produced them: the recompute, or (rollout mode) the first optimizer step's forwards.

This module knows the stacked rollout tensors and the trainer's config slices; it knows nothing
about the engine, rewards or how the advantages were computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from flowrl.distributed.parallel import DataParallel
from flowrl.distributed.trained_rows import TrainedRows
from flowrl.distributed.world import World
from flowrl.engine.output import TransitionSpec
from flowrl.models.lora import adapter_disabled
from flowrl.sampler import kl_to_reference
from flowrl.trainer.early_denominators import EarlyDenominators
from flowrl.trainer.grad_checkpointing import CheckpointingChoice, choose_checkpointing
from flowrl.trainer.logprob import Scoring, score_transitions
from flowrl.trainer.loss import PolicyLossOutput, clipped_policy_loss
from flowrl.trainer.objectives import Objective
from flowrl.trainer.optim import Optimization
from flowrl.trainer.plan import Forward, Plan, plan_update

_LOSS_METRICS = ("policy_loss", "clipfrac", "ratio_mean", "approx_kl", "kl", "divergence")
_BEHAVIOUR_METRICS = ("behaviour_weight", "behaviour_capped")


@dataclass
class UpdateBatch:
    """A step's update as `prepare` leaves it: this rank's tensors, specs and advantages, the plan,
    the denominators known before the update (N, K), the rollout's log-probs at the trained steps
    (None without), the gaps measured so far, the share of the recompute's forwards scored
    early (None without a recompute), and which rows older weights drew (N,) (None: none did);
    old_means: the old policy's step means (N, K, *latent) on the host, beside the denominators,
    for an objective that needs them (flowrl.trainer.objectives; else None)."""

    tensors: dict[str, torch.Tensor]
    advantages: torch.Tensor
    weights: torch.Tensor
    plan: Plan
    old: torch.Tensor
    rollout_log_probs: torch.Tensor | None
    gaps: list[torch.Tensor] = field(default_factory=list)
    early_share: float | None = None
    stale: torch.Tensor | None = None
    old_means: torch.Tensor | None = None

    def behaviour_log_prob(self, forward: Forward, old: torch.Tensor) -> torch.Tensor | None:
        """The behaviour policy's log-probs of `forward`'s rows for decoupled PPO: the rollout's
        for stale rows, `old` itself for the rest (weight exactly 1); None when none is stale (the
        forward trains as plain PPO)."""
        if self.stale is None or forward.is_padding:
            return None
        stale = self.stale[forward.rows]
        if not stale.any():
            return None
        old = old.detach().float()
        rollout = self.rollout_log_probs[forward.rows, forward.k].to(old.device)
        return torch.where(stale.to(old.device), rollout, old)


@dataclass
class UpdateRecord:
    """One optimizer step of the last update: its rows, the objective it minimized (the mean over
    its valid pairs), the share of its pairs whose ratio was clipped, and its gradient norm."""

    rows: torch.Tensor
    loss: float
    clipfrac: float
    grad_norm: float = 0.0


class PolicyUpdater:
    """Owns the optimizer over the trainable parameters and runs the update of each step.

    ema: a flowrl.trainer.ema.ParameterEMA over the same parameters, stepped after every optimizer
    step (None: no moving average). parallel: how gradients combine over ranks
    (flowrl.distributed.DataParallel; None: one process)."""

    def __init__(self, adapter, params: list[torch.nn.Parameter], algorithm_cfg, trainer_cfg, ema=None, parallel=None):
        self.adapter = adapter
        self.params = params
        self.parallel = parallel or DataParallel(World.single(), "single")
        self.world = self.parallel.world
        self.algorithm = algorithm_cfg
        self.trainer = trainer_cfg
        self.ema = ema
        self.optim = Optimization(adapter, params, trainer_cfg, self.parallel, ema)
        self.optimizer, self.autocast_dtype = self.optim.optimizer, self.optim.autocast_dtype
        self.records: list[UpdateRecord] = []  # the last update's optimizer steps
        # Read once: the trainer compiles the model (and injects LoRA) before building the updater.
        self.scoring = Scoring.choose(adapter, algorithm_cfg.old_log_prob)
        self.objective = Objective.choose(algorithm_cfg)  # algorithm.policy_loss
        self.kl = ReferenceKL(self, algorithm_cfg.kl_type) if algorithm_cfg.kl_beta > 0 else None
        # trainer.gradient_checkpointing: "auto" is measured at this process's first update.
        self.checkpointing: CheckpointingChoice | None = None
        self.early: EarlyDenominators | None = None  # score_early's, for the next update

    # -- the old log-prob phase -------------------------------------------------------------------
    def prepare(
        self,
        tensors: dict[str, torch.Tensor],
        specs: Sequence[TransitionSpec],
        advantages: torch.Tensor,
        step: int,
        trained: TrainedRows | None = None,
        weights: torch.Tensor | None = None,
        policy_versions=None,
    ) -> UpdateBatch:
        """Plan step `step`'s update and take the denominators known before it (module docstring).
        tensors, specs, advantages, weights (1 for every row by default): this rank's rows.
        trained: the rows trained on every rank (None: every row given here, in one process).
        policy_versions: the optimizer steps of the weights that drew each of this rank's rows
        (None: the current weights drew them all)."""
        weights = torch.ones(len(specs)) if weights is None else weights
        trained = trained if trained is not None else TrainedRows.of_one_process(specs, weights)
        plan = self.plan(tensors, specs, step, trained)
        if self.checkpointing is None:
            self.checkpointing = self._choose_checkpointing(tensors, specs, plan.train_steps)
        rollout_log_probs = tensors.get("all_log_probs")
        if rollout_log_probs is not None:
            rollout_log_probs = rollout_log_probs.gather(1, plan.train_steps).float()
        batch = UpdateBatch(tensors, advantages, weights, plan, torch.zeros(plan.train_steps.shape), rollout_log_probs)
        batch.stale = self._stale_rows(policy_versions, rollout_log_probs)
        if self.objective.needs_old_means:
            batch.old_means = torch.zeros(*plan.train_steps.shape, *tensors["all_latents"].shape[2:])
        if self.algorithm.old_log_prob == "rollout":
            if rollout_log_probs is None:
                raise ValueError(
                    "algorithm.old_log_prob=rollout needs rollout log-probs; set rollout.sampling.logprobs=true"
                )
            batch.old = rollout_log_probs
            return batch
        self._recompute(batch, step)
        return batch

    def _stale_rows(self, policy_versions, rollout_log_probs) -> torch.Tensor | None:
        """The rows drawn by weights older than the current ones (None: none), which decoupled PPO
        trains against their rollout log-probs (module docstring)."""
        if policy_versions is None:
            return None
        stale = torch.as_tensor(np.asarray(policy_versions) < self.num_optimizer_steps)
        if not stale.any():
            return None
        if self.algorithm.old_log_prob != "recompute" or rollout_log_probs is None:
            raise ValueError(
                f"{int(stale.sum())} rows were drawn by older weights (policy versions "
                f"{sorted(set(np.asarray(policy_versions).tolist()))}, the trainer's is {self.num_optimizer_steps}): "
                "decoupled PPO needs algorithm.old_log_prob=recompute and rollout.sampling.logprobs=true"
            )
        return stale

    def plan(self, tensors, specs, step: int, trained: TrainedRows | None = None) -> Plan:
        """The update's plan over the rows trained on every rank (flowrl.trainer.plan; `trained`
        None: every row of `tensors`, in one process)."""
        trained = trained if trained is not None else TrainedRows.of_one_process(specs, torch.ones(len(specs)))
        return plan_update(
            tensors,
            specs,
            trained,
            step,
            self.trainer,
            self.algorithm.train_timestep_fraction,
            self.parallel.pads_micro_batches,
        )

    def _recompute(self, batch: UpdateBatch, step: int) -> None:
        """The recompute's denominators of epoch 0's later optimizer steps, scored in the
        composition they are trained in (ratio exactly 1 on a CPU until an optimizer step changes
        the weights), taken from `score_early` where it scored the same forward with the same
        weights; the first step's rows are left to it, weight-0 forwards scored and dropped."""
        early, self.early = self.early, None
        if early is not None and (early.step, early.optimizer_steps) != (step, self.num_optimizer_steps):
            early = None  # scored for another step, or with other weights
        recomputed = torch.zeros(batch.old.shape[0], dtype=torch.bool)
        scored, means, taken = [], [], 0
        forwards = batch.plan.recompute_forwards()
        with self.scoring.recompute_mode(self.adapter.transformer):
            for forward in forwards:
                log_prob = None if early is None or forward.is_padding else early.take(forward.rows, forward.step_index)
                taken += log_prob is not None
                if log_prob is None:
                    log_prob, mean = self._score_denominator(batch.tensors, forward)
                    if batch.old_means is not None and not forward.is_padding:
                        means.append((forward, mean))
                if not forward.is_padding:
                    scored.append((forward, log_prob))
                    recomputed[forward.rows] = True
        for forward, values in _to_host(scored):  # read after every recompute forward is queued
            batch.old[forward.rows, forward.k] = values
        for forward, mean in means:
            batch.old_means[forward.rows, forward.k] = mean.float().cpu()
        if batch.stale is not None:  # a stale row's gap is the weights' change, not the graphs'
            recomputed &= ~batch.stale
        if batch.rollout_log_probs is not None and recomputed.any():
            batch.gaps.append((batch.old[recomputed] - batch.rollout_log_probs[recomputed]).abs().flatten())
        batch.early_share = taken / len(forwards) if forwards else 0.0

    @property
    def scores_early(self) -> bool:
        """Whether `score_early` scores anything (flowrl.trainer.early_denominators): a recompute
        with optimizer steps after the first, checkpointing settled, weights not sharded, and an
        objective that needs no old means."""
        return (
            self.algorithm.old_log_prob == "recompute"
            and self.trainer.updates_per_step > 1
            and self.checkpointing is not None
            and not self.parallel.pads_micro_batches
            and not self.objective.needs_old_means  # the early scores keep no means
        )

    def score_early(self, tensors, specs, step: int, trained: TrainedRows, keep_going) -> None:
        """Score the recompute's forwards of step `step`'s update as planned over `trained` (every
        row of every rank) while keep_going() holds, for `prepare` to take. At most two forwards
        are on the device at a time, so the device stops soon after keep_going() turns false.
        Whatever keep_going raises ends it with nothing kept."""
        self.early = None
        if not self.scores_early:
            return
        plan = self.plan(tensors, specs, step, trained)
        early = EarlyDenominators(step, self.num_optimizer_steps)
        queued: list[torch.cuda.Event] = []
        with self.scoring.recompute_mode(self.adapter.transformer):  # no padding: weights not sharded
            for forward in plan.recompute_forwards():
                if len(queued) == 2:
                    queued.pop(0).synchronize()
                if not keep_going():
                    break
                early.put(forward.rows, forward.step_index, self._score_denominator(tensors, forward)[0])
                if self.adapter.device.type == "cuda":
                    queued.append(torch.cuda.Event())
                    queued[-1].record()
        self.early = early if len(early) else None

    def prepare_and_update(
        self, tensors, specs, advantages, weights, step: int, trained=None, policy_versions=None
    ) -> dict:
        """Both phases at once, `prepare` then `update` (tests and tools); returns the metrics."""
        return self.update(self.prepare(tensors, specs, advantages, step, trained, weights, policy_versions))

    # -- the update phase -------------------------------------------------------------------------
    def update(self, batch: UpdateBatch) -> dict:
        """Run the prepared update; returns its metrics (the same on every rank)."""
        plan = batch.plan
        sums = dict.fromkeys(_LOSS_METRICS + _BEHAVIOUR_METRICS + ("behaviour_rows",), 0.0)
        count, ratio_max = 0, -math.inf
        self.records = []
        self.adapter.transformer.train()
        for index in range(len(plan.optimizer_steps)):
            denominators = self._denominators(batch, index)
            normalizer = plan.step_weights[index] * plan.num_trained_steps  # every pair weighs 1 / normalizer
            outputs: list[PolicyLossOutput] = []
            for forward in plan.step_forwards(index):
                scored = self.score_with_grad(batch.tensors, forward, self.scoring.values)
                old = denominators.of(forward, scored.log_prob)
                old_mean = denominators.mean_of(forward, scored.mean)
                surrogate = self.objective(
                    scored, old, old_mean, batch.advantages[forward.rows], _neg_dt(batch, forward)
                )
                kl = None if self.kl is None else self.kl(batch.tensors, forward, scored)
                out = clipped_policy_loss(
                    scored.log_prob,
                    old,
                    batch.advantages[forward.rows],
                    self.algorithm.clip_range,
                    kl=kl,
                    kl_beta=self.algorithm.kl_beta,
                    weights=torch.zeros(len(forward.rows)) if forward.is_padding else batch.weights[forward.rows],
                    normalizer=normalizer,
                    behaviour_log_prob=batch.behaviour_log_prob(forward, old),
                    behaviour_weight_cap=self.algorithm.behaviour_weight_cap,
                    surrogate=surrogate,
                )
                self._backward(out.loss)
                if not forward.is_padding:  # a padding forward ran only to keep pace with the other ranks
                    outputs.append(out)
            grad_norm = self._optimizer_step()
            # The step's reads from the device, after its kernels are queued.
            step_sums, loss_sum, clipped_sum, step_ratio_max = _read_outputs(outputs)
            for name in sums:
                sums[name] += step_sums[name]
            count += sum(out.num_rows for out in outputs)
            ratio_max = max(ratio_max, step_ratio_max)
            pairs = normalizer if normalizer > 0 else 1.0
            rows = torch.cat(plan.optimizer_steps[index]) if plan.optimizer_steps[index] else torch.zeros(0).long()
            # The loss and clipped share of this rank's pairs (each a share of the step's mean).
            self.records.append(UpdateRecord(rows, loss_sum, clipped_sum / pairs, grad_norm))
            batch.gaps += denominators.gaps()
        self.adapter.transformer.eval()
        return self._metrics(batch, sums, count, ratio_max)

    def _denominators(self, batch: UpdateBatch, index: int) -> "Denominators":
        """Where optimizer step `index`'s ratios take their denominator: with a recompute, epoch
        0's first step takes its own log-probs (the weights the denominator is taken with) and
        keeps them for the later epochs; every other step the prepared ones. In rollout mode, the
        first step's forwards measure the rollout-vs-trainer gap."""
        if index == 0 and self.algorithm.old_log_prob == "recompute":
            return OwnDenominators(batch)
        return Denominators(batch, measure_gap=index == 0 and batch.rollout_log_probs is not None)

    def _metrics(self, batch: UpdateBatch, sums: dict, count: int, ratio_max: float) -> dict:
        """The update's metrics, means over the trained pairs of every rank; the clipped share
        per optimizer step too (`actor/clipfrac_step_<i>`): `actor/clipfrac` is their mean over
        the steps after the first (the first one's ratios are 1 with a recomputed denominator),
        `actor/clipfrac_first_step` the first's."""
        gap = torch.cat(batch.gaps) if batch.gaps else torch.zeros(0)
        step_clipfracs = [r.clipfrac for r in self.records]
        *totals, count, gap_sum, gap_count = self.world.sum(
            [*sums.values(), *step_clipfracs, count, float(gap.sum()), gap.numel()]
        )
        totals, step_clipfracs = totals[: len(sums)], totals[len(sums) :]
        ratio_max, gap_max = self.world.max([ratio_max, float(gap.max()) if gap.numel() else -math.inf])
        totals = dict(zip(sums, totals))
        metrics = {f"actor/{name}": totals[name] / max(count, 1) for name in _LOSS_METRICS}
        if not self.objective.needs_old_means:  # ppo_clip measures no mean divergence
            del metrics["actor/divergence"]
        if step_clipfracs:
            later = step_clipfracs[1:] or step_clipfracs
            metrics["actor/clipfrac"] = float(np.mean(later))
            metrics["actor/clipfrac_first_step"] = step_clipfracs[0]
            metrics.update({f"actor/clipfrac_step_{i + 1}": value for i, value in enumerate(step_clipfracs)})
        if totals["behaviour_rows"]:  # decoupled PPO trained stale rows (on some rank)
            for name in _BEHAVIOUR_METRICS:
                metrics[f"actor/{name}_mean"] = totals[name] / totals["behaviour_rows"]
        metrics["actor/ratio_max"] = ratio_max
        metrics["actor/grad_norm"] = float(np.mean([r.grad_norm for r in self.records])) if self.records else 0.0
        metrics["actor/num_optimizer_steps"] = len(self.records)
        metrics["actor/num_trained_steps_per_sample"] = batch.plan.num_trained_steps
        metrics.update(self.checkpointing.metrics())
        if batch.early_share is not None:
            metrics["actor/old_log_prob_early_share"] = batch.early_share
        if gap_count:
            metrics["actor/logprob_gap_mean"] = gap_sum / gap_count
            metrics["actor/logprob_gap_max"] = gap_max
        return metrics

    # -- scoring and stepping -------------------------------------------------------------------
    def score_with_grad(self, tensors, forward: Forward, values: str):
        """Score `forward` with grad, its values from `values` (flowrl.trainer.logprob.Scoring)."""
        mb = {name: t[forward.rows] for name, t in tensors.items()}
        return score_transitions(
            self.adapter,
            mb,
            forward.step_index,
            forward.specs,
            self.autocast_dtype,
            values_from_no_grad=values == "value_pass",
        )

    def _score_denominator(self, tensors, forward: Forward) -> tuple[torch.Tensor, torch.Tensor]:
        """The recompute's log-probs and step means of `forward`, from the graph the update's
        values come from: the no-grad one, or the grad one (run with grad, its autograd graph
        dropped)."""
        if not self.scoring.recompute_with_grad:
            scored = self.score_no_grad(tensors, forward)
            return scored.log_prob, scored.mean
        with torch.enable_grad():
            scored = self.score_with_grad(tensors, forward, "grad_pass")
            return scored.log_prob.detach(), scored.mean.detach()

    def score_no_grad(self, tensors, forward: Forward):
        mb = {name: t[forward.rows] for name, t in tensors.items()}
        with torch.no_grad():
            return score_transitions(self.adapter, mb, forward.step_index, forward.specs, self.autocast_dtype)

    def _choose_checkpointing(self, tensors, specs, train_steps) -> CheckpointingChoice:
        """trainer.gradient_checkpointing for this process (flowrl.trainer.grad_checkpointing);
        "auto" probes with the (up to) two rows of this rank with the longest prompts, at their
        first trained step (true / false run no probe)."""
        rows = _probe_rows(tensors, specs, count=2)
        probe_forward = Forward(rows, 0, train_steps[rows, 0], [specs[i] for i in rows.tolist()])

        def probe():
            self.adapter.transformer.train()
            try:
                return self.score_with_grad(tensors, probe_forward, "grad_pass")
            finally:
                self.adapter.transformer.eval()

        return choose_checkpointing(
            self.trainer.gradient_checkpointing,
            self.adapter.transformer,
            probe,
            probe_samples=len(rows),
            micro_batch_size=self.trainer.micro_batch_size,
            device=self.adapter.device,
            agree_max=self.world.max,
        )

    @property
    def num_optimizer_steps(self) -> int:
        return self.optim.num_optimizer_steps

    @num_optimizer_steps.setter
    def num_optimizer_steps(self, value: int) -> None:
        self.optim.num_optimizer_steps = value

    def _backward(self, loss: torch.Tensor) -> None:
        self.optim.backward(loss)

    def _optimizer_step(self) -> float:
        return self.optim.step()


class Denominators:
    """An optimizer step's denominators: the prepared ones. With `measure_gap` (rollout mode's
    first optimizer step, scored by the policy that drew the rollout) it keeps each forward's
    log-probs to measure the rollout-vs-trainer gap once the step's kernels are queued."""

    def __init__(self, batch: UpdateBatch, measure_gap: bool = False):
        self.batch = batch
        self.measure_gap = measure_gap
        self.seen: list[tuple[Forward, torch.Tensor]] = []
        self.seen_means: list[tuple[Forward, torch.Tensor]] = []  # OwnDenominators' step means

    def of(self, forward: Forward, log_prob: torch.Tensor) -> torch.Tensor:
        if forward.is_padding:  # weight 0: any finite denominator; its own log-prob is one
            return log_prob.detach()
        if self.measure_gap:
            self.seen.append((forward, log_prob.detach()))
        return self.batch.old[forward.rows, forward.k]

    def mean_of(self, forward: Forward, mean: torch.Tensor) -> torch.Tensor | None:
        """The old policy's step means of `forward`'s rows (None when the objective needs none)."""
        if self.batch.old_means is None:
            return None
        if forward.is_padding:
            return mean.detach()
        return self.batch.old_means[forward.rows, forward.k]

    def gaps(self) -> list[torch.Tensor]:
        """|trainer - rollout| of the forwards kept, read from the device once."""
        rollout = self.batch.rollout_log_probs
        return [(values - rollout[forward.rows, forward.k]).abs() for forward, values in _to_host(self.seen)]


class OwnDenominators(Denominators):
    """The first optimizer step of a recompute: its own log-probs are its denominators (the
    weights the denominator is taken with: ratio exactly 1), kept as its rows' denominators for the
    later epochs; they measure the rollout-vs-trainer gap too."""

    def of(self, forward: Forward, log_prob: torch.Tensor) -> torch.Tensor:
        own = log_prob.detach()
        if not forward.is_padding:
            self.seen.append((forward, own))
        return own

    def mean_of(self, forward: Forward, mean: torch.Tensor) -> torch.Tensor | None:
        """Its own step means too, kept as its rows' old means for the later epochs."""
        if self.batch.old_means is None:
            return None
        own = mean.detach()
        if not forward.is_padding:
            self.seen_means.append((forward, own))
        return own

    def gaps(self) -> list[torch.Tensor]:
        """Keeps the values as the later epochs' denominators of these rows; |trainer - rollout| of
        the rows the current weights drew (a stale row's difference is the weights' change)."""
        batch, gaps = self.batch, []
        for forward, mean in self.seen_means:  # after the step's kernels are queued
            batch.old_means[forward.rows, forward.k] = mean.float().cpu()
        for forward, values in _to_host(self.seen):
            batch.old[forward.rows, forward.k] = values
            if batch.rollout_log_probs is not None:
                fresh = slice(None) if batch.stale is None else ~batch.stale[forward.rows]
                gaps.append((values - batch.rollout_log_probs[forward.rows, forward.k]).abs()[fresh])
        return gaps


class ReferenceKL:
    """The KL term to the reference policy: the same transformer with its LoRA adapter disabled,
    scored without grad at the forward's transitions; on the step's mean (algorithm.kl_type=mean,
    flowrl.sampler.kl_to_reference) or on the guided velocity (`velocity`: mean((v - v_ref)^2))."""

    def __init__(self, updater: PolicyUpdater, kl_type: str = "mean"):
        self.updater = updater
        self.kl_type = kl_type

    def __call__(self, tensors, forward: Forward, scored) -> torch.Tensor:
        with torch.no_grad(), adapter_disabled(self.updater.adapter.transformer):
            reference = self.updater.score_no_grad(tensors, forward)
        if self.kl_type == "velocity":
            return ((scored.velocity - reference.velocity.float()) ** 2).reshape(len(forward.rows), -1).mean(dim=1)
        return kl_to_reference(scored, reference.mean)


def _neg_dt(batch: UpdateBatch, forward: Forward) -> torch.Tensor:
    """-dt = sigma - sigma' of `forward`'s rows at their trained steps (B,), on the host."""
    rows, step = forward.rows, forward.step_index
    return batch.tensors["sigmas"][rows, step] - batch.tensors["next_sigmas"][rows, step]


def _probe_rows(tensors: dict[str, torch.Tensor], specs: Sequence[TransitionSpec], count: int) -> torch.Tensor:
    """Up to `count` rows that can share a forward (one group_key), those with the longest prompt
    (and negative prompt) encodings first: the probe measures the update's widest samples."""
    length = torch.zeros(tensors["sigmas"].shape[0])
    for prefix in ("", "negative_"):
        mask = tensors.get(f"{prefix}prompt_embeds_mask")
        if mask is not None:
            length += mask.bool().sum(dim=1).float()
    order = torch.argsort(length, descending=True, stable=True).tolist()
    key = specs[order[0]].group_key
    return torch.tensor([row for row in order if specs[row].group_key == key][:count])


def _to_host(parts: list[tuple[Forward, torch.Tensor]]) -> list[tuple[Forward, torch.Tensor]]:
    """(forward, values) pairs with their device values (float32) on the host, read in one copy."""
    if not parts:
        return []
    values = torch.cat([v.detach().float() for _, v in parts]).cpu()
    return [(forward, v) for (forward, _), v in zip(parts, values.split([len(v) for _, v in parts]))]


def _read_outputs(outputs: list[PolicyLossOutput]) -> tuple[dict[str, float], float, float, float]:
    """One optimizer step's forward metrics, read from the device in one copy: the sums of each
    metric weighted by the rows it counted (the behaviour weight's over the forwards that had one,
    whose rows are `behaviour_rows`), the sum of the losses, the sum of the clipped shares
    weighted likewise, and the largest ratio (-inf with no forward)."""
    names = _LOSS_METRICS + _BEHAVIOUR_METRICS + ("behaviour_rows",)
    if not outputs:
        return dict.fromkeys(names, 0.0), 0.0, 0.0, -math.inf
    rows = []
    for out in outputs:
        zero = torch.zeros((), device=out.loss.device)
        has_weight = out.behaviour_weight is not None
        behaviour = [getattr(out, name) if has_weight else zero for name in _BEHAVIOUR_METRICS]
        values = [getattr(out, name) for name in _LOSS_METRICS] + behaviour
        counted = [v.float() * out.num_rows for v in values] + [zero + (out.num_rows if has_weight else 0)]
        rows.append(torch.stack([*counted, out.loss.detach().float(), out.ratio_max.float()]))
    table = torch.stack(rows).cpu()
    totals = table.sum(dim=0).tolist()
    sums = dict(zip(names, totals))
    return sums, totals[len(names)], sums["clipfrac"], float(table[:, -1].max())
