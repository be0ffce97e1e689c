"""RayEngine: an EngineActor behind the engine's API, for the balancer and the agent loop.

`RayEngine(actor)` has the methods of `flowrl.engine.DiffusionEngine` that callers use
(`submit` / `submit_batched` / `submit_many` returning `concurrent.futures.Future`s, `generate`,
`generate_batched`, their async twins, `stats`), as `flowrl.client.RemoteEngine` has them for a
server: each call is one remote call of the actor, whose samples come back together (Ray's
`ObjectRef.future()`). The checks that need no model are made here, before anything is sent.

An actor that died, cannot be reached, whose engine stopped, or that takes longer than `timeout_s`
for a call raises `ActorDownError` (a ReplicaDownError: the balancer re-sends the call to another
actor); a bad request raises the engine's ValueError. `push_weights` sends a WeightsUpload through
Ray's object store (`StoredUpload`: put once, read by every actor) and checks that the actor then
serves that version with the upload's checksum, as `RemoteEngine.push_weights` does.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import ray
import ray.exceptions

from flowrl.client.errors import ReplicaDownError
from flowrl.client.weights import WeightsUpload
from flowrl.engine.api import (
    EngineAPI,
    EngineClosedError,
    check_num_outputs_per_prompt,
    check_prompts,
    request_params,
    settle,
)
from flowrl.server import wire


class ActorDownError(ReplicaDownError):
    """An engine actor could not serve a call (dead, unreachable, its engine stopped, too slow)."""

    def __init__(self, name: str, what: str, error: object):
        self.name = name
        super().__init__(f"engine actor {name}: {what} failed ({error}); check the actor on the Ray cluster")


@dataclass(frozen=True)
class StoredUpload:
    """A WeightsUpload put once in Ray's object store. body: the ObjectRef of its bytes;
    file_sha256: the bytes' checksum (checked on arrival); sha256: the tensors' (`wire.weights_sha256`,
    checked once live); kind: "lora" or "full"."""

    body: ray.ObjectRef
    file_sha256: str
    sha256: str
    kind: str

    @classmethod
    def of(cls, upload: WeightsUpload) -> "StoredUpload":
        return cls(ray.put(upload.body), wire.file_sha256(upload.body), upload.sha256, upload.kind)


class RayEngine(EngineAPI):
    """An EngineActor's handle behind the engine's API (module docstring). name: how messages name
    the actor (default: its actor id); timeout_s: the longest a call may take (None: no limit)."""

    is_in_process = False  # a call's samples come back together

    def __init__(self, actor, name: str | None = None, timeout_s: float | None = None):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 (seconds), or None for no limit")
        self.actor = actor
        self.name = name or actor._actor_id.hex()[:12]
        self.timeout_s = timeout_s
        self._pending: set[ray.ObjectRef] = set()
        self._is_closed = False
        self._lock = threading.Lock()

    # --- the engine's API (generate, generate_batched, async twins, submit: flowrl.engine.api) ---
    def submit_batched(self, prompt: str, num_outputs_per_prompt: int, sampling_params=None) -> list[Future]:
        check_num_outputs_per_prompt(num_outputs_per_prompt)
        params = request_params(prompt, sampling_params).validate(num_samples=num_outputs_per_prompt)
        return self._submit(self.actor.generate_batched, num_outputs_per_prompt, prompt, num_outputs_per_prompt, params)

    def submit_many(self, prompts: list[str], sampling_params=None, num_outputs_per_prompt: int = 1) -> list[Future]:
        check_prompts(prompts)
        check_num_outputs_per_prompt(num_outputs_per_prompt)
        num_samples = len(prompts) * num_outputs_per_prompt
        for prompt in prompts:
            params = request_params(prompt, sampling_params).validate(num_samples=num_samples)
        return self._submit(self.actor.submit_many, num_samples, prompts, params, num_outputs_per_prompt)

    def _submit(self, method, num_samples: int, *args) -> list[Future]:
        with self._lock:
            if self._is_closed:
                raise EngineClosedError(f"RayEngine({self.name}) is closed; create a new one to generate again")
            ref = method.remote(*args)  # a dead actor's call fails through its ref, as a call in flight does
            self._pending.add(ref)
        futures = [Future() for _ in range(num_samples)]
        self._fan_out(ref, futures)
        return futures

    def _fan_out(self, ref: ray.ObjectRef, futures: list[Future]) -> None:
        """Resolve one future per sample from the call's ObjectRef; cancelling every sample's future
        cancels the call on the actor; past `timeout_s` the samples fail with ActorDownError."""
        timer = None
        if self.timeout_s is not None:
            late = ActorDownError(self.name, "a call", f"no answer in {self.timeout_s:g} s")
            timer = threading.Timer(self.timeout_s, self._expire, (ref, futures, late))
            timer.daemon = True
            timer.start()

        def resolved(done: Future) -> None:
            if timer is not None:
                timer.cancel()
            with self._lock:
                self._pending.discard(ref)
            if self._is_closed or done.cancelled():
                error, outputs = self._closed_error(), None
            else:
                error = self._translate(done.exception())
                outputs = None if error is not None else done.result()
            if outputs is not None and len(outputs) != len(futures):
                error = RuntimeError(f"engine actor {self.name} answered {len(outputs)} samples for {len(futures)}")
            for j, f in enumerate(futures):
                settle(f, None if error is not None else outputs[j], error)

        def sample_cancelled(_: Future) -> None:
            if all(f.cancelled() for f in futures):
                ray.cancel(ref)

        ref.future().add_done_callback(resolved)
        for f in futures:
            f.add_done_callback(sample_cancelled)

    @staticmethod
    def _expire(ref: ray.ObjectRef, futures: list[Future], error: ActorDownError) -> None:
        """A call past its time: its samples fail (the balancer re-sends them) and it leaves the actor."""
        for f in futures:
            settle(f, error=error)
        ray.cancel(ref)

    def _translate(self, error: BaseException | None) -> BaseException | None:
        """Ray's errors as the engine's callers know them: the actor down -> ActorDownError; the
        request's own errors (a bad request, a failed sample) pass as they are."""
        if isinstance(error, ray.exceptions.RayActorError):
            return ActorDownError(self.name, "a call", error)
        if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, EngineClosedError):
            return ActorDownError(self.name, "a call", f"its engine stopped: {error.cause}")
        return error

    def _closed_error(self) -> BaseException:
        return EngineClosedError(f"RayEngine({self.name}).close() was called while this call was in flight")

    # --- state and weights -------------------------------------------------------------------------
    def _get(self, what: str, ref):
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
            raise ActorDownError(self.name, what, error) from error

    def stats(self) -> dict:
        """The actor's engine.stats() (num_forwards, num_rows, mean_rows_per_forward, ...)."""
        return self._get("stats", self.actor.stats.remote())

    def reset_stats(self) -> None:
        self._get("reset_stats", self.actor.reset_stats.remote())

    def health(self) -> dict:
        return self._get("health", self.actor.health.remote())

    @property
    def policy_version(self) -> int:
        return int(self.health()["policy_version"])

    def weights_info(self) -> dict:
        return self._get("weights_info", self.actor.weights_info.remote())

    def push_weights(self, upload: WeightsUpload | StoredUpload, version: int) -> None:
        """Send `upload` (put in the object store first unless it is a StoredUpload) as policy
        `version`; the actor checks it as a server does, and it must then serve that version with
        the upload's checksum (a RuntimeError naming both if not)."""
        stored = upload if isinstance(upload, StoredUpload) else StoredUpload.of(upload)
        call = self.actor.load_weights.remote(stored.body, version, stored.kind, stored.file_sha256)
        info = self._get(f"the weights of version {version}", call)
        live = (int(info["policy_version"]), info["weights_sha256"])
        if live != (version, stored.sha256):
            raise RuntimeError(
                f"engine actor {self.name} serves version {live[0]} with weights_sha256 {live[1]}; "
                f"the trainer sent version {version} with {stored.sha256}"
            )

    # --- lifecycle -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel the calls in flight (they fail with EngineClosedError) and refuse new ones; the
        actor itself keeps running (whoever started it ends it)."""
        with self._lock:
            self._is_closed = True
            pending, self._pending = list(self._pending), set()
        for ref in pending:
            ray.cancel(ref)

    shutdown = close

    def __repr__(self) -> str:
        return f"RayEngine({self.name!r})"
