"""The reward server under hostile input: a 50 MB body, a PNG bomb, 10,000 images, deep JSON and
a wrong token each get a 4xx (413 where it fits) within bounded memory; /health answers while a
slow batch is scored; the client splits large batches and sends its token; bad flags exit 2."""

from __future__ import annotations

import contextlib
import gc
import re
import struct
import threading
import time
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest

from flowrl.rewards import RewardError, RowwiseReward, build_reward
from flowrl.rewards.http_client import TOKEN_ENV, HttpReward, encode_png, encode_png_base64
from flowrl.server.http import serve_in_background
from flowrl.server.reward_app import create_reward_app
from flowrl.server.score_request import ServerLimits

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
LIMITS = ServerLimits(
    max_body_bytes=4 * 2**20, max_batch_size=64, max_image_pixels=256 * 256, max_request_pixels=8 * 256 * 256
)
BOUND_MB = 40  # what any refused request below may cost the server; the inputs would cost 50 MB to 190 MB


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


@contextlib.contextmanager
def peak_memory_growth():
    """Yields a dict whose "mb" is, on exit, how far this process's peak RSS rose above its RSS at entry."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak) to the current RSS
    base, result = _status_kb("VmRSS"), {}
    yield result
    result["mb"] = (_status_kb("VmHWM") - base) / 1024


needs_proc = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS needs Linux /proc")


@pytest.fixture(scope="module")
def url():
    reward = build_reward("jpeg_incompressibility")
    with serve_in_background(create_reward_app(reward, LIMITS, token=TOKEN)) as base:
        # Warm up: the first request imports and allocates what every later one reuses.
        image = encode_png_base64(np.zeros((3, 16, 16), np.uint8))
        assert httpx.post(base + "/score", json={"images": [image]}, headers=AUTH, timeout=30).status_code == 200
        yield base


def _post(url, headers=AUTH, **kwargs):
    return httpx.post(url + "/score", headers=headers, timeout=60, **kwargs)


def _chunks(total: int, chunk: int = 2**20):
    yield b'{"images": ["'
    for _ in range(total // chunk):
        yield b"A" * chunk
    yield b'"]}'


def _png_bomb(width: int, height: int) -> bytes:
    """A complete, valid all-black RGB PNG: tiny on the wire, width*height*3 bytes once decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    compressor, row = zlib.compressobj(9), bytes(1 + 3 * width)
    pixels = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@needs_proc
@pytest.mark.parametrize(
    "case",
    ["50 MB body, streamed", "50 MB body, Content-Length", "PNG bomb", "10,000 images", "deep JSON", "deep metadata"],
)
def test_hostile_requests_get_4xx_within_bounded_memory(url, case):
    png = encode_png_base64(np.zeros((3, 8, 8), np.uint8))
    requests = {
        "50 MB body, streamed": (
            dict(content=_chunks(50 * 2**20), headers={**AUTH, "content-type": "application/json"}),
            413,
        ),
        "50 MB body, Content-Length": (
            dict(
                content=_chunks(50 * 2**20),
                headers={**AUTH, "content-type": "application/json", "content-length": str(50 * 2**20 + 16)},
            ),
            413,
        ),
        "PNG bomb": (None, 413),
        "10,000 images": (dict(json={"images": [png] * 10_000}), 413),
        "deep JSON": (dict(content=_deep(200_000), headers={**AUTH, "content-type": "application/json"}), 400),
        "deep metadata": (
            dict(
                content=b'{"images": ["' + png.encode() + b'"], "metadata": [{"a": ' + _deep(100_000) + b"}]}",
                headers={**AUTH, "content-type": "application/json"},
            ),
            400,
        ),
    }
    kwargs, status = requests[case]
    if case == "PNG bomb":  # 186 KB on the wire, 192 MB decoded (PIL's own bound would let it through)
        kwargs = dict(files=[("images", ("0.png", _png_bomb(8000, 8000), "image/png"))], data={"request": "{}"})
    headers = kwargs.pop("headers", AUTH)
    with peak_memory_growth() as growth:
        response = _post(url, headers=headers, **kwargs)
    assert response.status_code == status, response.text[:500]
    assert response.json()["error"] == "bad_request" and response.json()["detail"]
    assert growth["mb"] < BOUND_MB, (case, growth)
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_pixel_budgets_name_the_limit(url):
    big = encode_png_base64(np.zeros((3, 300, 300), np.uint8))
    response = _post(url, json={"images": [big]})
    assert response.status_code == 413 and "--max-image-pixels" in response.json()["detail"]
    many = [encode_png_base64(np.zeros((3, 256, 256), np.uint8))] * 9  # each fits, together over the budget
    response = _post(url, json={"images": many})
    assert response.status_code == 413 and "--max-request-pixels" in response.json()["detail"]


@needs_proc
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}])
def test_missing_or_wrong_token_is_401(url, headers):
    with peak_memory_growth() as growth:
        response = _post(url, headers=headers, content=_chunks(20 * 2**20))
    assert response.status_code == 401 and TOKEN_ENV in response.json()["detail"]
    assert growth["mb"] < BOUND_MB, growth


class SlowReward(RowwiseReward):
    name = "slow"

    def __init__(self):
        self.started = threading.Event()

    def score_row(self, image_hwc, prompt, metadata):
        self.started.set()
        time.sleep(3.0)
        return 0.0


def test_health_answers_while_a_slow_batch_is_scored():
    reward = SlowReward()
    with serve_in_background(create_reward_app(reward)) as base:
        image = encode_png_base64(np.zeros((3, 8, 8), np.uint8))
        worker = threading.Thread(target=lambda: httpx.post(base + "/score", json={"images": [image]}, timeout=30))
        worker.start()
        assert reward.started.wait(10)
        for _ in range(3):
            t0 = time.perf_counter()
            assert httpx.get(base + "/health", timeout=5).status_code == 200
            assert time.perf_counter() - t0 < 1.0
        worker.join()


class RowValue(RowwiseReward):
    """metadata["value"]; fails on rows with metadata["fail"]."""

    name = "row_value"

    def score_row(self, image_hwc, prompt, metadata):
        if metadata.get("fail"):
            raise RuntimeError("asked to fail")
        return float(metadata["value"])


def test_client_splits_large_batches_and_sends_its_token(monkeypatch):
    limits = ServerLimits(max_batch_size=4, max_body_bytes=2**20)
    with serve_in_background(create_reward_app(RowValue(), limits, token=TOKEN)) as base:
        images = np.random.default_rng(0).integers(0, 256, (10, 3, 16, 16), dtype=np.uint8)
        prompts, meta = [""] * 10, [{"value": float(i)} for i in range(10)]
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        for transport in ("json", "multipart"):
            remote = HttpReward(base, transport=transport, max_request_images=3)
            np.testing.assert_array_equal(remote(images, prompts, meta), np.arange(10.0))
        by_bytes = HttpReward(base, max_request_bytes=2 * len(encode_png_base64(images[0])))
        np.testing.assert_array_equal(by_bytes(images, prompts, meta), np.arange(10.0))
        meta[7] = {"fail": True}
        with pytest.raises(RewardError) as caught:
            HttpReward(base, max_request_images=3)(images, prompts, meta)
        assert caught.value.row_index == 7  # the batch's row, not the request's
        monkeypatch.delenv(TOKEN_ENV)
        with pytest.raises(RewardError, match=r"HTTP 401.*not retried"):
            HttpReward(base, sleep=lambda s: None)(images[:1], [""], [{"value": 0.0}])
        assert HttpReward(base, token=TOKEN)(images[:1], [""], [{"value": 2.0}]).tolist() == [2.0]


def test_client_options_are_checked():
    with pytest.raises(ValueError, match="max_request_images"):
        HttpReward("http://x", max_request_images=0)
    with pytest.raises(ValueError, match="limit max_body_bytes=0"):
        ServerLimits(max_body_bytes=0)


@pytest.mark.parametrize(
    "flags",
    [
        ["--port", "70000"],
        ["--port", "-1"],
        ["--max-body-mb", "0"],
        ["--max-batch-size", "0"],
        ["--max-connections", "0"],
        ["--scoring-threads", "0"],
        ["--scoring-threads", "many"],
    ],
)
def test_bad_server_flags_exit_2_with_one_line(flags, capsys):
    from flowrl.cli import main

    assert main(["reward-server", "--reward", "jpeg_incompressibility", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("flowrl reward-server: error:")
        and flags[0].lstrip("-") in err[0].replace("_", "-")
    ), err


def test_multipart_with_encoded_images_round_trips(url):
    images = np.random.default_rng(1).integers(0, 256, (2, 3, 16, 16), dtype=np.uint8)
    files = [("images", (f"{i}.png", encode_png(image), "image/png")) for i, image in enumerate(images)]
    response = _post(url, files=files, data={"request": '{"prompts": ["a", "b"]}'})
    assert response.status_code == 200 and len(response.json()["scores"]) == 2
