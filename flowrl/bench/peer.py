"""The peer's training step: one FlowGRPO step written the way the reference implementations write
it (Flow-GRPO's train_sd3.py, verl-omni's actor), on the same model and settings as flowrl's step,
so that `flowrl bench train` can state flowrl's whole step as a ratio to it.

- Rollout: for each prompt, a diffusers-pipeline-style loop over its group in calls of B samples
  (B = rollout.n, fewer when engine.max_batch_rows holds fewer rows): the prompt encoded once,
  the family's transformer called eagerly on cond and uncond rows (where the adapter's guidance
  rule takes one) as the two halves of one batch (through the adapter's `velocity`, before any
  flowrl fast path is installed: diffusers' forward),
  Flow-GRPO's SDE step and its log-prob on the window steps written out below from the formula
  (FLOWGRPO.md section 1), the Euler step elsewhere, then the VAE decode of the call and its
  reward submitted to a thread pool, as Flow-GRPO scores a batch while the next one samples.
- Update: group advantages; the PPO denominator from the rollout or, with
  algorithm.old_log_prob=recompute, from a no-grad pass over every trained transition (verl-omni);
  then for each update epoch the samples shuffled and each sample's window steps shuffled
  (Flow-GRPO's per-sample time permutation, the first train_timestep_fraction of them trained),
  cut into trainer.updates_per_step mini-batches of micro-batches; for each micro-batch and each
  trained column j one forward (the rows sit at different steps) and one backward of the clipped
  loss (+ the KL to the LoRA-disabled model's mean), gradients accumulated over the mini-batch,
  then clipping, AdamW and the EMA (trainer.ema).

It shares with flowrl only what is not the loop: the adapter's modules and prompt embeddings,
the reward object, the advantage function and the EMA class, and two pieces that are cheaper than
the references' own, a favour to the peer: the LoRA layers' forward (flowrl.models.lora: the
low-rank product in the activations' dtype; peft's own copies every adapted projection's input to
float32 first) and the decode (flowrl's VAE path, on Qwen-Image 0.39 x the stock decode's
FLOPs). The caller sets up the trainable parameters (`flowrl.run.step_flops.trainable`).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from flowrl.models.base import MIXED_PRECISION_DTYPES
from flowrl.models.lora import adapter_disabled
from flowrl.rewards.async_scoring import scoring_workers
from flowrl.run.flops import synchronize
from flowrl.trainer.advantages import compute_group_advantages
from flowrl.trainer.ema import ParameterEMA

_NOT_METADATA = ("raw_prompt", "sampling_overrides", "uid")


def sde_gaussian(x, v, s, s_next, noise_level: float, sigma_1: float):
    """Flow-GRPO's "sde" step from x at sigma s to s' with velocity v (B, ...), s and s' (B,):
    the next latent's mean, its std, and std_t (the KL's scale), in float32."""
    x, v = x.float(), v.float()
    shape = (-1,) + (1,) * (x.dim() - 1)
    s, s_next = s.float().view(shape), s_next.float().view(shape)
    dt = s_next - s
    s_den = torch.where(s >= 1.0, torch.full_like(s, sigma_1), s)  # s / (1 - s) is infinite at s = 1
    std_t = noise_level * torch.sqrt(s / (1.0 - s_den))
    mean = x + v * dt + std_t**2 / (2.0 * s) * (x + (1.0 - s) * v) * dt
    return mean, std_t * torch.sqrt(-dt), std_t


def gaussian_log_prob(nxt, mean, std):
    """log N(nxt; mean, std^2) per element, reduced by a mean over the non-batch dims: (B,)."""
    log_p = -((nxt.float() - mean) ** 2) / (2.0 * std**2) - torch.log(std) - 0.5 * math.log(2.0 * math.pi)
    return log_p.mean(dim=tuple(range(1, log_p.dim())))


@dataclass
class PeerRollout:
    """One step's transitions, kept on the device as the references keep them: latents (N, W+1,
    ...), log_probs / sigmas / next_sigmas (N, W); cond / uncond: each sample's encodings."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    next_sigmas: torch.Tensor
    cond: list
    uncond: list
    uids: list[str]


def check_peer_sampling(sampling) -> None:
    """ValueError for rollout settings the peer's loop does not implement (its step is Flow-GRPO's
    sde step, Euler's ODE step outside the window, on every step of the schedule)."""
    if sampling.sde_type != "sde":
        raise ValueError(
            f"rollout.sampling.sde_type={sampling.sde_type!r}: the peer loop implements Flow-GRPO's sde step; "
            "use sde_type=sde or --peer-steps 0"
        )
    if sampling.ode_solver != "euler" or sampling.ode_tail_ratio != 1.0:
        raise ValueError(
            f"rollout.sampling.ode_solver={sampling.ode_solver!r}, ode_tail_ratio={sampling.ode_tail_ratio}: "
            "the peer loop takes every step outside the window with Euler's ODE step; use ode_solver=euler "
            "ode_tail_ratio=1.0 or --peer-steps 0"
        )


class PeerLoop:
    """The peer's training step over `adapter` with `cfg`'s settings; `params`: the trainable
    parameters (LoRA, or the whole transformer), set up by the caller."""

    def __init__(self, adapter, cfg, reward, params: list[torch.nn.Parameter]):
        sampling = cfg.rollout.sampling
        check_peer_sampling(sampling)
        self.adapter, self.cfg, self.reward, self.params = adapter, cfg, reward, params
        self.sampling = sampling
        self.rows_per_sample = adapter.rows_per_sample(sampling)
        self.batch = max(1, min(cfg.rollout.n, cfg.engine.max_batch_rows // self.rows_per_sample))
        tcfg = cfg.trainer
        self.optimizer = torch.optim.AdamW(params, lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay)
        self.autocast_dtype = MIXED_PRECISION_DTYPES[tcfg.mixed_precision]
        named = {n: p for n, p in adapter.transformer.named_parameters() if p.requires_grad}
        self.ema = (
            ParameterEMA(named, tcfg.ema.decay, tcfg.ema.update_every, tcfg.ema.moves_per_update)
            if tcfg.ema.enabled
            else None
        )
        self.pool = ThreadPoolExecutor(scoring_workers(cfg.reward.num_workers))
        self.num_optimizer_steps = 0
        self.calls = 0
        self.rng = random.Random(tcfg.seed)
        self.generator = torch.Generator().manual_seed(tcfg.seed)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.adapter.device.type, dtype=self.autocast_dtype)

    def _window(self) -> tuple[int, int]:
        s = self.sampling
        if s.sde_window is not None:
            return tuple(s.sde_window)
        if s.sde_window_size is None:
            return (0, s.num_inference_steps - 1)
        lo, hi = s.sde_window_range or (0, s.num_inference_steps - 1)
        start = self.rng.randint(lo, hi - s.sde_window_size)  # one window for the whole step
        return (start, start + s.sde_window_size)

    def _guidance(self, count: int) -> tuple[torch.Tensor, dict]:
        """velocity's CFG weights (count,) and guidance-embedding arguments for the run's sampling,
        by the adapter's guidance rule (flowrl.models.base), as the engine passes them."""
        adapter, s = self.adapter, self.sampling
        cfg_scale = torch.full((count,), adapter.cfg_scale(s), device=adapter.device)
        embedded = torch.full((count,), s.guidance_scale, device=adapter.device)
        return cfg_scale, adapter.guidance_embedding_kwargs(embedded)

    # -- rollout -----------------------------------------------------------------------------------
    @torch.no_grad()
    def _pipeline_call(self, row: dict, count: int, window: tuple[int, int]):
        """`count` samples of one prompt, as a pipeline call with num_images_per_prompt=count."""
        adapter, s = self.adapter, self.sampling
        device, h, w = adapter.device, s.height, s.width
        cond = adapter.encode_prompts([row["raw_prompt"]]) * count
        negative = row.get("negative_prompt") or s.negative_prompt or ""
        uncond = adapter.encode_prompts([negative]) * count if self.rows_per_sample == 2 else [None] * count
        generator = torch.Generator(device).manual_seed(self.cfg.trainer.seed + self.calls)
        self.calls += 1
        shape = adapter.latent_shape(h, w, **adapter.frame_kwargs(s))  # a video family's frames too
        latents = torch.randn((count, *shape), generator=generator, device=device)
        schedule = adapter.sigmas(s.num_inference_steps, h, w)
        sigma_1 = float(schedule[1])
        sigmas = schedule.to(device)
        cfg_scale, guidance = self._guidance(count)
        kept, log_probs = [], []
        for i in range(s.num_inference_steps):
            sigma, sigma_next = sigmas[i].expand(count), sigmas[i + 1].expand(count)
            with self._autocast():
                v = adapter.velocity(latents, sigma, cond, uncond, cfg_scale, h, w, **guidance)
            if window[0] <= i < window[1]:
                if i == window[0]:
                    kept.append(latents)
                mean, std, _ = sde_gaussian(latents, v, sigma, sigma_next, s.noise_level, sigma_1)
                noise = torch.randn(latents.shape, generator=generator, device=device)
                latents = mean + std * noise
                log_probs.append(gaussian_log_prob(latents, mean, std))
                kept.append(latents)
            else:
                latents = latents.float() + v.float() * (sigmas[i + 1] - sigmas[i])
        # The run's decode chunk (engine.decode_chunk_size), which bounds the VAE's memory.
        images = torch.cat([adapter.decode(chunk, h, w) for chunk in latents.split(self.cfg.engine.decode_chunk_size)])
        steps = torch.arange(window[0], window[1], device=device).expand(count, -1)
        return torch.stack(kept, 1), torch.stack(log_probs, 1), sigmas[steps], sigmas[steps + 1], cond, uncond, images

    def rollout(self, rows: list[dict], samples_per_prompt: int) -> tuple[PeerRollout, list]:
        """Every prompt's group, call by call; returns the transitions and the reward futures."""
        window = self._window()
        parts, futures = [], []
        for index, row in enumerate(rows):
            done = 0
            while done < samples_per_prompt:
                count = min(self.batch, samples_per_prompt - done)
                *tensors, cond, uncond, images = self._pipeline_call(row, count, window)
                meta = {k: v for k, v in row.items() if k not in _NOT_METADATA}
                futures.append(
                    self.pool.submit(
                        self.reward.score_or_nan, images.cpu().numpy(), [row["raw_prompt"]] * count, [meta] * count
                    )
                )
                parts.append((*tensors, cond, uncond, [f"prompt{index}"] * count))
                done += count
        latents, log_probs, sigmas, next_sigmas = (torch.cat([p[k] for p in parts]) for k in range(4))
        flat = [[x for p in parts for x in p[k]] for k in (4, 5, 6)]
        return PeerRollout(latents, log_probs, sigmas, next_sigmas, *flat), futures

    # -- update ------------------------------------------------------------------------------------
    def score(self, rollout: PeerRollout, rows: torch.Tensor, steps: torch.Tensor, reference: bool = False):
        """Log-prob, mean and std_t of the stored transitions (rows[i], steps[i]) under the current
        policy (grad as the caller's mode); reference: with the LoRA adapter disabled. rows and
        steps are host tensors."""
        adapter, s = self.adapter, self.sampling
        latents = rollout.latents[rows, steps]
        nxt = rollout.latents[rows, steps + 1]
        sigma, sigma_next = rollout.sigmas[rows, steps], rollout.next_sigmas[rows, steps]
        index = rows.tolist()
        cfg_scale, guidance = self._guidance(len(index))
        sigma_1 = float(adapter.sigmas(s.num_inference_steps, s.height, s.width)[1])
        switched = adapter_disabled(adapter.transformer) if reference else contextlib.nullcontext()
        with switched, self._autocast():
            v = adapter.velocity(
                latents,
                sigma,
                [rollout.cond[i] for i in index],
                [rollout.uncond[i] for i in index],
                cfg_scale,
                s.height,
                s.width,
                **guidance,
            )
        mean, std, std_t = sde_gaussian(latents, v, sigma, sigma_next, s.noise_level, sigma_1)
        return gaussian_log_prob(nxt, mean, std), mean, std_t

    def update(self, rollout: PeerRollout, advantages: torch.Tensor, rows_kept: np.ndarray) -> float:
        """The PPO update over the kept rows; returns the old-log-prob pass's seconds."""
        algo, tcfg = self.cfg.algorithm, self.cfg.trainer
        device = self.adapter.device
        num_rows, window = rollout.log_probs.shape
        trained = max(1, int(window * float(algo.train_timestep_fraction) + 1e-9))
        kept = torch.as_tensor(rows_kept)  # row indices stay on the host: no device read-back
        advantages = advantages.to(device)
        size = tcfg.micro_batch_size
        t0 = time.perf_counter()
        if algo.old_log_prob == "recompute":
            old = torch.empty_like(rollout.log_probs)
            with torch.no_grad():
                for start in range(0, len(kept), size):
                    rows = kept[start : start + size]
                    for j in range(window):
                        steps = torch.full_like(rows, j)
                        old[rows, j] = self.score(rollout, rows, steps)[0]
        else:
            old = rollout.log_probs
        synchronize(device)
        old_seconds = time.perf_counter() - t0
        transformer = self.adapter.transformer
        transformer.train()
        for _ in range(tcfg.update_epochs):
            order = kept[torch.randperm(len(kept), generator=self.generator)]
            times = torch.stack([torch.randperm(window, generator=self.generator) for _ in range(num_rows)])
            for mini_batch in torch.tensor_split(order, tcfg.updates_per_step):
                if not mini_batch.numel():
                    continue
                micro_batches = torch.split(mini_batch, size)
                for rows in micro_batches:
                    for j in range(trained):
                        steps = times[rows, j]
                        log_prob, mean, std_t = self.score(rollout, rows, steps)
                        ratio = torch.exp(log_prob - old[rows, steps])
                        adv = advantages[rows]
                        clipped = torch.clamp(ratio, 1.0 - algo.clip_range, 1.0 + algo.clip_range)
                        loss = torch.maximum(-adv * ratio, -adv * clipped).mean()
                        if algo.kl_beta > 0:
                            with torch.no_grad():
                                mean_ref = self.score(rollout, rows, steps, reference=True)[1]
                            kl = ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, mean.dim()))) / (
                                2.0 * std_t.flatten() ** 2
                            )
                            loss = loss + algo.kl_beta * kl.mean()
                        (loss / (len(micro_batches) * trained)).backward()
                torch.nn.utils.clip_grad_norm_(self.params, tcfg.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.num_optimizer_steps += 1
                if self.ema is not None:
                    self.ema.step(self.num_optimizer_steps)
        transformer.eval()
        return old_seconds

    # -- one step ----------------------------------------------------------------------------------
    def step(self, rows: list[dict], samples_per_prompt: int | None = None) -> dict:
        """One training step on these prompts; returns its phases' seconds (a step of fewer samples
        per prompt is the warm-up: first allocations, cuDNN's choices, AdamW's states)."""
        device = self.adapter.device
        samples = samples_per_prompt or self.cfg.rollout.n
        synchronize(device)
        t0 = time.perf_counter()
        rollout, futures = self.rollout(rows, samples)
        synchronize(device)
        t_rollout = time.perf_counter()
        rewards = np.concatenate([future.result()[0] for future in futures])
        t_reward = time.perf_counter()
        algo = self.cfg.algorithm
        adv = compute_group_advantages(
            rewards, rollout.uids, algo.std_mode, algo.std_eps, algo.adv_clip_max, algo.zero_std_threshold
        )
        keep = adv.is_valid & ~adv.is_zero_std if algo.zero_std_policy == "drop" else adv.is_valid
        old_seconds = 0.0
        t_update = time.perf_counter()
        if keep.any():
            old_seconds = self.update(rollout, torch.as_tensor(adv.values, dtype=torch.float32), np.flatnonzero(keep))
        synchronize(device)
        t_end = time.perf_counter()
        return {
            "samples": len(rewards),
            "rows_trained": int(keep.sum()),
            "rollout_s": t_rollout - t0,
            "reward_wait_s": t_reward - t_rollout,
            "old_log_prob_s": old_seconds,
            "update_s": t_end - t_update - old_seconds,
            "step_s": t_end - t0,
        }
