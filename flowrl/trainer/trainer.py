"""FlowGRPOTrainer: the colocated online-RL loop.

One training step:
1. take `prompts_per_step` dataset rows, give each a uid, draw ONE SDE window for the whole step
   (per-row windows collapsed training elsewhere) and repeat every row n times (interleaved);
2. roll them out through the AgentLoop; each finished sample is scored at once by the async
   reward scorer while the others are still denoising;
3. group advantages by uid; drop rows with NaN rewards (and zero-std groups with
   zero_std_policy=drop);
4. PPO update (flowrl.trainer.update), each row re-scored with the settings it was drawn with (the
   rollout's per-row TransitionSpec, so per-row sampling overrides score as they sampled); the
   engine is idle here, since the rollout has returned;
5. bump the policy version and publish it: the engine's transformer IS the trained module (LoRA
   injected in place), so the next rollout samples from the new weights with no copy, and every
   output records the version that produced it (with rollout.merge_lora a rollout merges the
   adapter into a copy of the adapted weights when it begins: flowrl.accel.lora_merge).
   Decoupled (rollout.servers / num_replicas), the rollouts run on rollout servers and publishing
   uploads the weights to them (flowrl.rollout.backends); with trainer.async_rollout, step
   k + 1's rollout runs while step k trains (flowrl.rollout.schedule);
6. metrics to metrics.jsonl/tensorboard; validation (ODE, fixed seeds; with trainer.ema, sampled
   with the moving average of the weights) and checkpoints every k steps.

Over several ranks (`world`, flowrl.distributed; docs/distributed.md) every rank draws the same
prompts and rolls out its contiguous share of the step's groups, each row with the seed it has in
one process; rewards, uids and row settings are all-gathered (flowrl.distributed.step_rows), so the
advantages use the statistics of all rows exactly as one process computes them; the update is
planned over every rank's rows and every rank takes the same optimizer step
(flowrl.trainer.update). Validation prompts are split over the ranks and gathered. Metrics cover
all rows (timings: the slowest rank); rank 0 alone writes logs, grids, the progress bar, the
checkpoint's shared files and the exported weights. Rollout servers and async rollouts are for
one process (flowrl.distributed.checks refuses them over several ranks).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch

from flowrl import sampler
from flowrl.console import note
from flowrl.data.prompts import PromptSampler
from flowrl.distributed.checks import check_world
from flowrl.distributed.parallel import DataParallel
from flowrl.distributed.step_rows import gather_step_rows
from flowrl.distributed.world import World
from flowrl.engine.output import TransitionSpec
from flowrl.models.lora import apply_trainable, has_lora, save_lora_for_diffusers
from flowrl.rollout.backends import open_rollout_backend
from flowrl.rollout.schedule import CollectedRollout, VersionHistory, schedule_for
from flowrl.run import checkpoint, resume
from flowrl.run.checks import build_engine, check_before_loading, resolve_model_path
from flowrl.run.export import export_pipeline, save_transformer
from flowrl.run.health import ZeroSpreadWatch
from flowrl.run.interrupts import PhaseAborted, StepRewind, StopSignals, TrainingInterrupted
from flowrl.run.metrics import MetricsLogger, grid_captions, plot_reward_curve, read_metrics, save_image_grid
from flowrl.run.progress import NO_PROGRESS, StepProgress
from flowrl.trainer.advantages import compute_group_advantages
from flowrl.trainer.ema import ParameterEMA
from flowrl.trainer.update import PolicyUpdater
from flowrl.waiting import call_abortably

_NON_METADATA = ("sampling_overrides", "raw_prompt")
# The engine counters gathered over ranks (flowrl.distributed.step_rows).
_ENGINE_COUNTERS = ("num_rows", "num_forwards", "images_per_second")
# How long a stopped run waits for reward batches already being scored before it leaves them.
_STOPPED_SCORING_WAIT_S = 10.0


def _row_metadata(batch, row: int) -> dict:
    return {k: v[row] for k, v in batch.non_tensor_batch.items() if k not in _NON_METADATA}


def _update_inputs(rollout) -> tuple[dict, list[TransitionSpec]]:
    """A rollout batch as the updater takes it: its stored tensors (the images left out) and the
    settings each row was drawn with."""
    tensors = {k: v for k, v in rollout.batch.items() if k != "images"}
    return tensors, TransitionSpec.from_columns(rollout.non_tensor_batch)


class FlowGRPOTrainer:
    """Colocated FlowGRPO training of one model (see the module docstring).

    engine / reward: pass prebuilt ones (tests); by default both are built from `cfg`.
    plan: how the run starts (`flowrl.run.resume.plan_run`); by default planned here (on rank
    0), before the model loads. world: this process among the run's ranks (None: one process).
    """

    # fit() installs these for its run; a step run outside fit() shows no bar and is not abortable.
    _progress = NO_PROGRESS
    _signals: StopSignals | None = None

    def __init__(self, cfg, engine=None, reward=None, plan: resume.RunPlan | None = None, world: World | None = None):
        from flowrl.config import config_to_dict
        from flowrl.rewards.async_scoring import AsyncRewardScorer, scoring_workers
        from flowrl.rollout.agent_loop import AgentLoop

        self.cfg = cfg
        self.world = world or World.single(cfg.model.resolve_device())
        prepared = check_before_loading(cfg, reward)  # every cheap check before the model loads
        if self.world.is_distributed:
            check_world(cfg, self.world.size, self.world.local_size)
        self.config_dict = config_to_dict(cfg)
        # Which checkpoint (verified), or a fresh start in a folder of its own: decided before loading.
        self.plan = plan or self.world.on_main(lambda: resume.plan_run(cfg, self.config_dict))
        if self.world.is_main:
            self.plan.start(cfg.trainer.output_dir)
        self.world.barrier()  # no rank reads the folder before rank 0 has cleaned it
        self.reward = prepared.reward
        self.val_rows = prepared.val_rows
        tcfg = cfg.trainer
        self.output_dir = Path(tcfg.output_dir)
        # Where training rollouts run; started replicas load their model while this one loads.
        self.rollout_backend = open_rollout_backend(cfg, self.output_dir)
        if engine is None:
            # The embedded tiny model is built once, by rank 0, before any rank reads it.
            self.world.on_main(lambda: resolve_model_path(cfg.model))
            engine = build_engine(cfg, device=self.world.device)
        self.engine = engine
        self.adapter = engine.adapter
        # `model.path=random:NAME`: the architecture's name, said in every step's metrics and the summary.
        self.random_weights = getattr(self.adapter, "random_weights", None)
        transformer = self.adapter.transformer
        with torch.random.fork_rng(devices=[]):  # LoRA init from trainer.seed: runs repeat exactly
            torch.manual_seed(tcfg.seed)
            params = apply_trainable(transformer, tcfg.lora)
        if tcfg.gradient_checkpointing is not False:  # "auto" too: the updater turns it off where memory allows
            transformer.enable_gradient_checkpointing()
        # Over ranks: replicated LoRA, or the full transformer sharded in place (new parameter objects).
        self.parallel = DataParallel.wrap(transformer, self.world, full_fine_tuning=not tcfg.lora.enabled)
        if self.parallel.is_sharded:
            params = [p for p in transformer.parameters() if p.requires_grad]
        if cfg.engine.compile:
            # After LoRA injection, so the compiled blocks trace the modules that are trained; the
            # engine and the trainer share them (compilation is in place).
            from flowrl.accel import compile_adapter

            self.engine.compiled_modules = compile_adapter(self.adapter)
            # torch.compile is lazy: say where the first steps' time goes (docs/config.md, engine.compile).
            self._print(
                f"engine.compile: {len(self.engine.compiled_modules)} modules compile on first use; the first "
                "rollout, validation and update take longer (minutes on a GPU; docs/performance.md gives the "
                "measured first-step times)"
            )
        named = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
        self.param_names = list(named)
        ema = tcfg.ema
        self.ema = ParameterEMA(named, ema.decay, ema.update_every) if ema.enabled else None
        self.updater = PolicyUpdater(self.adapter, params, cfg.algorithm, tcfg, ema=self.ema, parallel=self.parallel)
        # Rollouts use the trainer's mixed precision, so their log-probs are the trainer's.
        self.engine.set_mixed_precision(self.updater.autocast_dtype)
        self.rollout_backend.bind(self.engine)
        self.agent_loop = AgentLoop(self.rollout_backend.replicas, cfg.rollout)
        # Validation samples in this process, with the trainer's weights (or their EMA).
        decoupled = self.rollout_backend.is_decoupled
        self.val_agent_loop = AgentLoop(self.engine, cfg.rollout) if decoupled else self.agent_loop
        self.prompts = PromptSampler(prepared.train_rows, tcfg.prompts_per_step, cfg.data.shuffle, tcfg.seed)
        self.step = 0
        self.policy_version = 0
        self.lora_merge_s = 0.0  # the last training rollout's merge (rollout.merge_lora)
        if self.plan.checkpoint is not None:
            self._restore(self.plan.checkpoint)
        self.versions = VersionHistory(self.step, self.policy_version)
        self.rollouts = schedule_for(self)  # synchronous, or one step ahead (trainer.async_rollout)
        self.rollout_backend.publish(self.policy_version)  # rollout servers start from these weights
        log = cfg.logging
        self.logger = None  # rank 0 alone writes metrics
        if self.world.is_main:
            self.logger = MetricsLogger(
                self.output_dir, log.tensorboard, log.wandb, log.wandb_project, self.config_dict, resume_step=self.step
            )
        # Last: its worker threads run until close(), so a failure above leaves none behind.
        self.scorer = AsyncRewardScorer(self.reward, scoring_workers(cfg.reward.num_workers, self.world.local_size))

    def _print(self, line: str) -> None:
        if self.world.is_main:
            print(line, flush=True)

    # --- one step ---------------------------------------------------------------------------------
    def _sde_window(self, step: int) -> tuple[int, int] | None:
        """The step's shared SDE window: explicit, drawn from (seed, step), or the engine default."""
        s = self.cfg.rollout.sampling
        if s.sde_window is not None or s.sde_window_size is None:
            return None if s.sde_window is None else tuple(s.sde_window)
        gen = torch.Generator().manual_seed(
            int(np.random.SeedSequence([self.cfg.trainer.seed, step, 7]).generate_state(1)[0])
        )
        return sampler.draw_sde_window(s.num_inference_steps, s.sde_window_size, s.sde_window_range, gen)

    def train_step(self) -> dict:
        """Run training step self.step + 1; returns its metrics (the same on every rank)."""
        t0 = time.perf_counter()
        step = self.step + 1
        # 1. the step's rollout and rewards (self._roll_out, now or started during the last step)
        with torch.profiler.record_function("flowrl/rollout"):  # flowrl bench train --profile
            collected = self.rollouts.collect(step)
        rollout, everyone = collected.rollout, collected.rows
        t_rollout = time.perf_counter()

        # 2. advantages, over the rows of every rank
        algo = self.cfg.algorithm
        adv = compute_group_advantages(
            everyone.rewards,
            everyone.uids,
            algo.std_mode,
            algo.std_eps,
            algo.adv_clip_max,
            algo.zero_std_threshold,
        )
        keep = adv.is_valid.copy()
        if algo.zero_std_policy == "drop":
            keep &= ~adv.is_zero_std
        if algo.shuffle_advantages:  # the control run: same advantages, other rows
            adv.values[keep] = adv.values[keep][self._control_permutation(step, int(keep.sum()))]
        metrics = everyone.metrics(adv, keep, self.policy_version)
        metrics.update(self._staleness_metrics(collected))

        # 3. update (the trainer's engine is idle: generate_sequences returned every sample);
        # planned over the kept rows of every rank, each rank running its own
        self._progress.phase("update")
        if keep.any():
            tensors, specs = _update_inputs(rollout)
            advantages = torch.from_numpy(adv.values[everyone.mine])
            checkpointing_known = self.updater.checkpointing is not None
            metrics.update(
                self.updater.update(
                    tensors, specs, advantages, torch.ones(len(specs)), step, trained=everyone.trained(keep)
                )
            )
            self.policy_version = self.updater.num_optimizer_steps
            if not checkpointing_known and self.world.is_main:  # the process's first update
                if self.updater.checkpointing.measured:
                    note(self.updater.checkpointing.describe())  # trainer.gradient_checkpointing=auto
        # 4. the new version goes live (with trainer.async_rollout: once the early rollout returns)
        t_sync = time.perf_counter()
        self.rollouts.after_update(self.policy_version)
        metrics["timing/weight_sync_s"] = time.perf_counter() - t_sync
        self.versions.record(step, self.policy_version)
        if self.random_weights:
            metrics["model/random_weights"] = 1.0
        metrics["timing/rollout_s"] = collected.rollout_s
        if self.cfg.rollout.merge_lora:
            metrics["timing/lora_merge_s"] = self.lora_merge_s  # part of timing/rollout_s
        metrics["timing/rollout_wait_s"] = t_rollout - t0
        metrics["timing/reward_wait_s"] = collected.reward_wait_s
        if collected.early_recompute_s:
            # The recompute scored while the rewards were computed is the old log-prob's time too.
            metrics["timing/old_log_prob_early_s"] = collected.early_recompute_s
            metrics["timing/old_log_prob_s"] = metrics.get("timing/old_log_prob_s", 0.0) + collected.early_recompute_s
        metrics["timing/step_s"] = time.perf_counter() - t0
        if self.world.device.type == "cuda":
            metrics["memory/peak_gb"] = torch.cuda.max_memory_allocated(self.world.device) / 2**30
            metrics["memory/peak_reserved_gb"] = torch.cuda.max_memory_reserved(self.world.device) / 2**30
        self.step = step
        return self._max_over_ranks(metrics)

    def _control_permutation(self, step: int, num_rows: int) -> np.ndarray:
        """algorithm.shuffle_advantages' permutation of step `step`'s trained rows (the same on
        every rank: drawn from (trainer.seed, step) alone)."""
        return np.random.default_rng([self.cfg.trainer.seed, step, 11]).permutation(num_rows)

    def prepare_step_rows(self, rows: list[dict], step: int) -> None:
        """Give step `step`'s prompt rows, in place, their group ids and the step's SDE window."""
        window = self._sde_window(step)
        for i, row in enumerate(rows):
            row["uid"] = f"step{step}-prompt{i}"
            if window is not None:
                row["sampling_overrides"] = {"sde_window": window}

    def _roll_out(self, step: int) -> CollectedRollout:
        """Step `step`'s rows rolled out and scored, this rank's share, then gathered from every
        rank (a schedule decides when this runs: with trainer.async_rollout, on a thread of its own
        while the previous step trains, so it shows no progress and is never abortable)."""
        from flowrl.rollout.batch import RolloutBatch

        t0 = time.perf_counter()
        rows = self.prompts.next_rows()  # the step's prompts: every rank draws the same ones
        self.prepare_step_rows(rows, step)
        n = self.cfg.rollout.n
        first_prompt, my_rows = self.world.share(rows)  # whole groups: a group never spans ranks
        batch = RolloutBatch.from_rows(my_rows).repeat(n)
        first_row = self.agent_loop.rows_generated
        self.rollout_backend.reset_stats()
        progress = NO_PROGRESS if self.rollouts.is_async else self._progress

        # each sample scored as soon as it is done (generate_sequences returns after every
        # on_sample_done call has returned, so every row has been submitted); each row gets the
        # seed of its index among all ranks' rows
        def submit(row: int, output) -> None:
            self.scorer.submit(row, output.image, output.prompt, _row_metadata(batch, row))
            progress.advance()

        progress.phase("rollout", len(batch))
        stop_check = self._stop_check()  # a stop signal drops the rollout (fit() rewinds the step)
        with self.rollout_weights():
            rollout = self.agent_loop.generate_sequences(
                batch, on_sample_done=submit, row_offset=first_prompt * n, stop_check=stop_check
            )
        self.agent_loop.rows_generated = first_row + len(rows) * n
        t_rollout = time.perf_counter()
        stats = self.rollout_backend.stats()
        scored_early = self._score_denominators_early(step, rollout, stop_check)
        t_early = time.perf_counter() if scored_early else t_rollout
        rewards, components = self.scorer.results_with_components(len(rollout), stop_check=stop_check)
        t_reward = time.perf_counter()
        counters = {} if stats is None else {name: stats.get(name, 0) for name in _ENGINE_COUNTERS}
        everyone = gather_step_rows(self.world, rollout, rewards, components, counters)
        return CollectedRollout(rollout, everyone, t_rollout - t0, t_reward - t_early, t_early - t_rollout)

    @contextlib.contextmanager
    def rollout_weights(self):
        """The weights a training rollout runs with: the transformer's whole weights when sharded
        (flowrl.distributed.parallel), with rollout.merge_lora the adapter merged into them, rounded
        with a seed from (rollout.seed, the policy version) that every rank shares
        (flowrl.accel.lora_merge); the merge's seconds, the device's included, in `lora_merge_s`."""
        with self.parallel.rollout_weights():
            if not self.cfg.rollout.merge_lora:
                yield
                return
            from flowrl.accel import merged_lora

            if self.cfg.rollout.seed is None:  # fresh randomness, rank 0's on every rank
                seed = self.world.broadcast(int(np.random.SeedSequence().generate_state(1)[0]))
            else:
                seed = int(np.random.SeedSequence([self.cfg.rollout.seed, self.policy_version]).generate_state(1)[0])
            t0 = self._device_idle_time()
            with merged_lora(self.adapter.transformer, seed, compiled=self.cfg.engine.compile):
                self.lora_merge_s = self._device_idle_time() - t0
                yield

    def _device_idle_time(self) -> float:
        """perf_counter() once the device has finished the work queued on it."""
        if self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        return time.perf_counter()

    def _score_denominators_early(self, step: int, rollout, stop_check) -> bool:
        """While the rewards are still being scored, the update's old-log-prob recompute as planned
        with every row trained (flowrl.trainer.early_denominators; with algorithm.old_log_prob=
        recompute, after the first update); whether it ran. The plan needs every rank's rows: a
        collective, run by every rank alike (the condition is the same on all of them)."""
        if self.rollouts.is_async or not self.updater.scores_denominators_early:
            return False
        provisional = gather_step_rows(self.world, rollout, np.zeros(len(rollout)), {}, {})

        def keep_going() -> bool:
            if stop_check is not None:
                stop_check()  # a stop signal ends the wait for rewards, this included
            return not self.scorer.is_done()

        every_row = provisional.trained(np.ones(len(provisional.owner), dtype=bool))
        self.updater.score_denominators_early(*_update_inputs(rollout), step, every_row, keep_going)
        return True

    def _staleness_metrics(self, collected: CollectedRollout) -> dict:
        """How many training steps the weights being trained are ahead of those that drew each row
        (over every rank's rows); this rank's rows also get it as their `staleness` column."""
        staleness = self.versions.staleness(collected.rows.policy_versions, self.step)
        collected.rollout.add_non_tensors({"staleness": staleness[collected.rows.mine].tolist()})
        return {"rollout/staleness_mean": float(staleness.mean()), "rollout/staleness_max": int(staleness.max())}

    def _max_over_ranks(self, metrics: dict) -> dict:
        """The `timing/*` and `memory/*` metrics of the slowest, fullest rank (a collective)."""
        names = sorted(k for k in metrics if k.startswith(("timing/", "memory/")))
        return {**metrics, **dict(zip(names, self.world.max([metrics[k] for k in names])))}

    # --- validation -------------------------------------------------------------------------------
    def validate(self) -> dict:
        """ODE samples of the validation prompts with fixed seeds (with trainer.ema, from the
        moving average of the weights); a captioned grid PNG. Each rank samples and scores its
        share of the prompts; rank 0 writes the grid of all of them."""
        from flowrl.rollout.batch import RolloutBatch

        if not self.val_rows:  # trainer.num_val_images=0
            return {}
        t0 = time.perf_counter()
        first, mine = self.world.share(self.val_rows)
        self._progress.phase("validation", len(mine))
        images, scores, prompts, targets = None, [], [], []
        # A stop signal ends the wait for the samples inside the weights' swap, whose exit restores
        # the weights. Every rank enters rollout_weights (a collective when sharded).
        with self._evaluation_weights(), self.parallel.rollout_weights():
            if mine:
                batch = RolloutBatch.from_rows([dict(row) for row in mine])
                out = self.val_agent_loop.generate_sequences(
                    batch,
                    validation=True,
                    on_sample_done=lambda row, output: self._progress.advance(),
                    row_offset=first,
                    stop_check=self._stop_check(),
                )
                images = out.batch["images"]
                prompts = [str(p) for p in out.non_tensor_batch["raw_prompt"]]
                targets = list(out.non_tensor_batch.get("ground_truth", [None] * len(out)))
        if mine:
            metadata = [_row_metadata(out, i) for i in range(len(out))]
            scored = call_abortably(self.reward.score_or_nan, images, prompts, metadata, stop_check=self._stop_check())
            scores = list(scored[0])
        shares = [share for share in self.world.gather((images, scores, prompts, targets)) if share[0] is not None]
        scores = np.concatenate([np.asarray(share[1], dtype=np.float64) for share in shares])
        if self.world.is_main:
            prompts = [p for share in shares for p in share[2]]
            targets = [t for share in shares for t in share[3]]
            grid = save_image_grid(
                torch.cat([share[0] for share in shares]),
                grid_captions(prompts, scores, targets if any(t is not None for t in targets) else None),
                self.output_dir / "val" / f"step_{self.step:06d}.png",
            )
            if self.cfg.logging.log_images:
                self.logger.log_image(self.step, "val/images", grid)
        return self._max_over_ranks(
            {
                "val/reward_mean": float(np.nanmean(scores)),
                "val/reward_std": float(np.nanstd(scores)),
                "timing/val_s": time.perf_counter() - t0,
            }
        )

    # --- checkpoints ------------------------------------------------------------------------------
    def save(self) -> Path:
        state = {
            "policy_version": self.policy_version,
            **self.data_state(saved=True),
            "num_optimizer_steps": self.updater.num_optimizer_steps,
        }
        return checkpoint.save_checkpoint(
            self.output_dir,
            self.step,
            self.adapter,
            self.updater.optimizer,
            self.param_names,
            state,
            self.config_dict,
            ema=self.ema,
            parallel=self.parallel,
        )

    def data_state(self, saved: bool = False) -> dict:
        """The data position: the prompt sampler's and the rollout rows' count. saved=True: the one
        a checkpoint keeps, from before an early rollout (trainer.async_rollout) drew its rows."""
        if saved and self.rollouts.saved_data_state() is not None:
            return self.rollouts.saved_data_state()
        return {"data": self.prompts.state_dict(), "rows_generated": self.agent_loop.rows_generated}

    def has_step(self, step: int) -> bool:
        """Whether fit() trains step `step` (the data position as it is now)."""
        epochs = self.cfg.trainer.epochs
        return step <= self.cfg.trainer.total_steps and (epochs is None or self.prompts.epochs_done < epochs)

    def _restore(self, path: Path) -> None:
        """Continue from the checkpoint `plan_run` verified; this config's optimizer
        hyper-parameters replace the saved ones (resume.RESUME_RULES lets them change)."""
        optimizer = self.updater.optimizer
        restored = checkpoint.load_checkpoint(
            path,
            self.adapter.transformer,
            optimizer,
            self.param_names,
            verify=False,
            ema=self.ema,
            parallel=self.parallel,
        )
        tcfg = self.cfg.trainer
        for group in optimizer.param_groups:
            group.update(lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay)
        if self.ema is not None and not restored["ema_restored"]:
            self.ema.reset()  # from the restored weights
            self._print(f"{path} holds no EMA weights: trainer.ema starts from the checkpoint's weights")
        state = restored["trainer"]
        self.step = restored["step"]
        self.prompts.load_state_dict(state["data"])
        self.agent_loop.rows_generated = state["rows_generated"]
        self.updater.num_optimizer_steps = state["num_optimizer_steps"]
        self.policy_version = state["policy_version"]
        self.engine.set_policy_version(self.policy_version)
        self._print(f"resumed from {path} at step {self.step}")

    def save_final(self) -> Path:
        """`<output_dir>/final/`: the trained model as a pipeline folder the family's diffusers
        pipeline loads with `from_pretrained` (plus `lora/` for LoRA runs; flowrl.run.export);
        with trainer.ema, the moving average's weights under `final/ema/` (a diffusers LoRA folder,
        or the transformer). Returns the pipeline folder. Every rank calls it (sharded weights are
        gathered); rank 0 writes."""
        final = self.output_dir / "final"
        state = self.parallel.gathered_state_dict(self.adapter.transformer)
        if self.world.is_main:
            export_pipeline(self.adapter, final, self.step, self.config_dict, transformer_state=state)
        self.world.barrier()
        if self.ema is not None:
            with self.ema.applied():
                self._save_weights(self.output_dir / "final" / "ema")
        return final

    def _save_weights(self, folder: Path) -> Path:
        """The trained weights alone: a diffusers LoRA folder, or the transformer (gathered from
        every rank when sharded), written by rank 0."""
        transformer = self.adapter.transformer
        lora = has_lora(transformer)
        state = None if lora else self.parallel.gathered_state_dict(transformer)
        if self.world.is_main:  # LoRA weights are the same on every rank
            if lora:
                save_lora_for_diffusers(self.adapter, folder / "lora")
            else:
                save_transformer(transformer, folder / "transformer", state)
        self.world.barrier()
        return folder / ("lora" if lora else "transformer")

    def _evaluation_weights(self):
        """The weights validation samples with: the moving average with trainer.ema (put back
        after), else the trained weights as they are."""
        return self.ema.applied() if self.ema is not None else contextlib.nullcontext()

    # --- the loop ---------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train until trainer.total_steps (or trainer.epochs) and return a summary.

        SIGINT / SIGTERM stop the run cleanly (flowrl.run.interrupts): a step whose update has
        not begun is dropped and rewound, one whose update has begun finishes; the last completed
        step is saved when no checkpoint holds it yet; the engine and reward threads are joined;
        then TrainingInterrupted says which checkpoint a resume starts from.
        """
        tcfg = self.cfg.trainer
        if self.plan.finished:
            self._close()
            self._print(self.plan.finished)
            return {"steps": self.step, "steps_trained": 0, "nothing_to_do": self.plan.finished}
        start_step = self.step
        self._progress = StepProgress(
            tcfg.total_steps,
            self.step,
            disable=not (self.cfg.logging.progress_bar and self.world.is_main),
            is_compiling=self.cfg.engine.compile,
        )
        self._signals = StopSignals()
        # Counts the transformer forwards of the update phase (the bar's "update N fwd").
        counter = self.adapter.transformer.register_forward_pre_hook(lambda *_: self._count_update_forward())
        zero_spread = ZeroSpreadWatch(self.reward.name, self.cfg.rollout.n, write=note)
        last_saved_step = self.step  # a resumed run's checkpoint holds this step; 0: nothing saved
        rewind: StepRewind | None = None
        interrupted: TrainingInterrupted | None = None
        is_clean_exit = False
        try:
            with self._signals:
                try:
                    if tcfg.val_every and self.step == 0:
                        self._log(0, self.validate())
                    while self.step < tcfg.total_steps:
                        if tcfg.epochs is not None and self.data_state(saved=True)["data"]["epoch"] >= tcfg.epochs:
                            break
                        rewind = StepRewind.capture(self.prompts, self.agent_loop)
                        metrics = self.train_step()
                        rewind = None  # the step completed: nothing to undo
                        if self.world.is_main:
                            zero_spread.observe(self.step, metrics)
                        try:
                            if tcfg.val_every and self.step % tcfg.val_every == 0:
                                metrics.update(self.validate())
                        finally:  # an aborted validation still logs the completed step
                            if self.step % tcfg.log_every == 0 or self.step == tcfg.total_steps:
                                self._log(self.step, metrics)
                        if tcfg.save_every and self.step % tcfg.save_every == 0:
                            self.save()
                            last_saved_step = self.step
                        self._progress.step_done(metrics)
                        self._check_stop()
                    self.rollouts.finish()  # the last update goes live on rollout servers
                except PhaseAborted:
                    if rewind is not None:
                        rewind.restore()
                if self._signals.requested is not None:
                    interrupted = self._stop_after_signal(last_saved_step)
            is_clean_exit = interrupted is None
        finally:
            counter.remove()
            self._progress.close()
            if not is_clean_exit:  # interrupted or failed: no engine thread may outlive the run
                self.engine.shutdown()
            self._close(drop_pending=not is_clean_exit)
            self._progress, self._signals = NO_PROGRESS, None
        if zero_spread.summary():
            note(zero_spread.summary())
        if interrupted is not None:
            if interrupted.checkpoint is None and self.world.is_main:
                # No step of this run was kept: remove what it wrote (step-0 validation, logs), so the
                # folder is as plan_run found it and the same command starts over.
                resume.delete_run_files(self.output_dir, resume.run_files(self.output_dir), "no step completed")
            raise interrupted
        return {**self.summary(), "steps_trained": self.step - start_step}

    def _count_update_forward(self) -> None:
        if self._progress.current_phase == "update":
            self._progress.advance()

    def _is_abortable(self) -> bool:
        """Whether a stop signal may drop a phase at once. Over several ranks it may not: a rank
        leaving a phase alone would leave the others waiting in its collectives, so the ranks stop
        together at the end of a step (`_check_stop`). With trainer.async_rollout it may not either:
        the next step's rollout runs on its own thread during the update, and a stop at the end of
        a step saves the data position from before that rollout drew its rows
        (`data_state(saved=True)`)."""
        return self._signals is not None and not self.world.is_distributed and not self.rollouts.is_async

    def _stop_check(self):
        """For a wait a stop signal cuts short (flowrl.waiting): raises PhaseAborted once a stop
        was requested; None where no phase is abortable."""
        return self._signals.check if self._is_abortable() else None

    def _check_stop(self) -> None:
        """The safe point after a step: stop when a signal was received (over several ranks: by any
        rank, agreed through a collective, so that every rank stops after the same step)."""
        if self.world.is_distributed:
            requested = self._signals.requested or 0
            agreed = int(self.world.max([float(requested)])[0])
            if agreed and self._signals.requested is None:
                self._signals.requested = agreed
        self._signals.check()

    def _stop_after_signal(self, last_saved_step: int) -> TrainingInterrupted:
        """Save the last completed step if no checkpoint holds it (every rank: the save is a
        collective when sharded); say where a resume starts."""
        saved_now = self.step > last_saved_step
        resume_from = self.save() if saved_now else checkpoint.latest_checkpoint(self.output_dir)
        return TrainingInterrupted(self._signals.requested, self.step, resume_from, saved_now)

    def _log(self, step: int, metrics: dict) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)

    def _close(self, drop_pending: bool = False) -> None:
        self.rollouts.close()  # a pending early rollout is left behind; closing the backend ends it
        self.rollout_backend.close()
        # After a stop, a batch still being scored (a hung remote reward) does not hold the exit.
        self.scorer.close(drop_pending=drop_pending, join_timeout_s=_STOPPED_SCORING_WAIT_S if drop_pending else None)
        if self.logger is not None:
            self.logger.close()

    def close(self) -> None:
        """Join the reward workers, close the rollout backend and the logger, and shut the engine
        down: after `fit()`, or for a trainer that never trained (its reward workers start with
        it). The trainer cannot roll out afterwards; calling it again does nothing."""
        self._close()
        self.engine.shutdown()

    def __enter__(self) -> FlowGRPOTrainer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def summary(self) -> dict:
        """The exported weights and, on rank 0, the reward summary (every rank calls it)."""
        final = self.save_final()
        if not self.world.is_main:
            return {"steps": self.step, "final_weights": str(final)}
        records = [r for r in read_metrics(self.logger.path) if r.get("reward/mean") is not None]
        means = [r["reward/mean"] for r in records]
        curve = plot_reward_curve(self.logger.path, self.output_dir / "reward_curve.png")
        return {
            "steps": self.step,
            "first5_reward_mean": float(np.mean(means[:5])) if means else float("nan"),
            "last5_reward_mean": float(np.mean(means[-5:])) if means else float("nan"),
            "reward_curve": str(curve) if curve else None,
            "final_weights": str(final),
            "metrics": str(self.logger.path),
            **({"random_weights": self.random_weights} if self.random_weights else {}),
        }
