"""DiffusionEngine: the public sync/async API over a background engine thread.

Callers (any thread, any coroutine) submit requests; validation happens in the caller before
anything is queued (`SamplingParams.validate` with the model's size limits, the model's schedule,
the rows a sample needs), so bad input raises ValueError there and the engine keeps serving. The
engine thread (flowrl/engine/loop.py) runs the continuous-batching loop: new requests are taken
between any two iterations, so requests arriving at different times share forwards. `stats()`
shows the batching that actually happened.

Cancellation: `future.cancel()` on a submitted sample, or cancelling the coroutine of
`generate_async` / `generate_batched_async` (a task's cancel, an `asyncio.wait_for` timeout), drops
the sample between two steps and frees its rows; the other samples go on. An interrupted
`generate` / `generate_batched` cancels its samples the same way.

Shutdown: `shutdown()` (or leaving a `with engine:` block) fails every request still in flight
with EngineClosedError and joins the engine thread; the engine then refuses new requests with
EngineClosedError (a new DiffusionEngine over the same adapter serves again). The same happens if
the engine thread ever dies, so no caller waits forever on a dead engine.
"""

from __future__ import annotations

import secrets
from concurrent.futures import Future

import torch

from flowrl import sampler
from flowrl.engine.api import (
    EngineAPI,
    EngineClosedError,
    check_num_outputs_per_prompt,
    check_prompts,
    request_params,
)
from flowrl.engine.executor import Executor
from flowrl.engine.loop import EngineLoop
from flowrl.engine.prompt_cache import PromptCache
from flowrl.engine.sample import SampleState
from flowrl.engine.scheduler import Scheduler
from flowrl.models.base import FlowModelAdapter
from flowrl.sampling_params import SamplingParams

__all__ = ["DiffusionEngine", "EngineClosedError"]


def _compile_backend(compile: bool | str) -> str:
    from typing import get_args

    from flowrl.config.sections import CompileBackend

    backends = get_args(CompileBackend)
    if compile is True:
        return "inductor"
    if isinstance(compile, str) and compile in backends:
        return compile
    raise ValueError(
        f"compile={compile!r} is not valid; use False, True (torch.compile with inductor) or a "
        f"backend name in {backends}"
    )


def _compile(adapter: FlowModelAdapter, compile: bool | str) -> list[str]:
    """The engine's `compile` option: flowrl.accel's one entry (imported here, so an engine
    without compile never loads torch's compiler); returns the compiled modules' names."""
    if not compile:
        return []
    backend = _compile_backend(compile)
    from flowrl.accel import compile_adapter

    return compile_adapter(adapter, backend)


class DiffusionEngine(EngineAPI):
    """Continuous-batching diffusion engine over one model adapter.

    prompt_cache_mb: bytes of prompt encodings kept for reuse, in MiB (0: none); the least
    recently used are evicted first. They are kept in host memory (pinned on a GPU machine) and
    copied to the device per request without blocking.
    """

    is_in_process = True  # each sample's future resolves as soon as that sample is done, at any call size

    def __init__(
        self,
        adapter: FlowModelAdapter,
        max_batch_rows: int = 32,
        decode_chunk_size: int = 16,
        compile: bool | str = False,
        autocast_dtype: torch.dtype | None = None,
        prompt_cache_mb: int = 1024,
    ):
        self.adapter = adapter
        # compile: False, True (inductor) or a torch.compile backend name; regional compilation of
        # the adapter's hot modules with flowrl's fast paths, in place (the trainer shares them).
        self.compiled_modules = _compile(adapter, compile)
        self.scheduler = Scheduler(max_batch_rows)
        self.executor = Executor(adapter, decode_chunk_size)
        self.set_mixed_precision(autocast_dtype)  # the transformer under torch.autocast, or not
        self.max_batch_rows = max_batch_rows
        if isinstance(prompt_cache_mb, bool) or not isinstance(prompt_cache_mb, int) or prompt_cache_mb < 0:
            raise ValueError(f"prompt_cache_mb={prompt_cache_mb!r} must be an integer >= 0 (MiB; 0 disables it)")
        self.prompt_cache = PromptCache(prompt_cache_mb * 2**20, adapter.device)
        self._loop = EngineLoop(adapter, self.scheduler, self.executor, self.prompt_cache)

    @classmethod
    def from_pretrained(
        cls,
        path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        max_batch_rows: int = 32,
        decode_chunk_size: int = 16,
        compile: bool | str = False,
        prompt_cache_mb: int = 1024,
        **adapter_kwargs,
    ) -> "DiffusionEngine":
        from flowrl.models.registry import load_adapter

        if isinstance(dtype, str):
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        adapter = load_adapter(path, device=device, dtype=dtype, **adapter_kwargs)
        return cls(
            adapter,
            max_batch_rows=max_batch_rows,
            decode_chunk_size=decode_chunk_size,
            compile=compile,
            prompt_cache_mb=prompt_cache_mb,
        )

    # --- public API (generate, generate_batched, async twins, submit: flowrl.engine.api) ---------
    def submit_many(
        self, prompts: list[str], sampling_params: SamplingParams | None = None, num_outputs_per_prompt: int = 1
    ) -> list[Future]:
        """N samples per prompt, queued together: prompt i's sample j with seed + i * N + j (each
        prompt a group of its own, as `submit_batched` makes it). Every prompt is checked before
        any is queued; the futures come prompt by prompt."""
        check_prompts(prompts)
        check_num_outputs_per_prompt(num_outputs_per_prompt)
        n = num_outputs_per_prompt
        for p in prompts:
            params = self._validated(p, sampling_params, len(prompts) * n)
        base = params.seed if params.seed is not None else secrets.randbits(62)
        requests = [self._request(p, n, params.replace(seed=base + i * n)) for i, p in enumerate(prompts)]
        self._enqueue(requests)
        return [s.future for samples in requests for s in samples]

    def submit_batched(
        self, prompt: str, num_outputs_per_prompt: int, sampling_params: SamplingParams | None = None
    ) -> list[Future]:
        """Queue N samples of `prompt` (sample j with seed + j and its window); return futures."""
        check_num_outputs_per_prompt(num_outputs_per_prompt)
        params = self._validated(prompt, sampling_params, num_outputs_per_prompt)
        samples = self._request(prompt, num_outputs_per_prompt, params)
        self._enqueue([samples])
        return [s.future for s in samples]

    def stats(self) -> dict:
        s = self._loop.stats()
        s["mean_rows_per_forward"] = s["num_rows"] / s["num_forwards"] if s["num_forwards"] else 0.0
        s["images_per_second"] = s["num_samples_finished"] / s["busy_seconds"] if s["busy_seconds"] > 0 else 0.0
        s["max_batch_rows"] = self.max_batch_rows
        s["policy_version"] = self.policy_version
        s["prompt_cache_entries"] = len(self.prompt_cache)
        s["prompt_cache_bytes"] = self.prompt_cache.nbytes
        return s

    def reset_stats(self) -> None:
        self._loop.reset_stats()

    @property
    def policy_version(self) -> int:
        return self._loop.policy_version

    def set_policy_version(self, version: int) -> None:
        """Tag samples admitted from now on with `version` (called after a weight update)."""
        self._loop.policy_version = int(version)

    def set_mixed_precision(self, dtype: torch.dtype | None) -> None:
        """Run the transformer under torch.autocast(dtype) from the next step on (None: off). A
        colocated trainer sets its own mixed precision here, so rollout log-probs are computed
        with the arithmetic the trainer's forward uses."""
        if dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"mixed precision dtype={dtype!r} is not supported; use torch.bfloat16, torch.float16 or None"
            )
        self.executor.autocast_dtype = dtype

    def wait_until_idle(self, timeout: float | None = None) -> bool:
        return self._loop.wait_until_idle(timeout)

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive (it starts with the first request)."""
        return self._loop.is_alive

    def shutdown(self) -> None:
        """Fail every request in flight with EngineClosedError, join the engine thread, and refuse
        new requests from now on (see the module docstring). Calling it again does nothing."""
        self._loop.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # --- caller side helpers -----------------------------------------------------------------------
    def _validated(self, prompt, sampling_params: SamplingParams | None, num_samples: int = 1) -> SamplingParams:
        params = request_params(prompt, sampling_params)
        params.validate(self.adapter.size_multiple, self.adapter.max_image_side, num_samples)
        self.adapter.check_guidance(params)
        self.adapter.check_frames(params)
        # The model's schedule for these settings (cached): raises here, before anything is queued.
        self.adapter.sigmas(params.num_inference_steps, params.height, params.width)
        rows = self.adapter.rows_per_sample(params)
        if rows > self.max_batch_rows:
            field = "true_cfg_scale" if self.adapter.guidance_kind == "distilled" else "guidance_scale"
            raise ValueError(
                f"{field}={getattr(params, field)} needs {rows} rows per sample (cond + uncond) but the "
                f"engine's max_batch_rows={self.max_batch_rows}; raise max_batch_rows or set {field} <= 1"
            )
        return params

    def _request(self, prompt: str, num_samples: int, params: SamplingParams) -> list[SampleState]:
        """The samples of one request: seeds seed + j, each with the SDE window of its own seed (so
        sample j is the sample a single request with seed + j draws)."""
        base_seed = params.seed if params.seed is not None else secrets.randbits(62)
        num_rows = self.adapter.rows_per_sample(params)
        return [
            SampleState(
                prompt=prompt,
                params=params,
                seed=base_seed + j,
                noise_seed=base_seed if params.shared_initial_noise else base_seed + j,
                sde_window=self._choose_window(params, base_seed + j),
                future=Future(),
                num_rows=num_rows,
            )
            for j in range(num_samples)
        ]

    @staticmethod
    def _choose_window(params: SamplingParams, seed: int) -> tuple[int, int]:
        if params.sde_window is not None:
            return tuple(params.sde_window)
        if params.sde_window_size is not None:
            gen = torch.Generator().manual_seed(seed)
            return sampler.draw_sde_window(
                params.num_inference_steps, params.sde_window_size, params.sde_window_range, gen
            )
        if params.noise_level == 0.0 and not params.logprobs:
            # Deterministic, nothing scored: no window, so only the final latent is kept (the
            # forward-process algorithms train on it alone; a trajectory would be memory nobody reads).
            return (params.num_inference_steps, params.num_inference_steps)
        return sampler.default_sde_window(params.num_inference_steps)

    def _enqueue(self, requests: list[list[SampleState]]) -> None:
        """Hand requests to the engine thread (EngineClosedError after shutdown)."""
        self._loop.enqueue(requests)
