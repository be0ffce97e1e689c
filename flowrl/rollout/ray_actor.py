"""EngineActor: flowrl's rollout engine as a Ray actor (docs/ray.md).

An async actor over one DiffusionEngine in its own process. Its methods are the engine's:
`generate`, `generate_batched`, `submit_many` (all samples of the call returned together),
`stats` / `reset_stats`, `pause` / `resume`, weight updates (`load_weights`, `weights_info`) and
`shutdown`. Every remote call is a coroutine on the actor's event loop that awaits the engine's
futures, so concurrent calls share transformer forwards exactly as concurrent local requests do.
Results are the engine's own DiffusionOutputs (tensors and plain values) through Ray's object
store. A bad request raises the engine's ValueError naming the field before any work; Ray
delivers it as a RayTaskError that is also a ValueError.

A weight update is a flowrl weights file (flowrl.server.wire's format; put once in the object
store, every actor reads the same copy) with its sha256, checked as `flowrl serve` checks an upload
(flowrl.server.weights: checksum, names, shapes, dtypes, finite values) and swapped in with no
sample in flight (flowrl.server.admission, as the server does). It knows nothing of training.
"""

from __future__ import annotations

import asyncio

import ray

from flowrl.engine.api import check_num_outputs_per_prompt, check_prompts
from flowrl.server import wire
from flowrl.server.admission import Admission
from flowrl.server.weights import apply_update, live_weights, parse_update_query, prepare_update

# Ray bounds the calls an async actor runs at once (max_concurrency); admission adds no limit of its own.
_UNBOUNDED = 2**62


@ray.remote
class EngineActor:
    """One engine in a Ray actor (module docstring). Create it with Ray's options as any actor:
    `EngineActor.options(num_gpus=1, name="engine-0").remote("/models/sd35m", dtype="bfloat16")`.

    model_path: a diffusers checkpoint folder; device: "auto" (the GPU Ray gave the actor, else
    CPU), "cpu" or "cuda"; dtype: "float32", "bfloat16" or "float16"; mixed_precision: "no", "bf16"
    or "fp16" (the transformer under torch.autocast, as a trainer's mixed precision); the rest are
    DiffusionEngine's settings, then the model family's adapter options (max_sequence_length)."""

    def __init__(
        self,
        model_path: str,
        device: str = "auto",
        dtype: str = "float32",
        mixed_precision: str = "no",
        max_batch_rows: int = 32,
        decode_chunk_size: int = 16,
        prompt_cache_mb: int = 1024,
        **adapter_options,
    ):
        import torch

        from flowrl.config.sections import resolve_device
        from flowrl.engine.engine import DiffusionEngine
        from flowrl.models.base import MIXED_PRECISION_DTYPES
        from flowrl.models.registry import load_adapter

        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={device!r} must be 'auto', 'cpu' or 'cuda' (the GPU Ray gives the actor)")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={dtype!r} must be 'float32', 'bfloat16' or 'float16'")
        if mixed_precision not in MIXED_PRECISION_DTYPES:
            raise ValueError(f"mixed_precision={mixed_precision!r} must be one of {list(MIXED_PRECISION_DTYPES)}")
        adapter = load_adapter(
            str(model_path), device=resolve_device(device), dtype=getattr(torch, dtype), **adapter_options
        )
        self.engine = DiffusionEngine(
            adapter,
            max_batch_rows=max_batch_rows,
            decode_chunk_size=decode_chunk_size,
            prompt_cache_mb=prompt_cache_mb,
            autocast_dtype=MIXED_PRECISION_DTYPES[mixed_precision],
        )
        self.admission = Admission(_UNBOUNDED)
        self._update_lock = asyncio.Lock()

    # --- generation ------------------------------------------------------------------------------
    async def generate(self, prompt, sampling_params=None):
        """One DiffusionOutput for a prompt, or one per prompt for a list (sample i with seed + i)."""
        if isinstance(prompt, list):
            return await self.submit_many(prompt, sampling_params)
        return (await self.generate_batched(prompt, 1, sampling_params))[0]

    async def generate_batched(self, prompt: str, num_outputs_per_prompt: int, sampling_params=None) -> list:
        """N samples of one prompt from shared forwards; sample j with seed + j."""
        check_num_outputs_per_prompt(num_outputs_per_prompt)
        submit = self.engine.submit_batched
        return await self._run(num_outputs_per_prompt, submit, prompt, num_outputs_per_prompt, sampling_params)

    async def submit_many(self, prompts: list, sampling_params=None, num_outputs_per_prompt: int = 1) -> list:
        """N samples per prompt queued together (prompt i's sample j with seed + i * N + j), prompt by prompt."""
        check_prompts(prompts)
        check_num_outputs_per_prompt(num_outputs_per_prompt)
        num_samples = len(prompts) * num_outputs_per_prompt
        return await self._run(num_samples, self.engine.submit_many, prompts, sampling_params, num_outputs_per_prompt)

    async def _run(self, num_samples: int, submit, *args) -> list:
        """Admit the samples (a pause or a weight swap holds them at the gate), submit, await them;
        a cancelled call (ray.cancel) cancels its samples in the engine."""
        async with self.admission.admit(num_samples):
            futures = submit(*args)  # the engine's checks raise here, before anything is queued
            try:
                return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
            except BaseException:
                for future in futures:
                    future.cancel()
                raise

    # --- state -----------------------------------------------------------------------------------
    async def stats(self) -> dict:
        """engine.stats(): forwards, rows per forward, samples finished, policy_version, ..."""
        return self.engine.stats()

    async def reset_stats(self) -> None:
        self.engine.reset_stats()

    async def health(self) -> dict:
        return {
            "status": "paused" if self.admission.is_paused else "ok",
            "policy_version": self.engine.policy_version,
            "samples_in_flight": self.admission.num_in_flight,
            "max_batch_rows": self.engine.max_batch_rows,
            "size_multiple": self.engine.adapter.size_multiple,
        }

    async def pause(self) -> dict:
        """Hold new calls at the gate (samples already admitted finish); `resume` lets them in."""
        self.admission.pause()
        return await self.health()

    async def resume(self) -> dict:
        self.admission.resume()
        return await self.health()

    # --- weights ---------------------------------------------------------------------------------
    async def load_weights(self, body: bytes, version: int, kind: str, sha256: str) -> dict:
        """Make `body` (wire.encode_weights' bytes; kind "lora" or "full"; sha256: the body's
        file checksum) policy `version`: checked first (a ValueError naming the mismatch leaves the
        model untouched), then swapped in once no sample is in flight. Returns `weights_info()`."""
        transformer = self.engine.adapter.transformer
        compiled = bool(self.engine.compiled_modules)
        async with self._update_lock:
            try:
                kind, version, sha256 = parse_update_query(
                    {"kind": kind, "version": str(version), "sha256": str(sha256)}
                )
                component = self.engine.adapter.trained_component
                update = await asyncio.to_thread(
                    prepare_update, body, kind, version, sha256, transformer, compiled, component
                )
            except ValueError as error:  # the server's BadRequest, as a plain ValueError through Ray
                raise ValueError(str(error)) from None
            del body
            async with self.admission.exclusive():
                # Samples cancelled by their callers may still be leaving the engine: wait for them too.
                await asyncio.to_thread(self.engine.wait_until_idle)
                await asyncio.to_thread(apply_update, update, transformer)
                self.engine.set_policy_version(version)
        return await self.weights_info()

    async def weights_info(self) -> dict:
        """The live weights: policy_version, kind ("lora" or "full"), weights_sha256, num_tensors."""
        kind, live = live_weights(self.engine.adapter.transformer)
        checksum = await asyncio.to_thread(wire.weights_sha256, live)
        return {
            "policy_version": self.engine.policy_version,
            "kind": kind,
            "weights_sha256": checksum,
            "num_tensors": len(live),
        }

    async def shutdown(self) -> None:
        """Stop the engine: calls in flight fail with EngineClosedError, later ones are refused."""
        self.engine.shutdown()
