"""Reward service + HTTP client: round trips equal the local reward, 4xx for malformed
requests, remote failures re-raised, and bounded retries with backoff then a clear error."""

from __future__ import annotations

import base64
import socket

import httpx
import numpy as np
import pytest

from flowrl.rewards import (
    RewardError,
    RowwiseReward,
    build_reward,
    register_reward,
    unregister_reward,
)
from flowrl.rewards.http_client import HttpReward, encode_png, encode_png_base64
from flowrl.server.http import serve_in_background
from flowrl.server.reward_app import create_reward_app
from flowrl.server.score_request import ServerLimits


class FailOnMetadata(RowwiseReward):
    """Test reward: metadata["value"], failing on rows with metadata["fail"]."""

    name = "fail_on_metadata"

    def score_row(self, image_hwc, prompt, metadata):
        if metadata.get("fail"):
            raise RuntimeError("asked to fail")
        return float(metadata["value"])


@pytest.fixture(scope="module")
def servers():
    """Two live services on 127.0.0.1 (free ports): a multi-reward and a required failing reward."""
    register_reward("fail_on_metadata", FailOnMetadata, overwrite=True)
    multi = build_reward(
        {
            "name": "multi",
            "options": {
                "components": [
                    {"name": "jpeg_incompressibility"},
                    {"name": "fail_on_metadata", "optional": True},
                ]
            },
        }
    )
    unregister_reward("fail_on_metadata")
    failing = FailOnMetadata()
    with (
        serve_in_background(create_reward_app(multi, ServerLimits(max_batch_size=8))) as multi_url,
        serve_in_background(create_reward_app(failing)) as failing_url,
    ):
        yield {"multi": (multi, multi_url), "failing": (failing, failing_url)}


def _batch(num_rows: int = 3):
    images = np.random.default_rng(0).integers(0, 256, (num_rows, 3, 20, 28), dtype=np.uint8)
    images[0] = 90
    return images, [f"p{i}" for i in range(num_rows)], [{"value": float(i)} for i in range(num_rows)]


@pytest.mark.parametrize("transport", ["json", "multipart"])
def test_round_trip_equals_local_reward(servers, transport):
    local, url = servers["multi"]
    assert url.startswith("http://127.0.0.1:")
    images, prompts, meta = _batch()
    meta[1] = {"fail": True}  # optional component fails on row 1: NaN travels as null and back
    remote = HttpReward(url, transport=transport)
    total, components = remote.score_with_components(images, prompts, meta)
    local_total, local_components = local.score_with_components(images, prompts, meta)
    np.testing.assert_array_equal(total, local_total)
    assert np.isnan(total[1]) and np.isfinite(total[[0, 2]]).all()
    assert set(components) == set(local_components)
    for name in components:
        np.testing.assert_array_equal(components[name], local_components[name])


def test_remote_reward_failure_is_a_reward_error_naming_remote_reward_and_row(servers):
    _, url = servers["failing"]
    images, prompts, meta = _batch()
    meta[2] = {"fail": True}
    calls = []
    reward = HttpReward(url, sleep=calls.append)
    with pytest.raises(RewardError) as caught:
        reward(images, prompts, meta)
    assert caught.value.row_index == 2
    assert "fail_on_metadata" in str(caught.value) and "asked to fail" in str(caught.value)
    assert calls == []  # not retried


def _post(url, **kwargs):
    return httpx.post(url + "/score", timeout=10, **kwargs)


def test_malformed_requests_get_4xx_and_server_stays_up(servers):
    _, url = servers["multi"]
    png = encode_png_base64(np.zeros((3, 8, 8), np.uint8))
    rgba = np.zeros((8, 8, 4), np.uint8)
    from io import BytesIO

    from PIL import Image

    buffer = BytesIO()
    Image.fromarray(rgba).save(buffer, format="PNG")
    cases = [
        (dict(content=b"{not json", headers={"content-type": "application/json"}), 400, "not valid JSON"),
        (dict(json=[1, 2]), 400, "object"),
        (dict(json={"images": []}), 400, "images"),
        (dict(json={"images": ["%%%"]}), 400, "base64"),
        (dict(json={"images": [base64.b64encode(b"not a png").decode()]}), 400, "readable PNG"),
        (dict(json={"images": [base64.b64encode(buffer.getvalue()).decode()]}), 400, "RGBA"),
        (dict(json={"images": [png], "prompts": ["a", "b"]}), 400, "prompts"),
        (dict(json={"images": [png], "metadata": ["x"]}), 400, "metadata"),
        (dict(json={"images": [png, encode_png_base64(np.zeros((3, 9, 8), np.uint8))]}), 400, "same size"),
        (dict(json={"images": [png] * 9}), 413, "at most 8"),
        (dict(content=b"x", headers={"content-type": "text/plain"}), 415, "Content-Type"),
        (dict(content=b"x", headers={"content-type": "multipart/form-data"}), 400, "boundary"),
        (
            dict(files=[("images", ("0.png", b"\x89PNG", "image/png"))], data={"request": "{}"}),
            400,
            "images[0]",
        ),
        (
            dict(files=[("images", ("0.png", encode_png(np.zeros((3, 8, 8), np.uint8)), "image/png"))]),
            400,
            "'request'",
        ),
    ]
    for kwargs, status, fragment in cases:
        response = _post(url, **kwargs)
        assert response.status_code == status, (kwargs, response.text)
        assert fragment in response.json()["detail"], response.text
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok", "reward": "multi"}


def test_retries_with_exponential_backoff_on_retryable_statuses():
    answers = iter(
        [
            httpx.Response(503),
            httpx.Response(408),
            httpx.Response(429, headers={"retry-after": "0.25"}),
            httpx.Response(200, json={"scores": [0.5], "components": {"x": [0.5]}}),
        ]
    )
    requests = []

    def handler(request):
        requests.append(request)
        return next(answers)

    sleeps = []
    reward = HttpReward(
        "http://reward.test",
        max_attempts=4,
        backoff_s=0.1,
        sleep=sleeps.append,
        client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    scores = reward(np.zeros((1, 3, 8, 8), np.uint8), [""], [{}])
    assert scores.tolist() == [0.5] and len(requests) == 4
    assert sleeps == [0.1, 0.2, 0.25]  # doubling, then the server's Retry-After


def test_client_errors_are_not_retried():
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(400, json={"error": "bad_request", "detail": "field 'prompts' ..."})

    reward = HttpReward(
        "http://reward.test",
        client=httpx.Client(transport=httpx.MockTransport(handler)),
        sleep=lambda s: None,
    )
    with pytest.raises(RewardError, match=r"HTTP 400.*not retried"):
        reward(np.zeros((1, 3, 8, 8), np.uint8), [""], [{}])
    assert len(calls) == 1


def test_server_down_retries_then_names_url_and_attempts():
    with socket.socket() as probe:  # a port that nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sleeps = []
    reward = HttpReward(f"http://127.0.0.1:{port}", max_attempts=3, backoff_s=0.01, timeout_s=2, sleep=sleeps.append)
    with pytest.raises(RewardError) as caught:
        reward(np.zeros((1, 3, 8, 8), np.uint8), [""], [{}])
    message = str(caught.value)
    assert f"http://127.0.0.1:{port}/score" in message and "3 attempts" in message and "ConnectError" in message
    assert sleeps == [0.01, 0.02]


def test_http_options_are_checked():
    with pytest.raises(ValueError, match="url"):
        build_reward({"name": "http", "options": {"url": "127.0.0.1:8000"}})
    with pytest.raises(ValueError, match="transport"):
        build_reward({"name": "http", "options": {"url": "http://x", "transport": "pickle"}})
