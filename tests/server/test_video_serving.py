"""A tiny Wan model served: /v1/rollouts returns videos (the engine's own samples, frame axis
included), /v1/videos/generations returns mp4 whose frames are the samples' frames (H.264,
within a few levels), a bad frame count is a 400 naming the field and the rule."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from rollout_server_helpers import LIMITS

from flowrl.data.video_files import decode_mp4, frame_strip
from flowrl.engine import DiffusionEngine, SamplingParams
from flowrl.server import wire
from flowrl.server.http import serve_in_background
from flowrl.server.rollout_app import ServedDefaults, create_rollout_app

VIDEO = SamplingParams(height=32, width=32, num_frames=5, num_inference_steps=3, noise_level=0.7, seed=5)


@pytest.fixture(scope="module")
def served_wan(tmp_path_factory):
    import httpx

    from flowrl.models.debug.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint("wan", tmp_path_factory.mktemp("tiny_wan"), seed=0)
    engine = DiffusionEngine.from_pretrained(path)
    defaults = ServedDefaults(rollouts=VIDEO, images=VIDEO.replace(noise_level=0.0, logprobs=False))
    app = create_rollout_app(engine, "tiny-wan", defaults, LIMITS)
    try:
        with serve_in_background(app) as url, httpx.Client(base_url=url, timeout=120) as client:
            yield engine, client
    finally:
        engine.shutdown()


def test_rollouts_return_the_engines_videos(served_wan):
    engine, client = served_wan
    response = client.post(wire.ROLLOUTS_PATH, json=wire.rollout_request("a cat", 2, VIDEO))
    assert response.status_code == 200, response.text
    outputs = wire.decode_outputs(response.content)
    local = engine.generate_batched("a cat", 2, VIDEO)
    for remote, ours in zip(outputs, local):
        assert remote.image.shape == (5, 3, 32, 32) and remote.transition_spec.num_frames == 5
        torch.testing.assert_close(remote.all_latents, ours.all_latents, atol=1e-5, rtol=0)


def test_videos_endpoint_returns_mp4_of_the_samples_frames(served_wan):
    engine, client = served_wan
    response = client.post(wire.VIDEOS_PATH, json={"prompt": "a cat", "seed": 5, "num_frames": 9, "fps": 8})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["output_format"] == "mp4" and body["num_frames"] == 9
    frames = decode_mp4(base64.b64decode(body["data"][0]["b64_json"]))
    ours = engine.generate("a cat", VIDEO.replace(num_frames=9, noise_level=0.0, logprobs=False)).image.numpy()
    assert frames.shape == ours.shape == (9, 3, 32, 32)
    assert np.abs(frames.astype(int) - ours.astype(int)).mean() < 8  # lossy H.264 of the same frames
    # The images endpoint shows a video as its frame strip.
    strip = client.post(wire.IMAGES_PATH, json={"prompt": "a cat", "seed": 5})
    assert strip.status_code == 200 and frame_strip(ours[:5]).shape == (3, 32, 5 * 32)
    bad = client.post(wire.VIDEOS_PATH, json={"prompt": "a cat", "num_frames": 8})
    assert bad.status_code == 400 and "num_frames=8 is not of the form 4k+1" in bad.text
