"""DiffusionEngine: the public sync/async API over a background engine thread.

Callers (any thread, any coroutine) submit requests; validation happens in the caller before
anything is queued, so bad input raises there and the engine keeps serving. The engine thread runs
the continuous-batching loop:

1. drain new requests, encode prompts not yet in the prompt cache (one batched encode; a prompt is
   encoded once however many samples use it), and queue their samples;
2. admit waiting samples up to max_batch_rows;
3. step one compatible group with one transformer forward (samples may be at different steps);
4. decode samples that finished, in bounded chunks, and resolve their futures.

New requests are taken between any two iterations, so requests arriving at different times share
forwards. `stats()` shows the batching that actually happened.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future

import torch

from flowrl import sampler
from flowrl.engine.api import EngineAPI
from flowrl.engine.executor import Executor
from flowrl.engine.output import DiffusionOutput
from flowrl.engine.sample import SampleState
from flowrl.engine.scheduler import Scheduler
from flowrl.models.base import FlowModelAdapter, PromptEncoding
from flowrl.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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


def _compile(adapter: FlowModelAdapter, compile: bool | str, rounding: str) -> list[str]:
    """The engine's `compile` option: flowrl.accel's one entry (imported here, so an engine
    without compile never loads torch's compiler); returns the compiled modules' names."""
    if not compile:
        if rounding != "eager":
            raise ValueError(
                f"compile_rounding={rounding!r} applies to compiled modules only; "
                "pass compile=True or leave compile_rounding at 'eager'"
            )
        return []
    backend = _compile_backend(compile)
    from flowrl.accel import compile_adapter

    return compile_adapter(adapter, backend, rounding)


class DiffusionEngine(EngineAPI):
    """Continuous-batching diffusion engine over one model adapter."""

    def __init__(
        self,
        adapter: FlowModelAdapter,
        max_batch_rows: int = 32,
        decode_chunk_size: int = 16,
        prompt_cache_size: int = 4096,
        compile: bool | str = False,
        autocast_dtype: torch.dtype | None = None,
        compile_rounding: str = "eager",
    ):
        self.adapter = adapter
        # compile: False, True (inductor) or a torch.compile backend name; regional compilation of
        # the adapter's hot modules with flowrl's fast paths, in place (the trainer shares them).
        # compile_rounding: "eager" or "fused" (flowrl.config.CompileRounding). See flowrl.accel.
        self.compiled_modules = _compile(adapter, compile, compile_rounding)
        self.scheduler = Scheduler(max_batch_rows)
        self.executor = Executor(adapter, decode_chunk_size)
        self.set_mixed_precision(autocast_dtype)  # the transformer under torch.autocast, or not
        self.max_batch_rows = max_batch_rows
        self.prompt_cache_size = prompt_cache_size
        self._prompt_cache: OrderedDict[str, PromptEncoding] = OrderedDict()
        self._inbox: queue.Queue[list[SampleState] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._num_in_flight = 0
        self.policy_version = 0
        self.reset_stats()

    @classmethod
    def from_pretrained(
        cls,
        path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        max_batch_rows: int = 32,
        decode_chunk_size: int = 16,
        compile: bool | str = False,
        compile_rounding: str = "eager",
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
            compile_rounding=compile_rounding,
        )

    # --- public API (generate, generate_batched, async twins, submit: flowrl.engine.api) ---------
    def submit_many(self, prompts: list[str], sampling_params: SamplingParams | None = None) -> list[Future]:
        if not isinstance(prompts, list) or not prompts:
            raise ValueError(f"prompts={prompts!r} must be a non-empty list of strings")
        params = self._validated(prompts[0], sampling_params)
        base = params.seed if params.seed is not None else secrets.randbits(62)
        futures = []
        for i, p in enumerate(prompts):
            futures += self.submit_batched(p, 1, params.replace(seed=base + i))
        return futures

    def submit_batched(
        self, prompt: str, num_outputs_per_prompt: int, sampling_params: SamplingParams | None = None
    ) -> list[Future]:
        """Queue N samples of `prompt` (one SDE window drawn for all of them); return futures."""
        if (
            isinstance(num_outputs_per_prompt, bool)
            or not isinstance(num_outputs_per_prompt, int)
            or num_outputs_per_prompt < 1
        ):
            raise ValueError(
                f"num_outputs_per_prompt={num_outputs_per_prompt!r} must be an integer >= 1 "
                "(the number of samples to generate for this prompt)"
            )
        params = self._validated(prompt, sampling_params)
        base_seed = params.seed if params.seed is not None else secrets.randbits(62)
        window = self._choose_window(params, base_seed)
        samples = [
            SampleState(prompt=prompt, params=params, seed=base_seed + j, sde_window=window, future=Future())
            for j in range(num_outputs_per_prompt)
        ]
        self._enqueue(samples)
        return [s.future for s in samples]

    def stats(self) -> dict:
        with self._lock:
            s = dict(self._stats)
            s["rows_per_forward_hist"] = dict(sorted(self._stats["rows_per_forward_hist"].items()))
        s["mean_rows_per_forward"] = s["num_rows"] / s["num_forwards"] if s["num_forwards"] else 0.0
        s["images_per_second"] = s["num_samples_finished"] / s["busy_seconds"] if s["busy_seconds"] > 0 else 0.0
        s["max_batch_rows"] = self.max_batch_rows
        s["policy_version"] = self.policy_version
        return s

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = {
                "num_forwards": 0,
                "num_rows": 0,
                "rows_per_forward_hist": Counter(),
                "num_samples_finished": 0,
                "num_samples_failed": 0,
                "num_prompt_encodes": 0,
                "num_prompt_cache_hits": 0,
                "num_decode_calls": 0,
                "busy_seconds": 0.0,
            }

    def set_policy_version(self, version: int) -> None:
        """Tag samples admitted from now on with `version` (called after a weight update)."""
        self.policy_version = int(version)

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
        return self._idle.wait(timeout)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join()
            self._thread = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # --- caller side helpers -----------------------------------------------------------------------
    def _validated(self, prompt, sampling_params: SamplingParams | None) -> SamplingParams:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt={prompt!r} must be a string")
        params = sampling_params if sampling_params is not None else SamplingParams()
        params.validate(self.adapter.size_multiple)
        # The model's schedule for these settings (cached): raises here, before anything is queued.
        self.adapter.sigmas(params.num_inference_steps, params.height, params.width)
        if params.uses_cfg and self.max_batch_rows < 2:
            raise ValueError(
                f"guidance_scale={params.guidance_scale} needs 2 rows per sample but the engine's "
                f"max_batch_rows={self.max_batch_rows}; raise max_batch_rows or set guidance_scale <= 1"
            )
        return params

    @staticmethod
    def _choose_window(params: SamplingParams, base_seed: int) -> tuple[int, int]:
        if params.sde_window is not None:
            return tuple(params.sde_window)
        if params.sde_window_size is not None:
            gen = torch.Generator().manual_seed(base_seed)
            return sampler.draw_sde_window(
                params.num_inference_steps, params.sde_window_size, params.sde_window_range, gen
            )
        return sampler.default_sde_window(params.num_inference_steps)

    def _enqueue(self, samples: list[SampleState]) -> None:
        with self._lock:
            self._num_in_flight += len(samples)
            self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="flowrl-engine", daemon=True)
                self._thread.start()
        self._inbox.put(samples)

    # --- engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            block = not self.scheduler.has_work()
            try:
                while True:
                    item = self._inbox.get(block=block)
                    block = False
                    if item is None:
                        return
                    self._accept(item)
            except queue.Empty:
                pass
            if self.scheduler.has_work():
                t0 = time.perf_counter()
                self._iterate()
                with self._lock:
                    self._stats["busy_seconds"] += time.perf_counter() - t0

    def _accept(self, samples: list[SampleState]) -> None:
        """Encode prompts (cache first) and queue the samples; failures go to their futures."""
        try:
            texts = [samples[0].prompt]
            if samples[0].params.uses_cfg:
                texts.append(samples[0].params.negative_prompt or "")
            encodings = self._encode(texts)
            for s in samples:
                s.cond = encodings[0]
                s.uncond = encodings[1] if s.params.uses_cfg else None
                self.scheduler.add(s)
        except Exception as exc:  # noqa: BLE001 - the error belongs to these callers only
            logger.exception("engine: failed to accept a request")
            self._fail(samples, exc)

    def _encode(self, texts: list[str]) -> list[PromptEncoding]:
        missing = list(dict.fromkeys(t for t in texts if t not in self._prompt_cache))
        if missing:
            for text, enc in zip(missing, self.adapter.encode_prompts(missing)):
                self._prompt_cache[text] = enc
            while len(self._prompt_cache) > self.prompt_cache_size:
                self._prompt_cache.popitem(last=False)
        with self._lock:
            self._stats["num_prompt_encodes"] += len(missing)
            self._stats["num_prompt_cache_hits"] += len(texts) - len(missing)
        for t in texts:
            self._prompt_cache.move_to_end(t)
        return [self._prompt_cache[t] for t in texts]

    def _iterate(self) -> None:
        for s in self.scheduler.admit():
            s.admitted_at = time.perf_counter()
            s.policy_version = self.policy_version
            try:
                self.executor.prepare(s)
            except Exception as exc:  # noqa: BLE001
                self.scheduler.remove([s])
                self._fail([s], exc)
        group = self.scheduler.schedule()
        if not group:
            return
        try:
            rows = self.executor.step(group)
            finished = [s for s in group if s.is_finished]
            results = self.executor.finish(finished) if finished else []
        except Exception as exc:  # noqa: BLE001 - fail these samples, keep serving the rest
            logger.exception("engine: a step failed")
            self.scheduler.remove(group)
            self._fail(group, exc)
            return
        self.scheduler.remove(finished)
        with self._lock:
            self._stats["num_forwards"] += 1
            self._stats["num_rows"] += rows
            self._stats["rows_per_forward_hist"][rows] += 1
            self._stats["num_samples_finished"] += len(results)
            self._stats["num_decode_calls"] += -(-len(finished) // self.executor.decode_chunk_size) if finished else 0
        for s, output in results:
            self._resolve(s, output)

    def _resolve(self, s: SampleState, output: DiffusionOutput) -> None:
        s.future.set_result(output)
        self._done(1)

    def _fail(self, samples: list[SampleState], exc: BaseException) -> None:
        for s in samples:
            if not s.future.done():
                s.future.set_exception(exc)
        with self._lock:
            self._stats["num_samples_failed"] += len(samples)
        self._done(len(samples))

    def _done(self, count: int) -> None:
        with self._lock:
            self._num_in_flight -= count
            if self._num_in_flight == 0:
                self._idle.set()
