"""Helpers of the rollout-server tests: tiny SD3 engines served on free loopback ports."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import httpx

from flowrl.engine import DiffusionEngine, SamplingParams
from flowrl.server.generation_request import ServingLimits
from flowrl.server.http import serve_in_background
from flowrl.server.rollout_app import ServedDefaults, create_rollout_app

ADMIN_TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MODEL_NAME = "tiny-sd3"
# Small and fast: every sample runs a few steps of a 32x32 (or 64x64) image.
SAMPLING = SamplingParams(height=32, width=32, num_inference_steps=3, noise_level=0.7)
DEFAULTS = ServedDefaults(rollouts=SAMPLING, images=SAMPLING.replace(noise_level=0.0, logprobs=False))
LIMITS = ServingLimits(max_body_bytes=64 * 1024, max_samples_per_request=16, max_weights_bytes=2**20)


@dataclass
class Served:
    engine: DiffusionEngine
    url: str
    app: object

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kwargs)


@contextlib.contextmanager
def serving(model_path, admin_token: str | None = ADMIN_TOKEN, max_batch_rows: int = 32, limits=LIMITS):
    engine = DiffusionEngine.from_pretrained(model_path, max_batch_rows=max_batch_rows)
    app = create_rollout_app(engine, MODEL_NAME, DEFAULTS, limits, admin_token=admin_token)
    try:
        with serve_in_background(app) as url:
            yield Served(engine, url, app)
    finally:
        engine.shutdown()
