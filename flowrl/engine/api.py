"""The engine's calling conventions, one home for every engine-like class.

`EngineAPI` derives `generate`, `generate_batched`, their async twins and `submit` from the two
methods an engine implements: `submit_batched(prompt, n, params) -> list[Future]` (N samples of
one prompt, sample j with seed + j) and `submit_many(prompts, params, n=1) -> list[Future]` (N
samples per prompt, queued together, prompt i's sample j with seed + i * N + j).
`flowrl.engine.DiffusionEngine` (in process) and `flowrl.client.RemoteEngine` (a server) both use
it, so callers drive either the same way.

An interrupted wait (an error, KeyboardInterrupt, a cancelled coroutine) cancels the samples still
in flight instead of leaving them running for nobody.

What every engine raises, whichever side of a wire it is on: `EngineClosedError` once it no longer
serves (its requests in flight fail with it, new ones are refused), and a ValueError naming the
field for a bad request; `check_prompts`, `check_num_outputs_per_prompt` and `request_params` are
the checks that need no model (an engine adds its model's: `SamplingParams.validate` with the
model's limits). `settle` resolves a sample's future whatever its caller did to it meanwhile. It
knows nothing about how samples are made.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, InvalidStateError

from flowrl.sampling_params import SamplingParams


class EngineClosedError(RuntimeError):
    """The engine no longer serves (shut down, its thread died, or a remote engine's client was
    closed): requests in flight failed with it, new ones are refused."""


def check_prompts(prompts) -> None:
    """`submit_many`'s prompts: a non-empty list (each prompt is checked by `request_params`)."""
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"prompts={prompts!r} must be a non-empty list of strings")


def check_num_outputs_per_prompt(num_outputs_per_prompt) -> None:
    if (
        isinstance(num_outputs_per_prompt, bool)
        or not isinstance(num_outputs_per_prompt, int)
        or num_outputs_per_prompt < 1
    ):
        raise ValueError(
            f"num_outputs_per_prompt={num_outputs_per_prompt!r} must be an integer >= 1 "
            "(the number of samples to generate for this prompt)"
        )


def request_params(prompt, sampling_params) -> SamplingParams:
    """The request's SamplingParams (the defaults for None) once `prompt` is a string and
    `sampling_params` a SamplingParams; not yet validated."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt={prompt!r} must be a string")
    params = sampling_params if sampling_params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params={params!r} must be a flowrl SamplingParams (or None for the defaults)")
    return params


def settle(future: Future, result=None, error: BaseException | None = None) -> bool:
    """Resolve `future` with `result` (or fail it with `error`) unless its caller already cancelled
    or resolved it; True when it was settled here."""
    if future.done():
        return False
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:  # cancelled by its caller between the check and now
        return False
    return True


def wait_all(futures: list[Future]) -> list:
    """Every future's result; if the wait is interrupted, the unfinished ones are cancelled."""
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise


class EngineAPI:
    """generate / generate_batched / async twins / submit over submit_batched and submit_many."""

    supports_batched_generation = True
    is_in_process = False  # True for an engine of this process (DiffusionEngine), False behind a wire

    def submit_batched(self, prompt: str, num_outputs_per_prompt: int, sampling_params=None) -> list[Future]:
        raise NotImplementedError

    def submit_many(self, prompts: list[str], sampling_params=None, num_outputs_per_prompt: int = 1) -> list[Future]:
        raise NotImplementedError

    def generate(self, prompt: str | list[str], sampling_params: SamplingParams | None = None):
        """One sample for a prompt (a DiffusionOutput), or one per prompt for a list (sample i
        uses seed + i), all in flight at once."""
        if isinstance(prompt, list):
            return wait_all(self.submit_many(prompt, sampling_params))
        return wait_all([self.submit(prompt, sampling_params)])[0]

    def generate_batched(self, prompt: str, num_outputs_per_prompt: int, sampling_params: SamplingParams | None = None):
        """N samples of one prompt from shared forwards; sample j uses seed + j."""
        return wait_all(self.submit_batched(prompt, num_outputs_per_prompt, sampling_params))

    async def generate_async(self, prompt: str, sampling_params: SamplingParams | None = None):
        return (await self.generate_batched_async(prompt, 1, sampling_params))[0]

    async def generate_batched_async(
        self, prompt: str, num_outputs_per_prompt: int, sampling_params: SamplingParams | None = None
    ):
        futures = self.submit_batched(prompt, num_outputs_per_prompt, sampling_params)
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except BaseException:  # one failed, or the coroutine was cancelled: the rest are not wanted
            for f in futures:
                f.cancel()
            raise

    def submit(self, prompt: str, sampling_params: SamplingParams | None = None) -> Future:
        return self.submit_batched(prompt, 1, sampling_params)[0]
