"""Trainer: one model trained online by one algorithm (flowrl.trainer.algorithm).

One training step is six phases, each one line of `train_step` under its own timer:

1. rollout: the step's prompt rows drawn, rolled out and each finished sample handed to the reward
   scorer (flowrl.trainer.rollout; with trainer.async_rollout the rollout already ran during the
   previous step's update, flowrl.rollout.schedule);
2. rewards: the scores collected and the rows gathered from every rank (the algorithm may start
   its old log-prob work while it waits);
3. advantages: the algorithm turns rewards into per-row weights and says which rows it trains;
4. old log-prob: what the update compares against, from the weights that start the update;
5. update: the algorithm's optimizer steps;
6. publish: the new policy version goes live. The engine's transformer IS the trained module (LoRA
   injected in place), so colocated the next rollout samples from the new weights with no copy;
   decoupled (rollout.servers / num_replicas), the weights are uploaded to the rollout servers
   (flowrl.rollout.backends). Every output records the version that produced it.

Over several ranks (`world`, flowrl.distributed; docs/distributed.md) every rank draws the same
prompts and rolls out its contiguous share of the step's groups; rewards and row settings are
all-gathered, so the advantages use the statistics of all rows exactly as one process computes
them, and the update is planned over every rank's rows. Metrics cover all rows (timings: the
slowest rank); rank 0 alone writes logs, grids and the exported weights.

The run around the steps (validation and checkpoint cadence, signals, progress, the summary) is
flowrl.run.loop's `fit`; this module holds the step, validation, and saving and restoring state.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

from flowrl.config.algorithm_rules import check_trained_steps
from flowrl.console import note
from flowrl.data.prompts import PromptSampler
from flowrl.distributed.checks import check_world
from flowrl.distributed.parallel import DataParallel
from flowrl.distributed.world import World
from flowrl.models.lora import apply_trainable
from flowrl.rollout.backends import open_rollout_backend
from flowrl.rollout.schedule import schedule_for
from flowrl.rollout.validation import validate
from flowrl.run import resume, state
from flowrl.run.checks import (
    build_engine,
    check_before_loading,
    check_expert_setting,
    prompts_per_step_remark,
    resolve_model_path,
)
from flowrl.run.flops import measure_matmul_peak
from flowrl.run.metrics import MetricsLogger, read_metrics
from flowrl.run.progress import NO_PROGRESS
from flowrl.run.step_flops import StepPerf, UnitFlops, count_unit_flops
from flowrl.run.timing import PhaseTimer
from flowrl.trainer.algorithm import AlgorithmSetup, build_algorithm
from flowrl.trainer.ema import ParameterEMA
from flowrl.trainer.rollout import StepSamples
from flowrl.waiting import wait_for_calls_left_behind

# How long a stopped run waits for reward batches already being scored before it leaves them.
_STOPPED_SCORING_WAIT_S = 10.0


class Trainer:
    """Online RL training of one model (module docstring).

    engine / reward: pass prebuilt ones (tests); by default both are built from `cfg`.
    plan: how the run starts (`flowrl.run.resume.plan_run`); by default planned here (on rank 0),
    before the model loads. world: this process among the run's ranks (None: one process).
    """

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
            self.plan.start(cfg.trainer.output_dir, self.config_dict)
        self.world.barrier()  # no rank reads the folder before rank 0 has cleaned it
        remark = prompts_per_step_remark(cfg.trainer, cfg.data, len(prepared.train_rows))
        if remark and self.world.is_main and not self.plan.finished:
            note(remark)
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
        params, units = self._make_trainable(prepared.train_rows[0]["raw_prompt"])
        named = {n: p for n, p in self.adapter.transformer.named_parameters() if p.requires_grad}
        self.param_names = list(named)
        self.ema = (
            ParameterEMA(named, tcfg.ema.decay, tcfg.ema.update_every, tcfg.ema.moves_per_update)
            if tcfg.ema.enabled
            else None
        )
        self.algorithm = build_algorithm(AlgorithmSetup(self.adapter, params, cfg, self.parallel, self.ema))
        # Each phase's FLOPs, throughput and MFU in every step's metrics (perf/*).
        self.perf = StepPerf(units, self._matmul_peak(), self.algorithm.phase_flops)
        # Rollouts use the trainer's mixed precision, so their log-probs are the trainer's.
        self.engine.set_mixed_precision(self.algorithm.autocast_dtype)
        self.rollout_backend.bind(self.engine, self.algorithm.published_weights)
        self.agent_loop = AgentLoop(self.rollout_backend.replicas, cfg.rollout)
        # Validation samples in this process, with the trainer's weights (or their EMA).
        decoupled = self.rollout_backend.is_decoupled
        self.val_agent_loop = AgentLoop(self.engine, cfg.rollout) if decoupled else self.agent_loop
        self.prompts = PromptSampler(prepared.train_rows, tcfg.prompts_per_step, cfg.data.shuffle, tcfg.seed)
        self.step = 0
        self.policy_version = 0
        if self.plan.checkpoint is not None:
            state.restore(self, self.plan.checkpoint, say=self._print)
        self.logger = None  # rank 0 alone writes metrics
        if self.world.is_main:
            log = cfg.logging
            self.logger = MetricsLogger(
                self.output_dir, log.tensorboard, log.wandb, log.wandb_project, self.config_dict, resume_step=self.step
            )
        # Last: its worker threads run until close(), so a failure above leaves none behind.
        workers = scoring_workers(cfg.reward.num_workers, self.world.local_size)
        self.scorer = AsyncRewardScorer(
            self.reward, workers, group_size=cfg.rollout.n
        )  # n: a group-wise reward's groups
        self.samples = StepSamples(
            self.prompts,
            self.agent_loop,
            self.rollout_backend,
            self.scorer,
            self.world,
            cfg.rollout,
            self.algorithm,
            self.rollout_weights,
        )
        self.rollouts = schedule_for(  # synchronous, or one step ahead (trainer.async_rollout)
            tcfg.async_rollout, self.rollout_backend, self.samples.roll_out, self.has_step, self.data_state
        )
        self.samples.is_async = self.rollouts.is_async
        self.rollout_backend.publish(self.policy_version)  # rollout servers start from these weights
        self.progress = NO_PROGRESS  # the run's bar and stop signals, set by flowrl.run.loop.fit
        self.signals = None
        self._has_updated = False  # the process's first update settles gradient checkpointing
        # Counts the transformer forwards of the update phase (the bar's "update N fwd").
        self.adapter.transformer.register_forward_pre_hook(lambda *_: self._count_update_forward())

    def _make_trainable(self, prompt: str) -> tuple[list[torch.nn.Parameter], UnitFlops]:
        """Inject the LoRA (from trainer.seed: runs repeat exactly) or train the whole transformer,
        count the FLOPs of each kind of call on that eager, unsharded model (flowrl.run.step_flops),
        checkpoint, shard and compile as configured; returns the trainable parameters and the
        FLOP units."""
        tcfg, transformer = self.cfg.trainer, self.adapter.transformer
        self._check_trained_steps()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(tcfg.seed)
            params = apply_trainable(transformer, tcfg.lora)
        with torch.random.fork_rng(devices=[self.world.device] if self.world.device.type == "cuda" else []):
            units = count_unit_flops(self.adapter, self.cfg, prompt)
        if tcfg.gradient_checkpointing is not False:  # "auto" too: the update turns it off where memory allows
            transformer.enable_gradient_checkpointing()
        # Over ranks: replicated LoRA, or the full transformer sharded in place (new parameter objects).
        self.parallel = DataParallel.wrap(transformer, self.world, full_fine_tuning=not tcfg.lora.enabled)
        if self.parallel.is_sharded:
            params = [p for p in transformer.parameters() if p.requires_grad]
        if self.cfg.engine.compile:
            # After LoRA injection, so the compiled blocks trace the modules that are trained; the
            # engine and the trainer share them (compilation is in place).
            from flowrl.accel import compile_adapter

            self.engine.compiled_modules = compile_adapter(self.adapter)
            # torch.compile is lazy: say where the first steps' time goes (docs/config.md, engine.compile).
            self._print(
                f"engine.compile: {len(self.engine.compiled_modules)} modules compile on first use; the first "
                "rollout, validation and update take longer (minutes on a GPU)"
            )
        return params, units

    def _check_trained_steps(self) -> None:
        """Of a two-expert model (Wan2.2-A14B) the trainer trains model.trained_expert, the adapter's
        `transformer`; the rollouts' trained steps must be ones it predicts (before any rollout)."""
        check_expert_setting(getattr(self.adapter, "transformer_2", None) is not None, self.cfg.model)
        s = self.cfg.rollout.sampling
        sigmas = self.adapter.sigmas(s.num_inference_steps, s.height, s.width)[:-1]
        check_trained_steps(self.cfg, self.adapter.is_trained_sigma(sigmas).nonzero().flatten().tolist())

    def _matmul_peak(self) -> float | None:
        """The device's sustained matmul FLOP/s in the model's dtype, measured once (a GPU only:
        on a CPU no MFU is reported, only the achieved rate)."""
        if self.world.device.type != "cuda":
            return None
        peak = measure_matmul_peak(self.world.device, self.adapter.dtype, sustain_seconds=1.0)["sustained_flops"]
        self._print(f"matmul peak {peak / 1e12:.0f} TFLOP/s ({self.adapter.dtype}): perf/*_mfu are against it")
        return peak

    def _print(self, line: str) -> None:
        if self.world.is_main:
            print(line, flush=True)

    # --- one step ---------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """Run training step self.step + 1; returns its metrics (the same on every rank)."""
        step, timer = self.step + 1, PhaseTimer(self.world)
        self.samples.progress = NO_PROGRESS if self.rollouts.is_async else self.progress
        self.samples.stop_check = self._stop_check()  # a stop signal drops the rollout (fit rewinds the step)
        with timer.phase("rollout_wait"):  # 1. the step's samples (drawn now, or during the last update)
            sampled = self.rollouts.collect(step)
        with timer.phase("reward_wait"):  # 2. their rewards, over every rank's rows
            scored = self.samples.rewards(sampled, step)
        with timer.phase("advantages"):  # 3. rewards -> per-row weights, rows trained
            weights = self.algorithm.advantages(scored.rows, step)
        metrics = {**scored.rows.metrics(self.policy_version), **weights.metrics}
        self.progress.phase("update")
        trains, first_update = bool(weights.keep.any()), not self._has_updated
        with timer.phase("old_log_prob"):  # 4. what the update compares against
            batch = self.algorithm.prepare(sampled.batch, scored.rows, weights, step) if trains else None
        with timer.phase("update"):  # 5. the optimizer steps
            metrics.update(self.algorithm.update(batch) if trains else {})
        optimizer_steps = self.algorithm.num_optimizer_steps - self.policy_version
        metrics.update(scored.rows.staleness(self.policy_version, optimizer_steps))  # in optimizer steps
        with timer.phase("weight_sync"):  # 6. the new version goes live (async: once the early rollout returned)
            self.policy_version = self.algorithm.num_optimizer_steps
            self.rollouts.after_update(self.policy_version)
        self.step = step
        self._has_updated |= trains
        if trains and first_update and self.world.is_main:
            self._note_first_update()
        metrics.update(self._step_timings(timer, sampled, scored))
        metrics.update(self.perf.metrics(metrics, samples=self.cfg.trainer.prompts_per_step * self.cfg.rollout.n))
        if self.random_weights:
            metrics["model/random_weights"] = 1.0
        return self._max_over_ranks(metrics)

    def _step_timings(self, timer: PhaseTimer, sampled, scored) -> dict:
        """The step's phases in seconds (timing/*) and the device's peak memory (memory/*)."""
        metrics = timer.metrics()
        metrics["timing/rollout_s"] = sampled.seconds  # where it ran (with async rollouts, during the last update)
        if self.cfg.rollout.merge_lora:
            metrics["timing/lora_merge_s"] = self.algorithm.lora_merge_s  # part of timing/rollout_s
        metrics["timing/reward_wait_s"] = scored.reward_wait_s
        if scored.early_s:
            # The recompute scored while the rewards were computed is the old log-prob's time too.
            metrics["timing/old_log_prob_early_s"] = scored.early_s
            metrics["timing/old_log_prob_s"] += scored.early_s
        if self.world.device.type == "cuda":
            metrics["memory/peak_gb"] = torch.cuda.max_memory_allocated(self.world.device) / 2**30
            metrics["memory/peak_reserved_gb"] = torch.cuda.max_memory_reserved(self.world.device) / 2**30
        return metrics

    def _note_first_update(self) -> None:
        """Say what trainer.gradient_checkpointing=auto chose at the process's first update."""
        choice = self.algorithm.checkpointing
        if choice is not None and choice.measured:
            note(choice.describe())

    @contextlib.contextmanager
    def rollout_weights(self):
        """The weights a training rollout runs with: the transformer's whole weights when sharded
        (flowrl.distributed.parallel), and whatever the algorithm rolls out with (e.g. the merged
        LoRA of rollout.merge_lora)."""
        # The algorithm's weights first: an average (DiffusionNFT's old policy) goes into this rank's
        # shards before they are gathered.
        with self.algorithm.rollout_weights(self.policy_version), self.parallel.rollout_weights():
            yield

    def _max_over_ranks(self, metrics: dict) -> dict:
        """The `timing/*` and `memory/*` metrics of the slowest, fullest rank (a collective)."""
        names = sorted(k for k in metrics if k.startswith(("timing/", "memory/")))
        return {**metrics, **dict(zip(names, self.world.max([metrics[k] for k in names])))}

    # --- validation and state: flowrl.rollout.validation, flowrl.run.state -------------------------
    def validate(self) -> dict:
        """ODE samples of the validation prompts with fixed seeds, scored and drawn (with trainer.ema,
        from the moving average of the weights); every rank samples its share."""
        if not self.val_rows:  # trainer.num_val_images=0
            return {}
        metrics, grid, images = validate(
            self.val_agent_loop,
            self.val_rows,
            self.reward,
            self.world,
            self.validation_weights(),
            self.output_dir / "val" / f"step_{self.step:06d}.png",
            self.progress,
            self._stop_check(),
        )
        if grid is not None and self.cfg.logging.log_images:
            self.logger.log_image(self.step, "val/images", grid)
        metrics.update(self.perf.validation_metrics(images, metrics["timing/val_s"]))
        return self._max_over_ranks(metrics)

    @contextlib.contextmanager
    def validation_weights(self):
        """The moving average of the weights with trainer.ema (put back after), else the trained
        weights; gathered when sharded (every rank enters: a collective)."""
        with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
            with self.parallel.rollout_weights():
                yield

    def save(self) -> Path:
        return state.save(self)

    def save_final(self) -> Path:
        return state.save_final(self)

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

    # --- what the run loop (flowrl.run.loop) calls -------------------------------------------------
    def fit(self) -> dict:
        """Train until trainer.total_steps (or trainer.epochs); flowrl.run.loop.fit."""
        from flowrl.run.loop import fit

        return fit(self)

    def log(self, step: int, metrics: dict) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)

    def _count_update_forward(self) -> None:
        if self.progress.current_phase == "update":
            self.progress.advance()

    def is_abortable(self) -> bool:
        """Whether a stop signal may drop a phase at once. Over several ranks it may not: a rank
        leaving a phase alone would leave the others waiting in its collectives, so the ranks stop
        together at the end of a step. With trainer.async_rollout it may not either: the next
        step's rollout runs on its own thread during the update, and a stop at the end of a step
        saves the data position from before that rollout drew its rows (`data_state(saved=True)`)."""
        return self.signals is not None and not self.world.is_distributed and not self.rollouts.is_async

    def _stop_check(self):
        """For a wait a stop signal cuts short (flowrl.waiting): raises PhaseAborted once a stop
        was requested; None where no phase is abortable."""
        return self.signals.check if self.is_abortable() else None

    def close(self, drop_pending: bool = False, shutdown_engine: bool = True) -> None:
        """Shut the engine down (first: no engine thread outlives a stopped run), close the rollout
        schedule and backend (a pending early rollout is left behind), join the reward workers
        (with drop_pending, after a stop: the reward cancelled, and at most a short wait for a batch
        still being scored and for validation's scoring) and close the logger. Calling it again
        does nothing."""
        if shutdown_engine:
            self.engine.shutdown()
        self.rollouts.close()
        self.rollout_backend.close()
        if drop_pending and hasattr(self.reward, "cancel"):
            # Scoring threads end at their next row (OCR: well under a second), and are waited for:
            # a thread still inside onnxruntime when the interpreter exits aborts the process.
            self.reward.cancel()
        self.scorer.close(drop_pending=drop_pending, join_timeout_s=_STOPPED_SCORING_WAIT_S if drop_pending else None)
        if drop_pending and wait_for_calls_left_behind(_STOPPED_SCORING_WAIT_S):  # validation's scoring
            note(
                f"flowrl: validation still scoring {_STOPPED_SCORING_WAIT_S:g} s after the stop: left to end with the process"
            )
        if self.logger is not None:
            self.logger.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def summary(self) -> dict:
        """The exported weights and, on rank 0, the reward summary (every rank calls it)."""
        from flowrl.run.metrics import plot_reward_curve

        final = self.save_final()
        if not self.world.is_main:
            return {"steps": self.step, "final_weights": str(final)}
        logged = read_metrics(self.logger.path)
        means = [r["reward/mean"] for r in logged if r.get("reward/mean") is not None]
        curve = plot_reward_curve(self.logger.path, self.output_dir / "reward_curve.png")
        validated = [r for r in logged if r.get("val/reward_mean") is not None]
        return {
            "steps": self.step,
            "first5_reward_mean": float(np.mean(means[:5])) if means else float("nan"),
            "last5_reward_mean": float(np.mean(means[-5:])) if means else float("nan"),
            "reward_curve": str(curve) if curve else None,
            "final_weights": str(final),
            "metrics": str(self.logger.path),
            # The first and the last validation (total and each component), e.g. held-out accuracy
            # before and after training.
            "validation": [
                {"step": r["step"], **{k: v for k, v in r.items() if k.startswith("val/reward") and "std" not in k}}
                for r in (validated[:1] + validated[-1:] if len(validated) > 1 else validated)
            ],
            **({"random_weights": self.random_weights} if self.random_weights else {}),
        }
