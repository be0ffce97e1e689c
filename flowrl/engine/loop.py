"""EngineLoop: the engine thread of a DiffusionEngine, and the life of every sample's future.

One iteration of the continuous-batching loop:

1. take new requests (waiting for one when idle), encode prompts not yet in the prompt cache (one
   batched encode; a prompt is encoded once however many samples use it), and queue their samples;
2. drop samples whose future is already done (cancelled by its caller), freeing their rows;
3. admit waiting samples up to max_batch_rows;
4. step one compatible group with one transformer forward (samples may be at different steps);
5. decode samples that finished, in bounded chunks, and resolve their futures.

Each sample leaves the engine exactly once, its future resolved, failed or cancelled, whatever the
caller did to the future meanwhile (`settle` never raises on a cancelled or already resolved one).
Failures stay with their samples: a request whose prompt cannot be encoded, a sample whose
admission fails, the group of a failed forward, the chunk of a failed decode. Anything else that
goes wrong in an iteration fails the samples in flight and the loop goes on serving. When the loop
ends, by `stop()` or because the thread dies, every sample still in the engine fails with
EngineClosedError and later requests are refused with it, so no caller ever waits forever.

The loop knows nothing about request validation (the caller side, engine.py) nor about device
work (executor.py) or which samples step together (scheduler.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter

from flowrl.engine.api import EngineClosedError, settle
from flowrl.engine.executor import Executor
from flowrl.engine.output import DiffusionOutput
from flowrl.engine.prompt_cache import PromptCache
from flowrl.engine.sample import SampleState
from flowrl.engine.scheduler import Scheduler
from flowrl.models.base import FlowModelAdapter, PromptEncoding

logger = logging.getLogger(__name__)

_SHUT_DOWN = "DiffusionEngine.shutdown() was called"


class EngineLoop:
    def __init__(self, adapter: FlowModelAdapter, scheduler: Scheduler, executor: Executor, cache: PromptCache):
        self.adapter = adapter
        self.scheduler = scheduler
        self.executor = executor
        self.prompt_cache = cache
        self.policy_version = 0  # tags the samples admitted from now on
        self._inbox: queue.Queue[list[list[SampleState]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._num_in_flight = 0
        self._closed: str | None = None  # why the engine no longer serves; None while it does
        self.reset_stats()

    # --- caller side -----------------------------------------------------------------------------
    def enqueue(self, requests: list[list[SampleState]]) -> None:
        """Queue requests (each a list of samples of one prompt); EngineClosedError after stop()."""
        with self._lock:
            if self._closed is not None:
                raise EngineClosedError(f"{self._closed}; create a new DiffusionEngine to generate again")
            self._num_in_flight += sum(len(samples) for samples in requests)
            self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flowrl-engine", daemon=True)
                self._thread.start()
            self._inbox.put(requests)  # under the lock: nothing can be queued behind stop()'s sentinel

    def stop(self) -> None:
        """Stop the engine thread and wait for it; every request in flight fails with EngineClosedError."""
        with self._lock:
            if self._closed is None:
                self._closed = _SHUT_DOWN
            thread = self._thread
            if thread is not None and thread.is_alive():
                self._inbox.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_until_idle(self, timeout: float | None = None) -> bool:
        return self._idle.wait(timeout)

    def stats(self) -> dict:
        with self._lock:
            counters = dict(self._stats)
            counters["rows_per_forward_hist"] = dict(sorted(self._stats["rows_per_forward_hist"].items()))
            counters["num_in_flight"] = self._num_in_flight
        return counters

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = {
                "num_forwards": 0,
                "num_rows": 0,
                "rows_per_forward_hist": Counter(),
                "num_samples_finished": 0,
                "num_samples_failed": 0,
                "num_samples_cancelled": 0,
                "num_prompt_encodes": 0,
                "num_prompt_cache_hits": 0,
                "num_decode_calls": 0,
                "busy_seconds": 0.0,
            }

    def _count(self, **increments) -> None:
        with self._lock:
            for name, value in increments.items():
                self._stats[name] += value

    # --- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        died_of = None
        try:
            while True:
                try:
                    if not self._take_requests():
                        return
                    self._drop_cancelled()
                    if self.scheduler.has_work():
                        t0 = time.perf_counter()
                        self._iterate()
                        self._count(busy_seconds=time.perf_counter() - t0)
                except Exception as exc:  # noqa: BLE001 - fail what is in flight, keep serving
                    logger.exception("engine: an iteration failed; failing the samples in flight")
                    self._fail(self.scheduler.take(lambda s: True), exc)
        except BaseException as exc:  # noqa: BLE001 - the thread ends; _close fails every future
            logger.critical("engine: the engine thread died", exc_info=True)
            died_of = exc
        finally:
            self._close(died_of)

    def _take_requests(self) -> bool:
        """Accept the queued requests, waiting for one when there is no work; False on stop()."""
        block = not self.scheduler.has_work()
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if item is None:
                return False
            block = False
            for samples in item:
                self._accept(samples)

    def _close(self, died_of: BaseException | None) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = f"the engine thread died ({died_of!r})"
            reason = self._closed
            left = self.scheduler.take(lambda s: True)
            while True:  # requests queued before stop(): nothing can be queued after it
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                left += [s for samples in item or [] for s in samples]
        self._fail(left, EngineClosedError(f"{reason} while this request was in flight"))

    def _accept(self, samples: list[SampleState]) -> None:
        """Encode the request's prompts (cache first) and queue its samples; a failure is theirs."""
        live = [s for s in samples if not s.future.done()]
        self._cancelled(len(samples) - len(live))
        if not live:
            return
        try:
            texts = [live[0].prompt]
            if live[0].num_rows > 1:  # one request: every sample has the uncond row or none does
                texts.append(live[0].params.negative_prompt or "")
            encodings = self._encode(texts)
            for s in live:
                s.cond = encodings[0]
                s.uncond = encodings[1] if s.num_rows > 1 else None
                self.scheduler.add(s)
        except Exception as exc:  # noqa: BLE001 - the error belongs to these callers only
            logger.exception("engine: failed to accept a request")
            queued = {id(s) for s in live}
            self.scheduler.take(lambda s: id(s) in queued)
            self._fail(live, exc)

    def _encode(self, texts: list[str]) -> list[PromptEncoding]:
        found = {t: self.prompt_cache.get(t) for t in dict.fromkeys(texts)}
        missing = [t for t, enc in found.items() if enc is None]
        if missing:
            for text, enc in zip(missing, self.adapter.encode_prompts(missing)):
                found[text] = enc
                self.prompt_cache.put(text, enc)
        self._count(num_prompt_encodes=len(missing), num_prompt_cache_hits=len(texts) - len(missing))
        return [found[t] for t in texts]

    def _drop_cancelled(self) -> None:
        """Samples whose future is done already (cancelled, or resolved by its caller): nobody waits."""
        self._cancelled(len(self.scheduler.take(lambda s: s.future.done())))

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
        except Exception as exc:  # noqa: BLE001 - fail these samples, keep serving the rest
            logger.exception("engine: a step failed")
            self.scheduler.remove(group)
            self._fail(group, exc)
            return
        with self._lock:
            self._stats["num_forwards"] += 1
            self._stats["num_rows"] += rows
            self._stats["rows_per_forward_hist"][rows] += 1
        finished = [s for s in group if s.is_finished]
        if not finished:
            return
        self.scheduler.remove(finished)
        chunks = self.executor.finish(finished)
        self._count(num_decode_calls=len(chunks))
        for chunk, outcome in chunks:
            if isinstance(outcome, Exception):  # only this chunk's samples fail
                logger.error("engine: decoding %d samples failed", len(chunk), exc_info=outcome)
                self._fail(chunk, outcome)
            else:
                for s, output in zip(chunk, outcome):
                    self._resolve(s, output)

    # --- samples leaving the engine (each exactly once) --------------------------------------------
    # Counted before the future is settled, so a caller that reads stats() after its result sees
    # its sample counted; a future the caller had cancelled meanwhile moves to the cancelled count.
    def _resolve(self, s: SampleState, output: DiffusionOutput) -> None:
        self._settle([s], "num_samples_finished", lambda future: settle(future, output))

    def _fail(self, samples: list[SampleState], exc: BaseException) -> None:
        self._settle(samples, "num_samples_failed", lambda future: settle(future, error=exc))

    def _settle(self, samples: list[SampleState], counter: str, resolve) -> None:
        if not samples:
            return
        self._count(**{counter: len(samples)})
        not_settled = sum(not resolve(s.future) for s in samples)
        if not_settled:
            self._count(**{counter: -not_settled, "num_samples_cancelled": not_settled})
        self._leave(len(samples))

    def _cancelled(self, count: int) -> None:
        if count:
            self._count(num_samples_cancelled=count)
            self._leave(count)

    def _leave(self, count: int) -> None:
        with self._lock:
            self._num_in_flight -= count
            if self._num_in_flight == 0:
                self._idle.set()
