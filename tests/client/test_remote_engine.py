"""RemoteEngine against a real `flowrl serve` app on 127.0.0.1: its outputs equal the in-process
engine's for the same seeds (generate, generate_batched, the async twins, submit_many), stats
count the server's forwards, and a server that is down or refuses a request gives a clear error
naming it. Nothing listens beyond loopback."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from flowrl.client import RemoteEngine, RemoteRequestError, ServerUnavailableError
from flowrl.engine import DiffusionEngine, SamplingParams
from flowrl.rollout.balancer import ReplicaDownError

PARAMS = SamplingParams(height=64, width=64, num_inference_steps=4, noise_level=0.7, sde_window_size=2, seed=11)
TENSORS = ("image", "all_latents", "all_log_probs", "sigmas", "next_sigmas", "prompt_embeds", "prompt_embeds_mask")


@pytest.fixture(scope="module")
def local_engine(tiny_sd3_path):
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path)
    yield engine
    engine.shutdown()


@pytest.fixture
def remote(rollout_servers, tiny_sd3_path):
    (url,) = rollout_servers(tiny_sd3_path)
    with RemoteEngine(url) as client:
        yield client


def assert_same_outputs(remote_outputs, local_outputs):
    assert len(remote_outputs) == len(local_outputs)
    for a, b in zip(remote_outputs, local_outputs):
        assert (a.prompt, a.seed, a.sde_window, a.transition_spec) == (
            b.prompt,
            b.seed,
            b.sde_window,
            b.transition_spec,
        )
        for name in TENSORS:
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.shape == y.shape, name
            # uint8 images: the VAE decodes whichever samples finish together, so a pixel may round
            # the other way (one step), even between two in-process runs; float tensors within 1e-6.
            atol = 1 if name == "image" else 1e-6
            torch.testing.assert_close(x.float(), y.float(), atol=atol, rtol=0, msg=name)


def test_round_trip_equals_the_in_process_engine(remote, local_engine, check_loopback_only):
    assert_same_outputs(
        remote.generate_batched("a red cube", 3, PARAMS), local_engine.generate_batched("a red cube", 3, PARAMS)
    )
    assert_same_outputs([remote.generate("a cat", PARAMS)], [local_engine.generate("a cat", PARAMS)])
    prompts = ["a cat", "a dog", "a sign"]
    assert_same_outputs(remote.generate(prompts, PARAMS), local_engine.generate(prompts, PARAMS))
    # The async twins and the futures interface give the same samples.
    batched = asyncio.run(remote.generate_batched_async("a red cube", 2, PARAMS))
    assert_same_outputs(batched, local_engine.generate_batched("a red cube", 2, PARAMS))
    single = asyncio.run(remote.generate_async("a cat", PARAMS))
    assert_same_outputs([single], [local_engine.generate("a cat", PARAMS)])
    futures = remote.submit_batched("a red cube", 2, PARAMS)
    assert_same_outputs([f.result() for f in futures], local_engine.generate_batched("a red cube", 2, PARAMS))
    check_loopback_only()


def test_stats_count_the_servers_forwards(remote):
    remote.reset_stats()
    futures = [f for i in range(3) for f in remote.submit_batched(f"prompt {i}", 2, PARAMS.replace(seed=i))]
    [f.result() for f in futures]
    stats = remote.stats()
    assert stats["num_samples_finished"] == 6
    assert stats["num_forwards"] >= PARAMS.num_inference_steps
    assert stats["num_rows"] == sum(rows * count for rows, count in stats["rows_per_forward_hist"].items())
    assert stats["mean_rows_per_forward"] > 1  # concurrent requests shared forwards
    assert remote.health()["status"] == "ok" and remote.policy_version == 0


def test_a_refused_request_is_a_value_error_naming_the_server(remote):
    with pytest.raises(ValueError, match="multiple of 16"):
        remote.generate("a cat", PARAMS.replace(height=17))  # checked before anything is sent
    # A 4xx from the server (more samples than it takes per request): the request is wrong.
    with pytest.raises(RemoteRequestError, match=rf"{remote.url}.*HTTP 4\d\d") as info:
        remote.generate_batched("a cat", 100_000, PARAMS)
    assert isinstance(info.value, ValueError)
    assert remote.health()["status"] == "ok"  # still serving


def test_a_server_that_is_down_is_named_after_bounded_retries():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with RemoteEngine(url, max_attempts=2, backoff_s=0.01, connect_timeout_s=1.0) as client:
        t0 = time.perf_counter()
        future = client.submit_batched("a cat", 2, PARAMS)[0]
        with pytest.raises(
            ServerUnavailableError, match=rf"{url} is unavailable.*after 2 attempts.*flowrl serve"
        ) as info:
            future.result(timeout=30)
        assert isinstance(info.value, ReplicaDownError)  # a balancer re-sends such requests elsewhere
        assert time.perf_counter() - t0 < 10
        with pytest.raises(ServerUnavailableError, match=url):
            client.health()


def test_bad_arguments():
    with pytest.raises(ValueError, match="http://"):
        RemoteEngine("127.0.0.1:8000")
    with pytest.raises(ValueError, match="max_attempts"):
        RemoteEngine("http://127.0.0.1:1", max_attempts=0)
