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
   output records the version that produced it. Decoupled (rollout.servers / num_replicas), the
   rollouts run on rollout servers and publishing uploads the weights to them
   (flowrl.trainer.rollout_backend); with trainer.async_rollout, step k + 1's rollout runs while
   step k trains (flowrl.trainer.rollout_schedule);
6. metrics to metrics.jsonl/tensorboard; validation (ODE, fixed seeds; with trainer.ema, sampled
   with the moving average of the weights) and checkpoints every k steps.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch

from flowrl import sampler
from flowrl.engine.output import TransitionSpec
from flowrl.trainer import checkpoint, resume
from flowrl.trainer.advantages import compute_group_advantages
from flowrl.trainer.build import check_before_loading, resolve_model_path
from flowrl.trainer.data import PromptSampler
from flowrl.trainer.ema import ParameterEMA
from flowrl.trainer.logging import MetricsLogger, plot_reward_curve, read_metrics, save_image_grid
from flowrl.trainer.lora import apply_trainable, has_lora, save_lora_for_diffusers
from flowrl.trainer.rollout_backend import open_rollout_backend
from flowrl.trainer.rollout_schedule import CollectedRollout, VersionHistory, schedule_for
from flowrl.trainer.update import PolicyUpdater

_NON_METADATA = ("sampling_overrides", "raw_prompt")


def _row_metadata(batch, row: int) -> dict:
    return {k: v[row] for k, v in batch.non_tensor_batch.items() if k not in _NON_METADATA}


class FlowGRPOTrainer:
    """Colocated FlowGRPO training of one model (see the module docstring).

    engine / reward: pass prebuilt ones (tests); by default both are built from `cfg`.
    plan: how the run starts (`flowrl.trainer.resume.plan_run`); by default planned here, before
    the model loads.
    """

    def __init__(self, cfg, engine=None, reward=None, plan: resume.RunPlan | None = None):
        from flowrl.config import config_to_dict
        from flowrl.rewards import AsyncRewardScorer
        from flowrl.rollout.agent_loop import AgentLoop

        self.cfg = cfg
        prepared = check_before_loading(cfg, reward)  # every cheap check before the model loads
        self.config_dict = config_to_dict(cfg)
        # Which checkpoint (verified), or a fresh start in a folder of its own: decided before loading.
        self.plan = plan or resume.plan_run(cfg, self.config_dict)
        self.plan.start(cfg.trainer.output_dir)
        self.reward = prepared.reward
        self.val_rows = prepared.val_rows
        tcfg = cfg.trainer
        self.output_dir = Path(tcfg.output_dir)
        # Where training rollouts run; started replicas load their model while this one loads.
        self.rollout_backend = open_rollout_backend(cfg, self.output_dir)
        if engine is None:
            from flowrl.engine.engine import DiffusionEngine

            engine = DiffusionEngine.from_pretrained(
                resolve_model_path(cfg.model),
                device=cfg.model.resolve_device(),
                dtype=cfg.model.torch_dtype,
                max_batch_rows=cfg.engine.max_batch_rows,
                decode_chunk_size=cfg.engine.decode_chunk_size,
                **cfg.model.adapter_options(),
                prompt_cache_mb=cfg.engine.prompt_cache_mb,
                prompt_cache_device=cfg.engine.prompt_cache_device,
            )
        self.engine = engine
        self.adapter = engine.adapter
        transformer = self.adapter.transformer
        with torch.random.fork_rng(devices=[]):  # LoRA init from trainer.seed: runs repeat exactly
            torch.manual_seed(tcfg.seed)
            params = apply_trainable(transformer, tcfg.lora)
        if tcfg.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        if cfg.engine.compile:
            # After LoRA injection, so the compiled blocks trace the modules that are trained; the
            # engine and the trainer share them (compilation is in place).
            from flowrl.accel import compile_adapter

            self.engine.compiled_modules = compile_adapter(self.adapter, rounding=cfg.engine.compile_rounding)
            # torch.compile is lazy: say where the first steps' time goes (docs/config.md, engine.compile).
            print(
                f"engine.compile: {len(self.engine.compiled_modules)} modules compile on first use; the first "
                "rollout, validation and update take longer (on a GPU, Qwen-Image's rollout graphs take about "
                "half a minute, SD3.5-medium's VAE decoder a few minutes)",
                flush=True,
            )
        named = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
        self.param_names = list(named)
        ema = tcfg.ema
        self.ema = ParameterEMA(named, ema.decay, ema.update_every) if ema.enabled else None
        self.updater = PolicyUpdater(self.adapter, params, cfg.algorithm, tcfg, ema=self.ema)
        # Rollouts use the trainer's mixed precision, so their log-probs are the trainer's.
        self.engine.set_mixed_precision(self.updater.autocast_dtype)
        self.rollout_backend.bind(engine)
        self.agent_loop = AgentLoop(self.rollout_backend.replicas, cfg.rollout)
        # Validation samples in this process, with the trainer's weights (or their EMA).
        self.val_agent_loop = AgentLoop(engine, cfg.rollout) if self.rollout_backend.is_decoupled else self.agent_loop
        self.scorer = AsyncRewardScorer(self.reward, cfg.reward.num_workers)
        self.prompts = PromptSampler(prepared.train_rows, tcfg.prompts_per_step, cfg.data.shuffle, tcfg.seed)
        self.step = 0
        self.policy_version = 0
        if self.plan.checkpoint is not None:
            self._restore(self.plan.checkpoint)
        self.versions = VersionHistory(self.step, self.policy_version)
        self.rollouts = schedule_for(self)  # synchronous, or one step ahead (trainer.async_rollout)
        self.rollout_backend.publish(self.policy_version)  # rollout servers start from these weights
        log = cfg.logging
        self.logger = MetricsLogger(
            self.output_dir, log.tensorboard, log.wandb, log.wandb_project, self.config_dict, resume_step=self.step
        )

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
        """Run training step self.step + 1; returns its metrics."""
        t0 = time.perf_counter()
        step = self.step + 1
        # 1. the step's rollout and rewards (self._roll_out, now or started during the last step)
        collected = self.rollouts.collect(step)
        rollout, rewards = collected.rollout, collected.rewards
        t_rollout = time.perf_counter()

        # 2. advantages
        algo = self.cfg.algorithm
        adv = compute_group_advantages(
            rewards,
            list(rollout.non_tensor_batch["uid"]),
            algo.std_mode,
            algo.std_eps,
            algo.adv_clip_max,
            algo.zero_std_threshold,
        )
        keep = adv.is_valid.copy()
        if algo.zero_std_policy == "drop":
            keep &= ~adv.is_zero_std
        metrics = self._rollout_metrics(collected, adv, keep)

        # 3. update (the trainer's engine is idle: generate_sequences returned every sample)
        if keep.any():
            rows_kept = np.flatnonzero(keep)
            tensors = {k: v[rows_kept] for k, v in rollout.batch.items() if k != "images"}
            specs = TransitionSpec.from_columns(rollout.non_tensor_batch)
            advantages = torch.from_numpy(adv.values[rows_kept])
            metrics.update(
                self.updater.update(
                    tensors, [specs[i] for i in rows_kept], advantages, torch.ones(len(rows_kept)), step
                )
            )
            self.policy_version = self.updater.num_optimizer_steps
        self.rollouts.after_update(self.policy_version)
        self.versions.record(step, self.policy_version)
        metrics["timing/rollout_s"] = collected.rollout_s
        metrics["timing/rollout_wait_s"] = t_rollout - t0
        metrics["timing/reward_wait_s"] = collected.reward_wait_s
        metrics["timing/step_s"] = time.perf_counter() - t0
        self.step = step
        return metrics

    def _roll_out(self, step: int) -> CollectedRollout:
        """Step `step`'s rows rolled out and scored (a schedule decides when this runs)."""
        from flowrl.rollout.batch import RolloutBatch

        t0 = time.perf_counter()
        rows = self.prompts.next_rows()
        window = self._sde_window(step)
        for i, row in enumerate(rows):
            row["uid"] = f"step{step}-prompt{i}"
            if window is not None:
                row["sampling_overrides"] = {"sde_window": window}
        batch = RolloutBatch.from_rows(rows).repeat(self.cfg.rollout.n)
        self.rollout_backend.reset_stats()

        # each sample scored as soon as it is done (generate_sequences returns after every
        # on_sample_done call has returned, so every row has been submitted)
        def submit(row: int, output) -> None:
            self.scorer.submit(row, output.image, output.prompt, _row_metadata(batch, row))

        rollout = self.agent_loop.generate_sequences(batch, on_sample_done=submit)
        t_rollout = time.perf_counter()
        stats = self.rollout_backend.stats()
        rewards, components = self.scorer.results_with_components(len(rollout))
        return CollectedRollout(rollout, rewards, components, stats, t_rollout - t0, time.perf_counter() - t_rollout)

    def _rollout_metrics(self, collected: CollectedRollout, adv, keep) -> dict:
        rollout, rewards, components = collected.rollout, collected.rewards, collected.components
        finite = rewards[np.isfinite(rewards)]
        versions = np.asarray(rollout.non_tensor_batch["policy_version"], dtype=np.int64)
        # How many training steps the weights being trained are ahead of those that drew each row.
        staleness = self.versions.staleness(versions, self.step)
        rollout.add_non_tensors({"staleness": staleness.tolist()})
        metrics = {
            "reward/mean": float(finite.mean()) if finite.size else float("nan"),
            "reward/std": float(finite.std()) if finite.size else float("nan"),
            "reward/nan_ratio": float(1.0 - finite.size / max(len(rewards), 1)),
            "adv/zero_std_ratio": adv.zero_std_ratio,
            "adv/mean_group_std": adv.mean_group_std,
            "adv/abs_mean": float(np.abs(adv.values[keep]).mean()) if keep.any() else 0.0,
            "adv/num_rows_trained": int(keep.sum()),
            "rollout/policy_version": int(versions.min()),
            "rollout/policy_lag": int(self.policy_version - versions.min()),
            "rollout/staleness_mean": float(staleness.mean()),
            "rollout/staleness_max": int(staleness.max()),
        }
        for name, scores in components.items():
            if len(components) > 1:
                metrics[f"reward/{name}/mean"] = float(np.nanmean(scores))
        metrics["rollout/mean_rows_per_forward"] = collected.stats.get("mean_rows_per_forward", 0.0)
        metrics["rollout/images_per_second"] = collected.stats.get("images_per_second", 0.0)
        metrics["rollout/num_batched_groups"] = rollout.meta_info.get("num_batched_groups", 0)
        return metrics

    # --- validation -------------------------------------------------------------------------------
    def validate(self) -> dict:
        """ODE samples of the validation prompts with fixed seeds (with trainer.ema, from the
        moving average of the weights); a captioned grid PNG."""
        from flowrl.rollout.batch import RolloutBatch

        if not self.val_rows:  # trainer.num_val_images=0
            return {}
        t0 = time.perf_counter()
        batch = RolloutBatch.from_rows([dict(row) for row in self.val_rows])
        with self._evaluation_weights():
            out = self.val_agent_loop.generate_sequences(batch, validation=True)
        images = out.batch["images"]
        prompts = [str(p) for p in out.non_tensor_batch["raw_prompt"]]
        scores, _ = self.reward.score_or_nan(images, prompts, [_row_metadata(out, i) for i in range(len(out))])
        grid = save_image_grid(
            images, [f"r={s:.4g}" for s in scores], self.output_dir / "val" / f"step_{self.step:06d}.png"
        )
        if self.cfg.logging.log_images:
            self.logger.log_image(self.step, "val/images", grid)
        return {
            "val/reward_mean": float(np.nanmean(scores)),
            "val/reward_std": float(np.nanstd(scores)),
            "timing/val_s": time.perf_counter() - t0,
        }

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
            path, self.adapter.transformer, optimizer, self.param_names, verify=False, ema=self.ema
        )
        tcfg = self.cfg.trainer
        for group in optimizer.param_groups:
            group.update(lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay)
        if self.ema is not None and not restored["ema_restored"]:
            self.ema.reset()  # from the restored weights
            print(f"{path} holds no EMA weights: trainer.ema starts from the checkpoint's weights")
        state = restored["trainer"]
        self.step = restored["step"]
        self.prompts.load_state_dict(state["data"])
        self.agent_loop.rows_generated = state["rows_generated"]
        self.updater.num_optimizer_steps = state["num_optimizer_steps"]
        self.policy_version = state["policy_version"]
        self.engine.set_policy_version(self.policy_version)
        print(f"resumed from {path} at step {self.step}")

    def save_final(self) -> Path:
        """`<output_dir>/final/`: the trained model as a pipeline folder the family's diffusers
        pipeline loads with `from_pretrained` (plus `lora/` for LoRA runs; flowrl.trainer.export);
        with trainer.ema, the moving average's weights under `final/ema/` (a diffusers LoRA folder,
        or the transformer). Returns the pipeline folder."""
        from flowrl.trainer.export import export_pipeline

        final = export_pipeline(self.adapter, self.output_dir / "final", self.step, self.config_dict)
        if self.ema is not None:
            with self.ema.applied():
                self._save_weights(self.output_dir / "final" / "ema")
        return final

    def _save_weights(self, folder: Path) -> Path:
        if has_lora(self.adapter.transformer):
            return save_lora_for_diffusers(self.adapter, folder / "lora")
        self.adapter.transformer.save_pretrained(folder / "transformer")
        return folder / "transformer"

    def _evaluation_weights(self):
        """The weights validation samples with: the moving average with trainer.ema (put back
        after), else the trained weights as they are."""
        return self.ema.applied() if self.ema is not None else contextlib.nullcontext()

    # --- the loop ---------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train until trainer.total_steps (or trainer.epochs) and return a summary."""
        from tqdm.auto import tqdm

        tcfg = self.cfg.trainer
        if self.plan.finished:
            self.rollout_backend.close()
            self.scorer.close()
            self.logger.close()
            print(self.plan.finished, flush=True)
            return {"steps": self.step, "steps_trained": 0, "nothing_to_do": self.plan.finished}
        start_step = self.step
        if tcfg.val_every and self.step == 0:
            self.logger.log(0, self.validate())
        bar = tqdm(
            total=tcfg.total_steps, initial=self.step, desc="flowrl train", disable=not self.cfg.logging.progress_bar
        )
        try:
            while self.step < tcfg.total_steps:
                if tcfg.epochs is not None and self.data_state(saved=True)["data"]["epoch"] >= tcfg.epochs:
                    break
                metrics = self.train_step()
                if tcfg.val_every and self.step % tcfg.val_every == 0:
                    metrics.update(self.validate())
                if self.step % tcfg.log_every == 0 or self.step == tcfg.total_steps:
                    self.logger.log(self.step, metrics)
                if tcfg.save_every and self.step % tcfg.save_every == 0:
                    self.save()
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.4g}", clip=f"{metrics.get('actor/clipfrac', 0):.2f}")
            self.rollouts.finish()
        finally:
            bar.close()
            self.rollouts.close()
            self.rollout_backend.close()
            self.scorer.close()
            self.logger.close()
        return {**self.summary(), "steps_trained": self.step - start_step}

    def summary(self) -> dict:
        records = [r for r in read_metrics(self.logger.path) if r.get("reward/mean") is not None]
        means = [r["reward/mean"] for r in records]
        curve = plot_reward_curve(self.logger.path, self.output_dir / "reward_curve.png")
        final = self.save_final()
        return {
            "steps": self.step,
            "first5_reward_mean": float(np.mean(means[:5])) if means else float("nan"),
            "last5_reward_mean": float(np.mean(means[-5:])) if means else float("nan"),
            "reward_curve": str(curve) if curve else None,
            "final_weights": str(final),
            "metrics": str(self.logger.path),
        }
