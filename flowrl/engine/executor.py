"""Executor: owns the device work. Steps a group of samples with one transformer forward, then
decodes finished samples in bounded chunks and packages them as DiffusionOutputs.

A step packs every row (CFG rows inside the adapter: `SampleState.num_rows` per sample), calls
the shared `sampler.sde_step` once for the batch with per-row sigmas, noise levels and noise drawn
from each sample's own generator, replaces the steps of samples on a multistep ODE solver (from
the history each keeps in its SampleState), and unpacks the results back into the samples. Nothing
in `step` reads a device value back to the host, so on a GPU the loop never waits for the device
between steps. With `autocast_dtype` set (the trainer's mixed precision), the transformer runs
under the same torch.autocast as the trainer's forward, so rollout and trainer log-probs agree.

The executor knows nothing about queues or scheduling (which samples step together is
scheduler.py's choice) nor about training: it runs the device work it is handed.
"""

from __future__ import annotations

import time

import torch

from flowrl import sampler
from flowrl.engine.output import DiffusionOutput, TransitionSpec
from flowrl.engine.sample import SampleState
from flowrl.models.base import FlowModelAdapter, host_to_device, mixed_precision, rows_to_device


class Executor:
    def __init__(self, adapter: FlowModelAdapter, decode_chunk_size: int = 16):
        if decode_chunk_size < 1:
            raise ValueError(f"decode_chunk_size={decode_chunk_size} must be >= 1")
        self.adapter = adapter
        self.autocast_dtype: torch.dtype | None = None  # set through DiffusionEngine.set_mixed_precision
        self.device = adapter.device
        self.decode_chunk_size = decode_chunk_size
        if self.device.type == "cuda":
            # The VAE's convolutions see a handful of fixed shapes (one per chunk size and image
            # size); letting cuDNN time its algorithms once per shape pays from the second decode.
            torch.backends.cudnn.benchmark = True

    def _host_to_device(self, rows: list[list[float]]) -> torch.Tensor:
        """Per-row scalars (one list per quantity) as ONE (len(rows), B) float32 device tensor:
        a single pinned, non-blocking copy per step, so the host never waits for the device."""
        return host_to_device(torch.tensor(rows, dtype=torch.float32), self.device)

    def prepare(self, sample: SampleState) -> None:
        """Admission: the sample's generator, schedule and starting noise (drawn from its own
        generator; with a shared starting noise, replaced by its request's first sample's, so its
        own SDE noise is what it would be without)."""
        p = sample.params
        sample.generator = torch.Generator(device=self.device).manual_seed(sample.seed)
        sample.sigmas = self.adapter.sigmas(p.num_inference_steps, p.height, p.width).tolist()
        if p.ode_tail_ratio < 1.0:  # MixGRPO-Flash's fewer steps after the window
            sample.sigmas = sampler.compress_tail(sample.sigmas, sample.tail_start, p.ode_tail_ratio)
        frames = self.adapter.frame_kwargs(p)
        sample.latents = self.adapter.initial_noise(p.height, p.width, sample.generator, **frames)
        if sample.noise_seed is not None and sample.noise_seed != sample.seed:
            shared = torch.Generator(device=self.device).manual_seed(sample.noise_seed)
            sample.latents = self.adapter.initial_noise(p.height, p.width, shared, **frames)

    @torch.no_grad()
    def step(self, group: list[SampleState]) -> int:
        """Advance every sample of `group` by one denoising step. Returns the rows forwarded."""
        # 1. per-row inputs: latents, and the step's scalars in one host-to-device copy
        p0 = group[0].params
        latents = torch.stack([s.latents for s in group])
        in_window = [s.in_window(s.step) for s in group]
        sigma_values = [s.sigmas[s.step] for s in group]
        sigma, sigma_next, cfg_scale, guidance, noise_level, sigma_first = self._host_to_device(
            [
                sigma_values,
                [s.sigmas[s.step + 1] for s in group],
                [self.adapter.cfg_scale(s.params) for s in group],
                [s.params.guidance_scale for s in group],
                [s.params.noise_level if w else 0.0 for s, w in zip(group, in_window)],
                [s.sigmas[1] if len(s.sigmas) > 2 else s.sigmas[0] for s in group],
            ]
        ).unbind(0)
        # 2. one guided forward for every row (CFG rows inside the adapter; a guidance-distilled
        #    model also takes guidance_scale for its guidance embedding)
        with mixed_precision(self.device, self.autocast_dtype):
            velocity = self.adapter.velocity(
                latents,
                sigma,
                [s.cond for s in group],
                [s.uncond for s in group],
                cfg_scale,
                p0.height,
                p0.width,
                sigma_values=sigma_values,
                **self.adapter.guidance_embedding_kwargs(guidance),
            )
        # 3. noise from each sample's own generator, for its SDE-window steps only
        if any(in_window):
            noise = torch.stack(
                [
                    torch.randn(s.latents.shape, generator=s.generator, device=self.device, dtype=torch.float32)
                    if w
                    else torch.zeros_like(s.latents)
                    for s, w in zip(group, in_window)
                ]
            )
        else:  # ODE step for every row: no noise is drawn, so no generator advances
            noise = torch.zeros_like(latents)
        # 4. the shared sampler step, once per step type present in the group
        next_latents = torch.empty_like(latents)
        log_prob = torch.empty(len(group), dtype=torch.float32, device=self.device)
        for sde_type in {s.params.sde_type for s in group}:
            rows = [i for i, s in enumerate(group) if s.params.sde_type == sde_type]
            idx = rows_to_device(rows, self.device) if len(rows) < len(group) else None
            pick = (lambda t: t) if idx is None else (lambda t: t.index_select(0, idx))
            result = sampler.sde_step(
                pick(latents),
                pick(velocity),
                pick(sigma),
                pick(sigma_next),
                pick(noise_level),
                sde_type=sde_type,
                noise=pick(noise),
                sigma_first_step=pick(sigma_first),
            )
            if idx is None:
                next_latents, log_prob = result.next_latents, result.log_prob
            else:
                next_latents.index_copy_(0, idx, result.next_latents)
                log_prob.index_copy_(0, idx, result.log_prob)
        # 5. the multistep ODE solver's samples (ode_solver): their second-order tail steps
        if any(s.keeps_x0 for s in group):
            self._multistep(group, latents, velocity, sigma, next_latents)
        # 6. back into the samples: trajectory and log-probs of window steps, the new latents
        for i, (s, w) in enumerate(zip(group, in_window)):
            if w:
                if not s.trajectory:
                    s.trajectory.append(s.latents)
                s.trajectory.append(next_latents[i])
                if s.params.logprobs:
                    s.log_probs.append(log_prob[i])
            s.latents = next_latents[i]
            s.step += 1
        return sum(s.num_rows for s in group)

    def _multistep(self, group, latents, velocity, sigma, next_latents) -> None:
        """Replace the Euler step of the rows whose step is a multistep one (SampleState.multistep)
        with DPM-Solver++(2M)'s, and keep each solver sample's data prediction for its next step."""
        x0 = sampler.data_prediction(latents, velocity, sigma)
        rows = [i for i, s in enumerate(group) if s.multistep(s.step)]
        if rows:
            idx = rows_to_device(rows, self.device)
            coefficients = [
                sampler.dpmpp_2m_coefficients(
                    group[i].sigma_prev, group[i].sigmas[group[i].step], group[i].sigmas[group[i].step + 1]
                )
                for i in rows
            ]
            updated = sampler.multistep_update(
                latents.index_select(0, idx),
                x0.index_select(0, idx),
                torch.stack([group[i].x0_prev for i in rows]),
                self._host_to_device([list(c) for c in zip(*coefficients)]),
            )
            next_latents.index_copy_(0, idx, updated)
        for s, prediction in zip(group, x0):
            if s.keeps_x0:
                s.x0_prev, s.sigma_prev = prediction, s.sigmas[s.step]

    @torch.no_grad()
    def finish(self, samples: list[SampleState]) -> list[tuple[list[SampleState], list[DiffusionOutput] | Exception]]:
        """Decode finished samples in chunks of at most decode_chunk_size (same shape per chunk).
        Returns each chunk with its outputs, or with the error its decode raised: a failure is
        the chunk's alone, the other chunks are still decoded."""
        chunks = []
        # Samples of one prompt share its cached encoding: copy each encoding tensor to the host
        # once per call, not once per sample (SD3's T5 embeddings are 2.7 MB per prompt).
        host_copies: dict[int, torch.Tensor] = {}

        def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if id(t) not in host_copies:
                host_copies[id(t)] = t.cpu()
            return host_copies[id(t)]

        by_key: dict[tuple[int, int, int], list[SampleState]] = {}
        for s in samples:
            by_key.setdefault(s.batch_key, []).append(s)
        for (height, width, _), same in by_key.items():
            for start in range(0, len(same), self.decode_chunk_size):
                chunk = same[start : start + self.decode_chunk_size]
                try:
                    t0 = time.perf_counter()
                    images = self.adapter.decode(torch.stack([s.latents for s in chunk]), height, width).cpu()
                    decode_s = (time.perf_counter() - t0) / len(chunk)
                    outputs = [self._package(s, image, decode_s, to_host) for s, image in zip(chunk, images)]
                except Exception as exc:  # noqa: BLE001 - handed to the engine, which fails this chunk
                    chunks.append((chunk, exc))
                else:
                    chunks.append((chunk, outputs))
        return chunks

    def _package(self, s: SampleState, image: torch.Tensor, decode_s: float, to_host) -> DiffusionOutput:
        start, end = s.sde_window
        if not s.trajectory:  # empty window (a 1-step schedule): just the final latent
            s.trajectory.append(s.latents)
        now = time.perf_counter()
        log_probs = torch.stack(s.log_probs).cpu() if s.params.logprobs and s.log_probs else None
        if s.params.logprobs and log_probs is None:
            log_probs = torch.zeros(0, dtype=torch.float32)
        uncond = s.uncond
        return DiffusionOutput(
            prompt=s.prompt,
            image=image,
            all_latents=torch.stack(s.trajectory).cpu(),
            all_log_probs=log_probs,
            sigmas=torch.tensor(s.sigmas[start:end], dtype=torch.float32),
            next_sigmas=torch.tensor(s.sigmas[start + 1 : end + 1], dtype=torch.float32),
            prompt_embeds=to_host(s.cond.embeds),
            prompt_embeds_mask=to_host(s.cond.mask),
            pooled_prompt_embeds=to_host(s.cond.pooled),
            negative_prompt_embeds=None if uncond is None else to_host(uncond.embeds),
            negative_prompt_embeds_mask=None if uncond is None else to_host(uncond.mask),
            negative_pooled_prompt_embeds=None if uncond is None else to_host(uncond.pooled),
            seed=s.seed,
            policy_version=s.policy_version,
            sde_window=(start, end),
            transition_spec=TransitionSpec.of(s.params),
            timings={
                "queued_s": s.admitted_at - s.submitted_at,
                "denoise_s": now - s.admitted_at - decode_s,
                "decode_s": decode_s,
                "total_s": now - s.submitted_at,
            },
        )
