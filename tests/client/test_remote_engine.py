"""RemoteEngine against a real `flowrl serve` app on 127.0.0.1: its outputs equal the in-process
engine's for the same seeds (generate, generate_batched, the async twins, submit_many with one or
more samples per prompt), stats count the server's forwards, a bad request raises the ValueError
the in-process engine raises, a closed client fails and refuses requests with EngineClosedError as
a shut-down engine does, and a server that is down or refuses a request gives a clear error naming
it. Nothing listens beyond loopback."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
import torch

from flowrl.client import RemoteEngine, RemoteRequestError, ServerUnavailableError
from flowrl.engine import DiffusionEngine, EngineClosedError, SamplingParams
from flowrl.rollout.balancer import ReplicaDownError
from flowrl.sampling_params import MAX_SEED
from flowrl.server import wire

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
    # Several prompts, two samples each, in one request: prompt i's sample j with seed + 2i + j.
    futures = remote.submit_many(["a cat", "a dog"], PARAMS, 2)
    local = [f.result() for f in local_engine.submit_many(["a cat", "a dog"], PARAMS, 2)]
    assert [o.seed for o in local] == [PARAMS.seed + k for k in range(4)]
    assert_same_outputs([f.result() for f in futures], local)
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


BAD_REQUESTS = {
    "n=0": lambda e: e.generate_batched("a cat", 0, PARAMS),
    "n=True": lambda e: e.generate_batched("a cat", True, PARAMS),
    "prompt not a string": lambda e: e.generate(7, PARAMS),
    "no prompts": lambda e: e.generate([], PARAMS),
    "a prompt of the list not a string": lambda e: e.generate(["a cat", None], PARAMS),
    "params not SamplingParams": lambda e: e.generate("a cat", {"height": 64}),
    "steps=0": lambda e: e.generate("a cat", PARAMS.replace(num_inference_steps=0)),
    "NaN guidance": lambda e: e.generate("a cat", PARAMS.replace(guidance_scale=float("nan"))),
    "seeds past MAX_SEED": lambda e: e.generate_batched("a cat", 3, PARAMS.replace(seed=MAX_SEED - 1)),
    # the model's own limits: the server's engine refuses them (400), with the engine's message
    "height not a multiple of 16": lambda e: e.generate("a cat", PARAMS.replace(height=17)),
    "true_cfg_scale on a CFG model": lambda e: e.generate("a cat", PARAMS.replace(true_cfg_scale=4.0)),
}


def wait_for_queue_depth(url: str, depth: int) -> None:
    deadline = time.monotonic() + 20
    while f"flowrl_queue_depth {float(depth)}" not in httpx.get(url + wire.METRICS_PATH).text:
        assert time.monotonic() < deadline, f"the server's queue depth never became {depth}"
        time.sleep(0.05)


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_bad_request_raises_the_engines_value_error(remote, local_engine, case):
    with pytest.raises(ValueError) as local:
        BAD_REQUESTS[case](local_engine)
    with pytest.raises(ValueError) as remote_error:
        BAD_REQUESTS[case](remote)
    assert str(local.value) in str(remote_error.value)


def test_close_fails_requests_in_flight_and_refuses_new_ones_with_engine_closed_error(rollout_servers, tiny_sd3_path):
    (url,) = rollout_servers(tiny_sd3_path, admin_token="secret")
    admin = {"Authorization": "Bearer secret"}
    assert httpx.post(url + wire.PAUSE_PATH, headers=admin).json()["paused"] is True  # requests wait at the gate
    client = RemoteEngine(url)
    futures = client.submit_batched("a cat", 2, PARAMS)
    wait_for_queue_depth(url, 2)  # the request waits on the server
    client.close()
    for future in futures:
        with pytest.raises(EngineClosedError, match="close"):
            future.result(timeout=10)
    with pytest.raises(EngineClosedError, match="new RemoteEngine"):
        client.submit_batched("a cat", 2, PARAMS)
    with pytest.raises(EngineClosedError):
        client.health()
    client.close()  # again: nothing happens
    wait_for_queue_depth(url, 0)  # the closed connection took the request off the server
    httpx.post(url + wire.RESUME_PATH, headers=admin)
    with RemoteEngine(url) as other:  # the server goes on serving
        assert len(other.generate_batched("a cat", 2, PARAMS)) == 2


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


def test_a_server_that_does_not_answer_in_time_is_unavailable_at_once():
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with RemoteEngine(url, timeout_s=0.5, max_attempts=3, backoff_s=5.0) as client:
            t0 = time.perf_counter()
            with pytest.raises(
                ServerUnavailableError, match=rf"{url} is unavailable.*after 1 attempt .*no answer in time"
            ):
                client.generate_batched("a cat", 2, PARAMS)
            assert time.perf_counter() - t0 < 4  # a slow server is not asked again (a retry would wait 5 s first)


def test_bad_arguments():
    with pytest.raises(ValueError, match="http://"):
        RemoteEngine("127.0.0.1:8000")
    with pytest.raises(ValueError, match="max_attempts"):
        RemoteEngine("http://127.0.0.1:1", max_attempts=0)


def test_an_upload_is_encoded_once_and_its_checksum_is_the_tensors():
    """flowrl.client.weights: the body decodes to the same tensors (LoRA settings in its metadata),
    and the checksum is that of the tensors, whatever their memory layout."""
    import torch

    from flowrl.client.weights import WeightsUpload
    from flowrl.server import wire

    state = {"a.lora_A.weight": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    lora = {"rank": 2, "alpha": 4.0, "target_modules": ["to_q"], "dropout": 0.0}
    upload = WeightsUpload.of(state, lora)
    assert upload.kind == "lora" and WeightsUpload.of(state).kind == "full"
    assert upload.sha256 == wire.weights_sha256(
        {"b": torch.ones(3), "a.lora_A.weight": state["a.lora_A.weight"].t().t()}
    )
    assert upload.sha256 != WeightsUpload.of({**state, "b": torch.zeros(3)}).sha256
