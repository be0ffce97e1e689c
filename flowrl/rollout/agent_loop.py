"""AgentLoop: dataset rows -> rollouts through one or more engines.

Rows arrive repeated (p0 x n, p1 x n, ...). Two paths produce the same samples and row layout:
- batched: each group of n consecutive rows becomes ONE `generate_batched` call (one prompt
  encoding, samples admitted together), taken only when provably safe (see `batched_path_blocker`);
- fallback: every row is its own single request, all in flight at once (the engine still batches
  them into shared forwards).
On one engine, when the rows differ in their prompts only and their seeds count up by one (the
usual training step, a validation or eval batch), all of them are queued as one `submit_many`
call instead (n samples per prompt on the batched path, one on the fallback): the engine takes
them together, so which rows share a forward, and how the forwards round, is the same on every
run (separate calls reach it one by one, and its first forward may start before the last one
arrived). The groups of a batch take that path on an engine of this process only: a remote
engine answers a call's samples in one response, and its server bounds the samples per request.
Equality of the two paths rests on seeds: row i gets seed base + global row index, and
generate_batched(seed=s) gives sample j the seed s + j, so a group's rows get the same seeds
either way. Every returned row records the settings its sample was drawn with (the fields of
flowrl.engine.output.TransitionSpec as non-tensor columns: height, width, num_inference_steps,
noise_level, sde_type, guidance_scale, true_cfg_scale), per-row `sampling_overrides` included. The loop knows
nothing about rewards or training; `on_sample_done(row, output)` lets a caller (async reward
scoring) see each sample as soon as it finishes.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import Future
from typing import Callable

import numpy as np

from flowrl.engine.output import TransitionSpec
from flowrl.rollout.balancer import LeastInFlightBalancer
from flowrl.rollout.batch import RolloutBatch, stack_rows
from flowrl.sampling_params import SamplingParams
from flowrl.waiting import StopCheck, wait_for_event, wait_for_futures

logger = logging.getLogger(__name__)

KNOWN_AGENTS = ("diffusion",)
# DiffusionOutput field -> RolloutBatch tensor field (a sample's `image` is one row of `images`).
OUTPUT_TO_BATCH = {
    "image": "images",
    "all_latents": "all_latents",
    "all_log_probs": "all_log_probs",
    "sigmas": "sigmas",
    "next_sigmas": "next_sigmas",
    "prompt_embeds": "prompt_embeds",
    "prompt_embeds_mask": "prompt_embeds_mask",
    "pooled_prompt_embeds": "pooled_prompt_embeds",
    "negative_prompt_embeds": "negative_prompt_embeds",
    "negative_prompt_embeds_mask": "negative_prompt_embeds_mask",
    "negative_pooled_prompt_embeds": "negative_pooled_prompt_embeds",
}


def row_seed(base_seed: int, row: int) -> int:
    """The seed of row `row` of a batch whose base seed is `base_seed` (rollout.seed for training
    rows, counted over the whole run; rollout.val_seed for validation rows, counted from 0).
    Consecutive rows get consecutive seeds, as generate_batched gives sample j seed + j."""
    return (base_seed * 1_000_000_007) % 2**62 + row


class AgentLoop:
    """Drives engines with the rows of a RolloutBatch (rollout config slice only)."""

    def __init__(self, engines, rollout_config):
        """engines: one engine, a list of them (balanced), or a prebuilt LeastInFlightBalancer."""
        if isinstance(engines, LeastInFlightBalancer):
            self.balancer = engines
        else:
            replicas = engines if isinstance(engines, (list, tuple)) else [engines]
            self.balancer = LeastInFlightBalancer(list(replicas), rollout_config.max_replica_failures)
        self.config = rollout_config
        self.rows_generated = 0  # global row index of the next training row (saved by checkpoints)
        self._logged_reasons: set[str] = set()

    # --- row -> request --------------------------------------------------------------------------
    def _row_params(self, batch: RolloutBatch, i: int, base: SamplingParams) -> SamplingParams:
        nt = batch.non_tensor_batch
        agent = nt["agent_name"][i] if "agent_name" in nt else "diffusion"
        if agent not in KNOWN_AGENTS:
            raise ValueError(f"row {i}: agent_name={agent!r} is unknown; known agents: {KNOWN_AGENTS}")
        changes = {}
        negative = nt["negative_prompt"][i] if "negative_prompt" in nt else None
        if negative is not None:
            changes["negative_prompt"] = negative
        overrides = nt["sampling_overrides"][i] if "sampling_overrides" in nt else None
        if overrides:
            unknown = set(overrides) - set(SamplingParams.__dataclass_fields__)
            if unknown:
                raise ValueError(f"row {i}: sampling_overrides has unknown fields {sorted(unknown)}")
            changes.update(overrides)
        return base.replace(**changes) if changes else base

    def batched_path_blocker(self, batch: RolloutBatch, params: list[SamplingParams]) -> str | None:
        """None when the batched path is provably safe, else the reason it is not."""
        n = self.config.n
        if not self.config.enable_batched_diffusion:
            return "rollout.enable_batched_diffusion is false"
        if not self.balancer.supports_batched_generation:
            return "an engine does not support batched generation"
        if n <= 1:
            return f"rollout.n={n} (batching needs n > 1)"
        if len(batch) % n:
            return f"len(batch)={len(batch)} is not a multiple of rollout.n={n}"
        nt = batch.non_tensor_batch
        for start in range(0, len(batch), n):
            rows = range(start, start + n)
            for field in ("agent_name", "raw_prompt", "negative_prompt"):
                if field in nt and len({repr(nt[field][r]) for r in rows}) > 1:
                    return f"rows {start}..{start + n - 1} differ in {field}"
            why = _not_one_call(params[start : start + n])
            if why is not None:
                return f"rows {start}..{start + n - 1} {why}"
        return None

    def _one_call_fits(self, params: list[SamplingParams], samples_per_prompt: int) -> bool:
        """Whether the rows go as one `submit_many` call of `samples_per_prompt` samples per prompt:
        one engine (over several, each request goes to the least busy one, which spreads them) that
        takes such calls, in this process where a prompt has several samples (module docstring), and
        rows that differ in their prompts and seeds only, the seeds counting up by one."""
        live = self.balancer.live_replicas
        if len(live) != 1 or not self.balancer.supports_submit_many:
            return False
        return (samples_per_prompt == 1 or self.balancer.is_in_process) and _not_one_call(params) is None

    def _seeds(self, batch: RolloutBatch, base_seed: int | None, row_offset: int) -> list[int]:
        """Row seeds: an explicit per-row `seed` wins; otherwise base + global row index."""
        base = base_seed if base_seed is not None else secrets.randbits(40)
        given = batch.non_tensor_batch.get("seed")
        seeds = []
        for i in range(len(batch)):
            explicit = None if given is None else given[i]
            seeds.append(int(explicit) if explicit is not None else row_seed(base, row_offset + i))
        return seeds

    # --- main entry --------------------------------------------------------------------------------
    def generate_sequences(
        self,
        batch: RolloutBatch,
        validation: bool = False,
        on_sample_done: Callable[[int, object], None] | None = None,
        row_offset: int = 0,
        stop_check: StopCheck | None = None,
    ) -> RolloutBatch:
        """Generate one sample per row; return the batch with the sample fields attached.

        validation=True uses rollout.val_sampling (ODE, no log-probs) and the fixed rollout.val_seed
        with row indices from 0, so validation images are comparable across training steps.
        row_offset: where this batch starts among the rows of the whole step (or validation) when
        it is one rank's share of it, so every row gets the seed it has in one process.
        stop_check: called while waiting for the samples (flowrl.waiting); whatever it raises
        ends the wait, the requests left to whoever closes the engine.
        """
        if len(batch) == 0:
            raise ValueError("generate_sequences got an empty batch; pass at least one row")
        t0 = time.perf_counter()
        # 1. every row's prompt, seed and sampling params
        base_params = self.config.val_sampling if validation else self.config.sampling
        base_seed = self.config.val_seed if validation else self.config.seed
        offset = (0 if validation else self.rows_generated) + row_offset
        seeds = self._seeds(batch, base_seed, offset)
        prompts = [str(p) for p in batch.non_tensor_batch["raw_prompt"]]
        params = [self._row_params(batch, i, base_params).replace(seed=seeds[i]) for i in range(len(batch))]

        # 2. submit: one batched call per group when provably safe, else one request per row; on one
        #    engine, one call for them all where the rows differ in prompt and seed only
        reason = self.batched_path_blocker(batch, params)
        futures: list[Future] = []
        if reason is None:
            n = self.config.n
            if self._one_call_fits(params, n):
                futures += self.balancer.submit_many(prompts[::n], params[0], n)
            else:
                for start in range(0, len(batch), n):
                    futures += self.balancer.submit_batched(prompts[start], n, params[start])
        else:
            if params[0].shared_initial_noise and not validation:
                raise ValueError(
                    "rollout.sampling.shared_initial_noise=true shares a group's starting noise through one batched "
                    f"call per group, which these rows cannot take ({reason}); set "
                    "rollout.sampling.shared_initial_noise=false or make the groups batchable"
                )
            one_call = self._one_call_fits(params, 1)
            # Validation batches hold one row per prompt, so the fallback is expected there.
            if not validation and reason not in self._logged_reasons:
                self._logged_reasons.add(reason)
                logger.warning(
                    "agent loop: batched diffusion not used (%s); sending %d rows as %s",
                    reason,
                    len(batch),
                    "one call" if one_call else "single requests",
                )
            if one_call:
                futures += self.balancer.submit_many(prompts, params[0])
            else:
                for i in range(len(batch)):
                    futures += self.balancer.submit(prompts[i], params[i])
        # 3. wait for every sample (each handed to on_sample_done as soon as it is done)
        callbacks_done = []
        if on_sample_done is not None:
            for i, f in enumerate(futures):
                callbacks_done.append(threading.Event())
                f.add_done_callback(_notify(on_sample_done, i, callbacks_done[-1]))
        wait_for_futures(futures, stop_check)
        outputs = []
        for i, f in enumerate(futures):
            try:
                outputs.append(f.result())
            except Exception as exc:
                raise RuntimeError(f"rollout of row {i} (prompt {prompts[i]!r}) failed: {exc}") from exc
        # A Future wakes its waiter before it runs its done-callbacks: wait for them, so every
        # on_sample_done call has returned when generate_sequences does.
        for event in callbacks_done:
            wait_for_event(event, stop_check)
        # 4. the samples' tensors and metadata attached to the batch's rows
        if not validation:
            self.rows_generated += len(batch)
        return self._assemble(batch, outputs, reason, time.perf_counter() - t0)

    def _assemble(self, batch: RolloutBatch, outputs: list, reason: str | None, seconds: float) -> RolloutBatch:
        rows = [{dst: getattr(o, src) for src, dst in OUTPUT_TO_BATCH.items()} for o in outputs]
        result = batch.select(np.arange(len(batch)))
        result.add_tensors(stack_rows(rows))
        result.add_non_tensors(
            {
                "seed": [o.seed for o in outputs],
                "policy_version": [o.policy_version for o in outputs],
                "sde_window": [list(o.sde_window) for o in outputs],
                # The settings each sample was drawn with, per row: the trainer re-scores with them.
                **TransitionSpec.to_columns([o.transition_spec for o in outputs]),
            }
        )
        n = self.config.n
        batched = reason is None
        result.meta_info.update(
            {
                "num_batched_groups": len(batch) // n if batched else 0,
                "num_single_requests": 0 if batched else len(batch),
                "fallback_reason": reason,
                "timing": {
                    "rollout_s": seconds,
                    "queued_s_mean": float(np.mean([o.timings["queued_s"] for o in outputs])),
                    "denoise_s_mean": float(np.mean([o.timings["denoise_s"] for o in outputs])),
                    "decode_s_mean": float(np.mean([o.timings["decode_s"] for o in outputs])),
                },
                "replica_in_flight_assigned": list(self.balancer.assigned),
            }
        )
        return result


def _not_one_call(params: list[SamplingParams]) -> str | None:
    """Why rows with these settings are not what one engine call draws (`generate_batched` or
    `submit_many`: sample i with the first seed + i), or None when they are: settings equal but
    for the seeds, which count up by one from the first row's."""
    same = repr(params[0].replace(seed=None))
    if any(repr(p.replace(seed=None)) != same for p in params):
        return "differ in sampling settings"
    first = params[0].seed
    if [p.seed for p in params] != list(range(first, first + len(params))):
        return "carry seeds that are not consecutive"
    return None


def _notify(callback: Callable[[int, object], None], row: int, finished: threading.Event) -> Callable[[Future], None]:
    """A done-callback that hands a finished sample to `callback`, then sets `finished`; failed
    samples are reported by generate_sequences itself, so they are skipped here."""

    def done(future: Future) -> None:
        try:
            if future.exception() is None:
                callback(row, future.result())
        finally:
            finished.set()

    return done
