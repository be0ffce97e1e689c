"""`flowrl reward-server` smoke test: the real command in a subprocess, on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np

from flowrl.rewards import build_reward
from flowrl.rewards.http_client import HttpReward


def test_reward_server_command_serves_and_stops_on_sigint():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flowrl.cli",
            "reward-server",
            "--reward",
            "jpeg_incompressibility",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        first_line = process.stdout.readline()
        assert first_line.startswith("serving reward jpeg_incompressibility at http://127.0.0.1:"), (
            first_line + process.stderr.read() if process.poll() is not None else first_line
        )
        url = first_line.split(" at ")[1].strip()
        images = np.random.default_rng(0).integers(0, 256, (2, 3, 16, 16), dtype=np.uint8)
        remote = HttpReward(url, max_attempts=1)(images, ["", ""], [{}, {}])
        np.testing.assert_array_equal(remote, build_reward("jpeg_incompressibility")(images, ["", ""], [{}, {}]))
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
