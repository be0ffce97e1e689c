"""`flowrl serve`'s app on loopback with a tiny model: rollouts equal the in-process engine's, the
OpenAI client gets images, 300 concurrent requests all come back once and share forwards, bad
requests get a 4xx naming the field while the server keeps serving, pause holds requests, a client
that goes away cancels its samples, and nothing listens beyond loopback."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from rollout_server_helpers import ADMIN, LIMITS, MODEL_NAME, SAMPLING, serving

import flowrl.engine
from flowrl.engine.api import wait_all
from flowrl.server import wire

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serve_load  # noqa: E402


def _rollouts(client: httpx.Client, prompt, n: int, params) -> list:
    response = client.post(wire.ROLLOUTS_PATH, json=wire.rollout_request(prompt, n, params))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == wire.ROLLOUTS_MEDIA_TYPE
    return wire.decode_outputs(response.content)


def _assert_equal_outputs(remote, local, atol: float = 0.0) -> None:
    assert len(remote) == len(local)
    for a, b in zip(remote, local):
        assert (a.prompt, a.seed, a.sde_window, a.transition_spec, a.policy_version) == (
            b.prompt,
            b.seed,
            b.sde_window,
            b.transition_spec,
            b.policy_version,
        )
        for name in ("image", "all_latents", "all_log_probs", "sigmas", "next_sigmas", "prompt_embeds"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize(
    "params",
    [
        SAMPLING.replace(seed=5, sde_window_size=1),
        SAMPLING.replace(seed=9, guidance_scale=3.0, negative_prompt="blurry"),
        SAMPLING.replace(seed=2, noise_level=0.0, logprobs=False, sde_type="cps"),
    ],
    ids=["sde-window", "cfg", "ode"],
)
def test_rollouts_equal_the_in_process_engine(served, params):
    with served.client() as client:
        remote = _rollouts(client, "a red cube", 3, params)
        _assert_equal_outputs(remote, served.engine.generate_batched("a red cube", 3, params))
        if params.guidance_scale > 1:
            assert all(o.negative_prompt_embeds is not None for o in remote)
        # Several prompts, one sample each: engine.generate([...]) (prompt i gets seed + i).
        prompts = ["a", "b c", "d"]
        remote = _rollouts(client, prompts, 1, params)
        _assert_equal_outputs(remote, served.engine.generate(prompts, params), atol=1e-6)
        # Several prompts, n each: prompt i, sample j gets seed + i * n + j, one window per prompt,
        # queued together as engine.submit_many queues them.
        remote = _rollouts(client, ["x", "y"], 2, params)
        assert [o.seed for o in remote] == [params.seed + k for k in range(4)]
        _assert_equal_outputs(remote, wait_all(served.engine.submit_many(["x", "y"], params, 2)))
        second = served.engine.generate_batched("y", 2, params.replace(seed=params.seed + 2))
        assert [o.sde_window for o in remote[2:]] == [o.sde_window for o in second]


def test_openai_client_generates_images(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    assert [model.id for model in client.models.list()] == [MODEL_NAME]
    result = client.images.generate(
        model=MODEL_NAME,
        prompt="a lighthouse",
        n=2,
        size="32x48",
        response_format="b64_json",
        extra_body={"seed": 4, "num_inference_steps": 2},
    )
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d.b64_json)))) for d in result.data]
    params = served.app.state.service.defaults.images.replace(width=32, height=48, num_inference_steps=2, seed=4)
    local = served.engine.generate_batched("a lighthouse", 2, params)
    for image, output in zip(images, local, strict=True):
        assert image.shape == (48, 32, 3)
        np.testing.assert_array_equal(image, output.image.permute(1, 2, 0).numpy())
    with pytest.raises(openai.BadRequestError, match="size"):
        client.images.generate(model=MODEL_NAME, prompt="x", size="33x32")
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.images.generate(model="dall-e-3", prompt="x")


def test_300_concurrent_requests_come_back_once_and_share_forwards(served):
    params = SAMPLING.replace(num_inference_steps=2, seed=10_000)
    result = serve_load.run_load(served.url, num_requests=300, params=params)
    assert result["errors"] == []
    assert result["num_ok"] == 300 and result["missing_seeds"] == [] and result["duplicate_seeds"] == []
    assert result["mean_rows_per_forward"] > 1
    assert result["p99_latency_s"] >= result["p50_latency_s"] > 0
    report = serve_load._report(result)
    assert "p50" in report and "rows per forward" in report


BIG_PROMPT = "word " * 20_000  # over the tests' 64 KiB body limit


@pytest.mark.parametrize(
    "path, request_kwargs, status, param, fragment",
    [
        (wire.ROLLOUTS_PATH, dict(content=b"{not json"), 400, None, "not valid JSON"),
        (wire.ROLLOUTS_PATH, dict(content=b"[" * 30_000 + b"]" * 30_000), 400, None, "nested too deeply"),
        (wire.ROLLOUTS_PATH, dict(json=["a list"]), 400, None, "must be a JSON object"),
        (wire.ROLLOUTS_PATH, dict(json={"prompt": 7}), 400, "prompt", "must be a string"),
        (wire.ROLLOUTS_PATH, dict(json={"prompt": []}), 400, "prompt", "non-empty list"),
        (
            wire.ROLLOUTS_PATH,
            dict(json={"prompt": "x", "num_outputs_per_prompt": 0}),
            400,
            "num_outputs_per_prompt",
            ">= 1",
        ),
        (
            wire.ROLLOUTS_PATH,
            dict(json={"prompt": "x", "num_outputs_per_prompt": "2"}),
            400,
            "num_outputs_per_prompt",
            "",
        ),
        (
            wire.ROLLOUTS_PATH,
            dict(json={"prompt": "x", "num_outputs_per_prompt": 17}),
            413,
            "num_outputs_per_prompt",
            "--max-samples-per-request",
        ),
        (
            wire.ROLLOUTS_PATH,
            dict(json={"prompt": ["a"] * 9, "num_outputs_per_prompt": 2}),
            413,
            "num_outputs_per_prompt",
            "9 prompts",
        ),
        (wire.ROLLOUTS_PATH, dict(json={"prompt": "x", "extra": 1}), 400, "extra", "not supported"),
        (
            wire.ROLLOUTS_PATH,
            dict(json={"prompt": "x", "sampling_params": {"steps": 3}}),
            400,
            "sampling_params",
            "unknown fields",
        ),
        (
            wire.ROLLOUTS_PATH,
            dict(json={"prompt": "x", "sampling_params": {"height": 40}}),
            400,
            "height",
            "multiple of 16",
        ),
        (
            wire.ROLLOUTS_PATH,
            dict(json={"prompt": "x", "sampling_params": {"height": "32"}}),
            400,
            "height",
            "positive integer",
        ),
        (
            wire.ROLLOUTS_PATH,
            dict(json={"prompt": "x", "sampling_params": {"num_inference_steps": 0}}),
            400,
            "num_inference_steps",
            "",
        ),
        (
            wire.ROLLOUTS_PATH,
            dict(json={"prompt": "x", "sampling_params": {"sde_type": "ode"}}),
            400,
            "sde_type",
            "unknown",
        ),
        (wire.ROLLOUTS_PATH, dict(json={"prompt": BIG_PROMPT}), 413, None, "--max-body-mb"),
        (wire.IMAGES_PATH, dict(json={"prompt": "x", "n": 0}), 400, "n", ">= 1"),
        (wire.IMAGES_PATH, dict(json={"prompt": "x", "n": 100}), 413, "n", "--max-samples-per-request"),
        (wire.IMAGES_PATH, dict(json={"prompt": ""}), 400, "prompt", "non-empty"),
        (wire.IMAGES_PATH, dict(json={"prompt": "x", "size": "big"}), 400, "size", "WIDTHxHEIGHT"),
        (wire.IMAGES_PATH, dict(json={"prompt": "x", "response_format": "url"}), 400, "response_format", "b64_json"),
        (wire.IMAGES_PATH, dict(json={"prompt": "x", "quality": "hd"}), 400, "quality", "not supported"),
        (wire.IMAGES_PATH, dict(json={"prompt": "x", "model": "other"}), 404, "model", "not served here"),
    ],
)
def test_bad_requests_get_4xx_naming_the_field_and_the_server_keeps_serving(
    served, path, request_kwargs, status, param, fragment
):
    before = served.engine.stats()["num_samples_finished"]
    with served.client() as client:
        response = client.post(path, headers={"content-type": "application/json"}, **request_kwargs)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param and fragment in error["message"]
        assert error["type"] == "invalid_request_error"
        assert served.engine.stats()["num_samples_finished"] == before  # nothing reached the engine
        assert len(_rollouts(client, "still serving", 1, SAMPLING.replace(seed=1))) == 1


def test_health_stats_and_metrics(served):
    with served.client() as client:
        _rollouts(client, "metrics", 4, SAMPLING.replace(seed=3))
        health = client.get(wire.HEALTH_PATH).json()
        assert health["status"] == "ok" and health["model"] == MODEL_NAME and health["size_multiple"] == 16
        stats = wire.stats_from_json(client.get(wire.STATS_PATH).json())
        assert stats["num_rows"] == sum(rows * count for rows, count in stats["rows_per_forward_hist"].items())
        families = {f.name: f for f in text_string_to_metric_families(client.get(wire.METRICS_PATH).text)}
    rows = {s.name: s for s in families["flowrl_rows_per_forward"].samples if s.labels.get("le") in (None, "+Inf")}
    assert rows["flowrl_rows_per_forward_count"].value >= stats["num_forwards"] > 0
    assert families["flowrl_forwards"].samples[0].value >= stats["num_forwards"]
    for name in ("flowrl_queue_depth", "flowrl_samples_in_flight", "flowrl_images_per_second", "flowrl_policy_version"):
        assert name in families, name
    latency = [s for s in families["flowrl_request_latency_seconds"].samples if s.name.endswith("_count")]
    assert any(s.labels["endpoint"] == wire.ROLLOUTS_PATH and s.value > 0 for s in latency)


def test_pause_holds_requests_until_resume(served):
    with served.client() as client:
        assert client.post(wire.PAUSE_PATH, headers=ADMIN).json()["paused"] is True
        answers = []
        thread = threading.Thread(
            target=lambda: answers.append(_rollouts(served.client(), "held", 2, SAMPLING.replace(seed=8)))
        )
        try:
            thread.start()
            time.sleep(0.5)
            assert not answers and client.get(wire.HEALTH_PATH).json()["status"] == "paused"
            metrics = {f.name: f for f in text_string_to_metric_families(client.get(wire.METRICS_PATH).text)}
            assert metrics["flowrl_queue_depth"].samples[0].value == 2
        finally:
            assert client.post(wire.RESUME_PATH, headers=ADMIN).json()["paused"] is False
            thread.join(timeout=60)
        assert len(answers) == 1 and [o.seed for o in answers[0]] == [8, 9]


@pytest.mark.skipif(
    "EngineClosedError" not in flowrl.engine.__all__, reason="needs the engine's cancellation support (future.cancel)"
)
def test_a_client_that_goes_away_cancels_its_samples(served):
    heavy = SAMPLING.replace(num_inference_steps=400, seed=1)
    finished = served.engine.stats()["num_samples_finished"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(served.url + wire.ROLLOUTS_PATH, json=wire.rollout_request("slow", 8, heavy), timeout=1.0)
    assert served.engine.wait_until_idle(timeout=30)  # long before 8 x 400 steps could finish
    assert served.engine.stats()["num_samples_finished"] == finished
    with served.client() as client:
        assert served.app.state.service.admission.num_in_flight == 0
        assert len(_rollouts(client, "after", 1, SAMPLING.replace(seed=1))) == 1


def _listening_sockets_of_this_process() -> list[str]:
    """Local addresses of this process's listening TCP sockets (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addresses.append(fields[1])
    return addresses


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_nothing_listens_beyond_loopback(served):
    addresses = _listening_sockets_of_this_process()
    assert addresses, "the test server should be listening"
    loopback = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1 and ::1 in /proc's hex
    assert all(address.startswith(loopback) for address in addresses), addresses
    assert json.loads(json.dumps(served.url)).startswith("http://127.0.0.1:")


def test_a_full_server_answers_503_and_serves_again(tiny_sd3_path):
    limits = dataclasses.replace(LIMITS, max_queued_samples=3)
    with serving(tiny_sd3_path, limits=limits) as server, server.client() as client:
        assert client.post(wire.PAUSE_PATH, headers=ADMIN).status_code == 200
        held = threading.Thread(target=lambda: _rollouts(server.client(), "held", 2, SAMPLING.replace(seed=1)))
        held.start()
        deadline = time.monotonic() + 30
        while server.app.state.service.admission.num_waiting < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        response = client.post(wire.ROLLOUTS_PATH, json=wire.rollout_request("more", 2, SAMPLING.replace(seed=3)))
        assert response.status_code == 503 and "--max-queued-samples" in response.json()["error"]["message"]
        client.post(wire.RESUME_PATH, headers=ADMIN)
        held.join(timeout=60)
        assert len(_rollouts(client, "more", 2, SAMPLING.replace(seed=3))) == 2
