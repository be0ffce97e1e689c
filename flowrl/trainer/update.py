"""The policy update of one training step: clipped PPO over the stored SDE transitions.

`PolicyUpdater.update(tensors, specs, advantages, weights, step)`:
1. plans the update (`plan`): the trained window steps of every sample (all of them, or a random
   `train_timestep_fraction` of them per sample, drawn from (trainer.seed, step)); for each update
   epoch a sample order (from (seed, step, epoch)) cut into `trainer.updates_per_step`
   mini-batches, one optimizer step each, and each mini-batch into micro-batches of rows that
   can share a forward (the same `TransitionSpec.group_key`); at the process's first update it
   then settles `trainer.gradient_checkpointing` ("auto" is measured: flowrl.trainer.grad_checkpointing);
2. gets the PPO denominator: the rollout's log-probs (`algorithm.old_log_prob=rollout`) or the
   current policy's, before any update (`recompute`). The first optimizer step scores its own rows
   with exactly those weights, so its values are its rows' denominators (its ratios are exactly
   1); only the rows of the later optimizer steps are re-scored before the update, or earlier,
   while the step's rewards are still being scored (`score_denominators_early`,
   flowrl.trainer.early_denominators);
3. for each optimizer step, for each micro-batch and each trained step (one forward: the
   micro-batch's rows at that step): recomputes the log-prob with grad, each row with the settings it was drawn with (`specs`), adds the clipped
   loss (+ KL to the LoRA-disabled reference) and backpropagates; then clips the gradient, takes
   one AdamW step and, with `trainer.ema`, updates the moving average.

Every valid (sample, trained step) pair of an optimizer step weighs the same: each micro-batch's
loss is its share of the mean over the whole mini-batch's pairs (flowrl.trainer.loss,
`normalizer`), so a short last micro-batch counts as little as it holds.

Over several ranks (`TrainedRows`, `flowrl.distributed.DataParallel`), the update is planned over
the trained rows of EVERY rank, in the order one process holding them all would have them: the
same samples are drawn, mini-batches cut and trained steps chosen as in one process, and each rank
runs the rows of each mini-batch it holds. The normalizer counts the pairs of all ranks, the
gradients are summed over the ranks before the clip, and every rank takes the same optimizer step:
a run over W ranks computes the one-process update (up to the rounding of smaller forwards). With
sharded weights every rank runs as many micro-batches per optimizer step; ranks with fewer add
weight-0 ones, which change nothing.

Where a scored log-prob takes its VALUE from is chosen once, when the updater is built
(`Scoring`): the grad pass itself, or, with a compiled model whose values must agree with the
rollout's, the no-grad graph the rollout ran (flowrl.trainer.logprob, `values_from_no_grad`), which
costs one more no-grad forward per scored micro-batch. The denominator's recompute runs in the same
graph as the values it is compared with. Its gradient always comes from the grad pass.

Every random choice derives from (seed, step), so a resumed run repeats the straight run exactly.
The rollout-vs-trainer log-prob gap is measured on transitions scored by the policy that produced
them: the recompute pass, or (rollout mode) micro-batches scored before the step's first update.

This module knows the stacked rollout tensors and the trainer's config slices; it knows nothing
about the engine, rewards or how the advantages were computed.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from flowrl.config.sections import OldLogProbSource
from flowrl.distributed.parallel import DataParallel
from flowrl.distributed.trained_rows import TrainedRows, with_padding
from flowrl.distributed.world import World
from flowrl.engine.output import TransitionSpec
from flowrl.models.lora import adapter_disabled
from flowrl.sampler import kl_to_reference
from flowrl.trainer.early_denominators import EarlyDenominators
from flowrl.trainer.grad_checkpointing import CheckpointingChoice, choose_checkpointing
from flowrl.trainer.logprob import MIXED_PRECISION_DTYPES, score_transitions, takes_values_from_no_grad
from flowrl.trainer.loss import PolicyLossOutput, clipped_policy_loss

# Where a grad pass's log-prob values come from: its own graph ("grad_pass"), or a no-grad pass
# of the same forwards run just before it ("value_pass").
ValueSource = Literal["grad_pass", "value_pass"]
_LOSS_METRICS = ("policy_loss", "clipfrac", "ratio_mean", "approx_kl", "kl")


@dataclass(frozen=True)
class Scoring:
    """How the update scores: where every grad pass takes its log-prob values from, and whether
    the old-log-prob recompute runs with grad (so that it runs the grad graph those values come
    from) or without."""

    values: ValueSource
    recompute_with_grad: bool = False

    @classmethod
    def choose(cls, values_from_no_grad: bool, old_log_prob: OldLogProbSource) -> "Scoring":
        if not values_from_no_grad:
            # One graph (an eager model, or one with dropout): its own values; the recompute runs
            # the same computation without grad, keeping no activations.
            return cls("grad_pass")
        if old_log_prob == "recompute":
            # Compiled, and the ratio compares the grad graph with itself (the recompute runs it
            # too, with grad, and drops the graph), so no value pass runs at all. The rollout-vs-
            # trainer gap then measures the grad graph. A KL term compares the step's mean with the
            # reference's, a no-grad forward with the LoRA switched off: another graph whichever
            # graph the step's mean comes from, so the value pass would not make the two agree.
            return cls("grad_pass", recompute_with_grad=True)
        # The rollout's log-probs are the denominator: every value comes from the rollout's graph.
        return cls("value_pass")


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

    @property
    def optimizer_steps(self) -> list[list[torch.Tensor]]:
        return [micro_batches for epoch in self.epochs for micro_batches in epoch]

    @property
    def recomputed_micro_batches(self) -> list[torch.Tensor]:
        """The micro-batches the old-log-prob recompute scores: those of epoch 0's optimizer steps
        after the first (the first one's grad passes give its rows' denominators), in their order,
        so each row is recomputed in the batch composition it is trained in."""
        return [rows for micro_batches in self.epochs[0][1:] for rows in micro_batches]

    @property
    def recompute_padding(self) -> int:
        """Weight-0 micro-batches this rank adds to the recompute: those of epoch 0's optimizer
        steps after the first (sharded weights; else 0)."""
        return sum(self.padding[1 : len(self.epochs[0])])


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

    ema: a flowrl.trainer.ema.ParameterEMA over the same parameters, stepped after every
    optimizer step (None: no moving average). parallel: how gradients combine over ranks
    (flowrl.distributed.DataParallel; None: one process)."""

    def __init__(
        self,
        adapter,
        params: list[torch.nn.Parameter],
        algorithm_cfg,
        trainer_cfg,
        ema=None,
        parallel: DataParallel | None = None,
    ):
        self.adapter = adapter
        self.params = params
        self.parallel = parallel or DataParallel(World.single(), "single")
        self.world = self.parallel.world
        self.algorithm = algorithm_cfg
        self.trainer = trainer_cfg
        self.ema = ema
        self.optimizer = torch.optim.AdamW(
            params, lr=trainer_cfg.lr, betas=tuple(trainer_cfg.betas), weight_decay=trainer_cfg.weight_decay
        )
        self.autocast_dtype = MIXED_PRECISION_DTYPES[trainer_cfg.mixed_precision]
        self.scaler = torch.amp.GradScaler(adapter.device.type) if trainer_cfg.mixed_precision == "fp16" else None
        self.num_optimizer_steps = 0
        self.records: list[UpdateRecord] = []  # the last update's optimizer steps
        # Read once: the trainer compiles the model (and injects LoRA) before building the updater.
        self.values_from_no_grad = takes_values_from_no_grad(adapter)
        self.scoring = Scoring.choose(self.values_from_no_grad, algorithm_cfg.old_log_prob)
        # trainer.gradient_checkpointing: "auto" is measured at this process's first update.
        self.checkpointing: CheckpointingChoice | None = None
        self.early: EarlyDenominators | None = None  # score_denominators_early's, for the next update

    # -- the update -----------------------------------------------------------------------------
    def update(
        self,
        tensors: dict[str, torch.Tensor],
        specs: Sequence[TransitionSpec],
        advantages: torch.Tensor,
        weights: torch.Tensor,
        step: int,
        trained: TrainedRows | None = None,
    ) -> dict:
        """Run the update of training step `step`; returns its metrics (see module docstring),
        the same on every rank. tensors, specs (the settings each row was drawn with), advantages,
        weights: this rank's rows. trained: the rows trained on every rank (None: every row given
        here, in one process)."""
        trained = trained if trained is not None else TrainedRows.of_one_process(specs, weights)
        # 1. what is trained, in which order
        plan = self.plan(tensors, specs, step, trained)
        if self.checkpointing is None:
            self.checkpointing = self._choose_checkpointing(tensors, specs, plan.train_steps)
        t0 = time.perf_counter()
        num_train = plan.train_steps.shape[1]
        rollout_log_probs = tensors.get("all_log_probs")
        if rollout_log_probs is not None:
            rollout_log_probs = rollout_log_probs.gather(1, plan.train_steps).float()

        # 2. the PPO denominator (the first optimizer step's rows get theirs from its own passes)
        with torch.profiler.record_function("flowrl/old_log_prob"):  # flowrl bench train --profile
            old, gaps, early_share = self._old_log_probs(tensors, specs, plan, rollout_log_probs, step)
        t_old = time.perf_counter()

        # 3. clipped PPO: score with grad, loss, backward; one optimizer step per mini-batch
        with torch.profiler.record_function("flowrl/update"):
            sums, count, ratio_max = self._optimizer_steps(
                tensors, specs, advantages, weights, plan, old, gaps, rollout_log_probs
            )

        # 4. metrics (means over the trained pairs of every rank)
        gap = torch.cat(gaps) if gaps else torch.zeros(0)
        *totals, count, gap_sum, gap_count = self.world.sum([*sums.values(), count, float(gap.sum()), gap.numel()])
        ratio_max, gap_max = self.world.max([ratio_max, float(gap.max()) if gap.numel() else -math.inf])
        metrics = {f"actor/{name}": value / max(count, 1) for name, value in zip(sums, totals)}
        metrics["actor/ratio_max"] = ratio_max
        metrics["actor/grad_norm"] = float(np.mean([r.grad_norm for r in self.records])) if self.records else 0.0
        metrics["actor/num_optimizer_steps"] = len(self.records)
        metrics["actor/num_trained_steps_per_sample"] = num_train
        metrics.update(self.checkpointing.metrics())
        if early_share is not None:
            metrics["actor/old_log_prob_early_share"] = early_share
        if gap_count:
            metrics["actor/logprob_gap_mean"] = gap_sum / gap_count
            metrics["actor/logprob_gap_max"] = gap_max
        # The phases' wall times (flowrl bench train reads them): the denominator, then the rest,
        # its last optimizer step's kernels included.
        if self.adapter.device.type == "cuda":
            torch.cuda.synchronize(self.adapter.device)
        metrics["timing/old_log_prob_s"] = t_old - t0
        metrics["timing/update_s"] = time.perf_counter() - t_old
        return metrics

    # -- the pieces of the update -----------------------------------------------------------------
    def _optimizer_steps(
        self, tensors, specs, advantages, weights, plan: Plan, old: torch.Tensor, gaps: list, rollout_log_probs
    ) -> tuple[dict[str, float], int, float]:
        """The update's optimizer steps (module docstring, 3.); returns this rank's sums of the loss
        metrics, its pair count and largest ratio, and appends the gaps it measured to `gaps`. The
        micro-batch loop never waits for the device: its metrics and gaps stay there until the
        optimizer step, which reads them once. Epoch 0's first step fills in `old` for its rows."""
        transformer = self.adapter.transformer
        num_train = plan.train_steps.shape[1]
        first_step_scores_old = self.algorithm.old_log_prob == "recompute"
        first_step_values: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        sums = dict.fromkeys(_LOSS_METRICS, 0.0)
        count, ratio_max = 0, -math.inf
        step_groups = self._step_groups(num_train)
        self.records = []
        transformer.train()
        for index, micro_batches in enumerate(plan.optimizer_steps):
            rows_of_step = torch.cat(micro_batches) if micro_batches else torch.zeros(0, dtype=torch.long)
            # Every valid (row, step) pair of this optimizer step, on every rank, weighs 1 / normalizer.
            normalizer = plan.step_weights[index] * num_train
            outputs: list[PolicyLossOutput] = []
            rollout_gaps: list[tuple[torch.Tensor, int, torch.Tensor]] = []
            for rows, is_padding in with_padding(micro_batches, plan.padding[index]):
                for steps in step_groups:
                    pair_rows, pair_specs, step_index = _pairs(rows, steps, plan.train_steps, specs)
                    result = self._score_with_grad(tensors, pair_specs, pair_rows, step_index, self.scoring.values)
                    denominator = torch.cat([old[rows, k] for k in steps])
                    if index == 0 and first_step_scores_old:
                        # These weights are the ones the denominator is taken with: ratio exactly 1.
                        denominator = result.log_prob.detach()
                        if not is_padding:
                            first_step_values += _per_step(rows, steps, denominator)
                    kl = None
                    if self.algorithm.kl_beta > 0:
                        kl = kl_to_reference(result, self._reference_mean(tensors, pair_specs, pair_rows, step_index))
                    out = clipped_policy_loss(
                        result.log_prob,
                        result.log_prob.detach() if is_padding else denominator,
                        advantages[pair_rows],
                        self.algorithm.clip_range,
                        kl=kl,
                        kl_beta=self.algorithm.kl_beta,
                        weights=torch.zeros(len(pair_rows)) if is_padding else weights[pair_rows],
                        normalizer=normalizer,
                    )
                    self._backward(out.loss)
                    if is_padding:
                        continue  # it ran only so that every rank runs as many forwards and backwards
                    if rollout_log_probs is not None and index == 0 and not first_step_scores_old:
                        rollout_gaps += _per_step(rows, steps, result.log_prob.detach())
                    outputs.append(out)
            self.parallel.reduce_gradients(self.params)
            grad_norm = self._optimizer_step()
            # The step's reads from the device, after its kernels are queued.
            step_sums, loss_sum, clipped_sum, step_ratio_max = _read_outputs(outputs)
            for name in _LOSS_METRICS:
                sums[name] += step_sums[name]
            count += sum(out.num_rows for out in outputs)
            ratio_max = max(ratio_max, step_ratio_max)
            pairs = normalizer if normalizer > 0 else 1.0
            # The loss and clipped share of this rank's pairs (each a share of the step's mean).
            self.records.append(UpdateRecord(rows_of_step, loss_sum, clipped_sum / pairs, grad_norm))
            for rows, k, values in _to_host(rollout_gaps):
                gaps.append((values - rollout_log_probs[rows, k]).abs())
            for rows, k, values in _to_host(first_step_values):
                old[rows, k] = values  # the later epochs' denominators of these rows
                if rollout_log_probs is not None:
                    gaps.append((old[rows, k] - rollout_log_probs[rows, k]).abs())
            first_step_values.clear()
        transformer.eval()
        return sums, count, ratio_max

    def plan(
        self,
        tensors: dict[str, torch.Tensor],
        specs: Sequence[TransitionSpec],
        step: int,
        trained: TrainedRows | None = None,
    ) -> Plan:
        """The update's trained steps and this rank's micro-batches of each optimizer step, drawn
        over the rows trained on every rank (module docstring; `trained` None: every row of
        `tensors`, in one process)."""
        num_local, window = tensors["sigmas"].shape
        if window == 0:
            raise ValueError("the rollouts have no SDE window steps; set rollout.sampling.sde_window_size >= 1")
        if len(specs) != num_local:
            raise ValueError(f"{len(specs)} transition specs for {num_local} rollout rows; pass one per row")
        trained = trained if trained is not None else TrainedRows.of_one_process(specs, torch.ones(num_local))
        num_rows = len(trained.owner)
        epochs, step_weights, padding = [], [], []
        for epoch in range(self.trainer.update_epochs):
            order = torch.randperm(num_rows, generator=self._generator(step, 2, epoch))
            mini_batches = [m.numpy() for m in torch.tensor_split(order, self.trainer.updates_per_step) if m.numel()]
            steps = []
            for rows in mini_batches:
                mine = torch.from_numpy(trained.index[trained.held_by(rows, trained.rank)])
                steps.append(self._micro_batches(mine, specs))
                step_weights.append(float(trained.weight[rows].sum()))
                padding.append(self._padding(trained, rows, len(steps[-1])))
            epochs.append(steps)
        global_steps = self.trained_steps(num_rows, window, step)
        train_steps = torch.arange(global_steps.shape[1]).expand(num_local, -1).clone()
        mine = np.flatnonzero(trained.owner == trained.rank)
        train_steps[torch.from_numpy(trained.index[mine])] = global_steps[torch.from_numpy(mine)]
        return Plan(train_steps, epochs, step_weights, padding)

    def _padding(self, trained: TrainedRows, rows: np.ndarray, num_mine: int) -> int:
        """Weight-0 micro-batches this rank adds to an optimizer step over `rows` so that it runs as
        many as the busiest rank (with sharded weights; else none)."""
        if not self.parallel.pads_micro_batches:
            return 0
        return trained.most_micro_batches(rows, self.trainer.micro_batch_size) - num_mine

    def trained_steps(self, num_rows: int, window: int, step: int) -> torch.Tensor:
        """(N, K) window-step indices to train per sample (sorted), K = max(1, int(W * fraction))."""
        count = max(1, int(window * float(self.algorithm.train_timestep_fraction) + 1e-9))
        if count >= window:
            return torch.arange(window).expand(num_rows, window).clone()
        gen = self._generator(step, 1)
        return torch.stack([torch.randperm(window, generator=gen)[:count].sort().values for _ in range(num_rows)])

    def _choose_checkpointing(self, tensors, specs, train_steps) -> CheckpointingChoice:
        """trainer.gradient_checkpointing for this process (flowrl.trainer.grad_checkpointing); "auto"
        probes with the (up to) two rows of this rank with the longest prompts, at their first
        trained step (true / false run no probe)."""
        rows = _probe_rows(tensors, specs, count=2)
        row_specs = [specs[i] for i in rows.tolist()]

        def probe():
            self.adapter.transformer.train()
            try:
                return self._score_with_grad(tensors, row_specs, rows, train_steps[rows, 0], "grad_pass")
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

    def _step_groups(self, num_train: int) -> list[list[int]]:
        """The trained-step indices 0..num_train-1, one forward each."""
        return [[k] for k in range(num_train)]

    def _micro_batches(self, rows: torch.Tensor, specs: Sequence[TransitionSpec]) -> list[torch.Tensor]:
        """`rows` cut into micro-batches of at most trainer.micro_batch_size rows, each holding
        rows of one group_key (in their order; one group is the plain cut of `rows`)."""
        groups: dict[tuple, list[int]] = {}
        for row in rows.tolist():
            groups.setdefault(specs[row].group_key, []).append(row)
        size = self.trainer.micro_batch_size
        return [torch.tensor(g[i : i + size]) for g in groups.values() for i in range(0, len(g), size)]

    def _old_log_probs(
        self, tensors, specs, plan: Plan, rollout_log_probs, step: int
    ) -> tuple[torch.Tensor, list, float | None]:
        """The PPO denominator (N, K) as far as it is known before the update, the log-prob gaps
        it measured, and the share of the recompute's forwards taken from score_denominators_early
        (None without a recompute). With `recompute`, the rows of epoch 0's later optimizer steps
        are scored in their micro-batches and step groups (the composition they are trained in:
        ratio exactly 1 on CPU until an optimizer step changes the weights) and the first step's
        rows are left to it; the recompute's `padding` weight-0 micro-batches are scored and
        dropped (sharded weights)."""
        if self.algorithm.old_log_prob == "rollout":
            if rollout_log_probs is None:
                raise ValueError(
                    "algorithm.old_log_prob=rollout needs rollout log-probs; set rollout.sampling.logprobs=true"
                )
            return rollout_log_probs, [], None
        early, self.early = self.early, None
        if early is not None and (early.step, early.optimizer_steps) != (step, self.num_optimizer_steps):
            early = None  # scored for another step, or with other weights
        train_steps = plan.train_steps
        old = torch.zeros(train_steps.shape)
        recomputed = torch.zeros(train_steps.shape[0], dtype=torch.bool)
        scored: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        forwards, taken = 0, 0
        with self._recompute_mode():
            for rows, is_padding, steps, pair_rows, pair_specs, step_index in self._recompute_forwards(plan, specs):
                log_prob = None if early is None or is_padding else early.take(pair_rows, step_index)
                forwards, taken = forwards + 1, taken + (log_prob is not None)
                if log_prob is None:
                    log_prob = self._score_denominator(tensors, pair_specs, pair_rows, step_index)
                if not is_padding:
                    scored += _per_step(rows, steps, log_prob)
                    recomputed[rows] = True
        for rows, k, values in _to_host(scored):  # read after every recompute forward is queued
            old[rows, k] = values
        gaps = []
        if rollout_log_probs is not None and recomputed.any():
            gaps = [(old[recomputed] - rollout_log_probs[recomputed]).abs().flatten()]
        return old, gaps, taken / forwards if forwards else 0.0

    def _recompute_forwards(self, plan: Plan, specs):
        """The recompute's forwards in order, as (rows, is_padding, steps, pair_rows, pair_specs,
        step_index): each micro-batch of epoch 0's later optimizer steps, then the padding ones,
        at each group of trained steps."""
        for rows, is_padding in with_padding(plan.recomputed_micro_batches, plan.recompute_padding):
            for steps in self._step_groups(plan.train_steps.shape[1]):
                yield rows, is_padding, steps, *_pairs(rows, steps, plan.train_steps, specs)

    @contextlib.contextmanager
    def _recompute_mode(self):
        """The module mode of the graph the recompute runs in: that of the grad passes (train) when
        it runs with grad; eval again afterwards."""
        if self.scoring.recompute_with_grad:
            self.adapter.transformer.train()
        try:
            yield
        finally:
            self.adapter.transformer.eval()

    @property
    def scores_denominators_early(self) -> bool:
        """Whether score_denominators_early scores anything (flowrl.trainer.early_denominators):
        a recompute with optimizer steps after the first, checkpointing settled, weights not sharded."""
        return (
            self.algorithm.old_log_prob == "recompute"
            and self.trainer.updates_per_step > 1
            and self.checkpointing is not None
            and not self.parallel.pads_micro_batches
        )

    def score_denominators_early(self, tensors, specs, step: int, trained: TrainedRows, keep_going) -> None:
        """Score the recompute's forwards of step `step`'s update as planned over `trained` (every
        row of every rank) while keep_going() holds, for the update to take
        (flowrl.trainer.early_denominators). At most two forwards are on the device at a time, so
        the device stops soon after keep_going() turns false. Whatever keep_going raises ends it
        with nothing kept."""
        self.early = None
        if not self.scores_denominators_early:
            return
        plan = self.plan(tensors, specs, step, trained)
        early = EarlyDenominators(step, self.num_optimizer_steps)
        queued: list[torch.cuda.Event] = []
        with self._recompute_mode():  # no padding forwards: the weights are not sharded
            for _, _, _, pair_rows, pair_specs, step_index in self._recompute_forwards(plan, specs):
                if len(queued) == 2:
                    queued.pop(0).synchronize()
                if not keep_going():
                    break
                early.put(pair_rows, step_index, self._score_denominator(tensors, pair_specs, pair_rows, step_index))
                if self.adapter.device.type == "cuda":
                    queued.append(torch.cuda.Event())
                    queued[-1].record()
        self.early = early if len(early) else None

    def _score_denominator(self, tensors, specs, rows, step_index) -> torch.Tensor:
        """The recompute's log-probs of micro-batch `rows`, from the graph the update's values come
        from: the no-grad one, or the grad one (run with grad, its autograd graph dropped)."""
        if not self.scoring.recompute_with_grad:
            return self._score_no_grad(tensors, specs, rows, step_index).log_prob
        with torch.enable_grad():
            return self._score_with_grad(tensors, specs, rows, step_index, "grad_pass").log_prob.detach()

    def _score_with_grad(self, tensors, specs, rows, step_index, source: ValueSource):
        """Score micro-batch `rows` at `step_index` with grad, its values from `source`."""
        mb = {name: t[rows] for name, t in tensors.items()}
        return score_transitions(
            self.adapter, mb, step_index, specs, self.autocast_dtype, values_from_no_grad=source == "value_pass"
        )

    def _score_no_grad(self, tensors, specs, rows, step_index):
        mb = {name: t[rows] for name, t in tensors.items()}
        with torch.no_grad():
            return score_transitions(self.adapter, mb, step_index, specs, self.autocast_dtype)

    def _reference_mean(self, tensors, specs, rows, step_index):
        with torch.no_grad(), adapter_disabled(self.adapter.transformer):
            return self._score_no_grad(tensors, specs, rows, step_index).mean

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def _optimizer_step(self) -> float:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.parallel.clip_gradients(self.params, self.trainer.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_optimizer_steps += 1
        if self.ema is not None:
            self.ema.step(self.num_optimizer_steps)
        return grad_norm

    def _generator(self, *keys: int) -> torch.Generator:
        return torch.Generator().manual_seed(
            int(np.random.SeedSequence([self.trainer.seed, *keys]).generate_state(1)[0])
        )


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


def _pairs(rows: torch.Tensor, steps: list[int], train_steps: torch.Tensor, specs: Sequence[TransitionSpec]):
    """One forward's (sample, trained step) pairs: `rows` at each trained step k of `steps`, step
    by step (the first len(rows) pairs at steps[0], and so on): their rows, specs and window-step
    indices."""
    pair_rows = rows.repeat(len(steps))
    step_index = torch.cat([train_steps[rows, k] for k in steps])
    return pair_rows, [specs[i] for i in pair_rows.tolist()], step_index


def _per_step(
    rows: torch.Tensor, steps: list[int], values: torch.Tensor
) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """(rows, k, values of rows at trained step k) for each k of `steps`, from one forward's
    values over `_pairs(rows, steps, ...)`."""
    return [(rows, k, part) for k, part in zip(steps, values.split(len(rows)))]


def _to_host(parts: list[tuple[torch.Tensor, int, torch.Tensor]]) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """(rows, k, values) triples with their device values (float32) on the host, read in one copy."""
    if not parts:
        return []
    values = torch.cat([v.detach().float() for _, _, v in parts]).cpu()
    return [(rows, k, v) for (rows, k, _), v in zip(parts, values.split([len(v) for _, _, v in parts]))]


def _read_outputs(outputs: list[PolicyLossOutput]) -> tuple[dict[str, float], float, float, float]:
    """One optimizer step's micro-batch metrics, read from the device in one copy: the sums of
    each metric weighted by the rows it counted, the sum of the losses, the sum of the clipped
    shares weighted likewise, and the largest ratio (-inf with no micro-batch)."""
    if not outputs:
        return dict.fromkeys(_LOSS_METRICS, 0.0), 0.0, 0.0, -math.inf
    table = torch.stack(
        [
            torch.stack(
                [
                    *(getattr(out, name).float() * out.num_rows for name in _LOSS_METRICS),
                    out.loss.detach().float(),
                    out.ratio_max.float(),
                ]
            )
            for out in outputs
        ]
    ).cpu()
    totals = table.sum(dim=0).tolist()
    sums = dict(zip(_LOSS_METRICS, totals))
    return sums, totals[len(_LOSS_METRICS)], sums["clipfrac"], float(table[:, -1].max())
