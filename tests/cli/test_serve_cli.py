"""`flowrl serve`: bad flags exit 2 with one line before any model loads; the real command in a
subprocess serves a tiny model on 127.0.0.1, rollouts and images, and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from flowrl.cli import main
from flowrl.sampling_params import SamplingParams
from flowrl.server import wire


def _exit_code(argv: list[str]) -> int:
    """`flowrl ARGV`'s exit code: argparse errors exit, the command's own checks return."""
    try:
        return main(argv)
    except SystemExit as error:
        return error.code


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--port", "70000"], "--port 70000 is not a port"),
        (["--port", "-1"], "--port -1 is not a port"),
        (["--max-body-mb", "0"], "--max-body-mb 0.0 must be > 0"),
        (["--max-samples-per-request", "0"], "must be an integer >= 1"),
    ],
)
def test_bad_flags_exit_2_with_one_line(tiny_sd3_path, capsys, flags, fragment):
    assert _exit_code(["serve", "--model", str(tiny_sd3_path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1, err


def test_a_model_that_is_not_there_exits_2(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err


def test_serve_command_serves_on_loopback_and_stops_on_sigterm(tiny_sd3_path, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", wire.ADMIN_TOKEN_ENV: "secret"}
    log = open(tmp_path / "stderr.txt", "w+")
    command = [sys.executable, "-m", "flowrl.cli", "serve", "--model", str(tiny_sd3_path), "--port", "0"]
    command += ["--max-connections", "2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        line = process.stdout.readline()
        assert line.startswith("serving tiny_sd3") and " at http://127.0.0.1:" in line, line + open(log.name).read()
        assert "(weight updates on)" in line
        url = line.split(" at ")[1].split()[0]
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.get(wire.HEALTH_PATH).json()["status"] == "ok"
            params = SamplingParams(height=32, width=32, num_inference_steps=2, seed=1)
            response = client.post(wire.ROLLOUTS_PATH, json=wire.rollout_request(["a", "b"], 2, params))
            assert [o.seed for o in wire.decode_outputs(response.content)] == [1, 2, 3, 4]
            images = client.post(wire.IMAGES_PATH, json={"prompt": "a", "size": "32x32"}).json()["data"]
            assert len(images) == 1
            info = client.get(wire.WEIGHTS_PATH, headers={"Authorization": "Bearer secret"}).json()
            assert info["policy_version"] == 0
            _burst_over_max_connections_gets_openai_json_503(client, url, params)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, open(log.name).read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def _burst_over_max_connections_gets_openai_json_503(client, url, params):
    """Two requests held by a pause fill --max-connections 2: the next gets the JSON error the docs
    promise (not uvicorn's plain text), and the held ones are answered after the resume."""
    import threading
    import time

    admin = {"Authorization": "Bearer secret"}
    assert client.post(wire.PAUSE_PATH, headers=admin).status_code == 200
    answers = []

    def held(seed):
        with httpx.Client(base_url=url, timeout=60) as own:
            request = wire.rollout_request("a", 1, params.replace(seed=seed))
            answers.append(own.post(wire.ROLLOUTS_PATH, json=request).status_code)

    threads = [threading.Thread(target=held, args=(seed,)) for seed in (5, 6)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while (busy := client.get(wire.HEALTH_PATH)).status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert busy.status_code == 503 and busy.headers["content-type"] == "application/json", busy.text
    error = busy.json()["error"]
    assert error["type"] == "server_error" and "--max-connections=2" in error["message"]
    assert busy.headers["retry-after"] == "1"
    with httpx.Client(base_url=url, timeout=60) as other:  # a new connection, refused the same way
        assert other.post(wire.IMAGES_PATH, json={"prompt": "a", "size": "32x32"}).status_code == 503
    # The admin endpoints are not counted: a resume reaches a server whose slots the pause holds.
    assert client.post(wire.RESUME_PATH, headers=admin).status_code == 200
    for thread in threads:
        thread.join(timeout=60)
    assert answers == [200, 200]


def test_serve_on_all_interfaces_warns_that_generation_is_unauthenticated(tiny_sd3_path, monkeypatch, capsys):
    """Without binding anything (tests bind loopback only): the warning `--host 0.0.0.0` prints."""
    from flowrl.server import http

    monkeypatch.setattr(http, "serve_until_signal", lambda *args, **kwargs: None)
    assert main(["serve", "--model", str(tiny_sd3_path), "--host", "0.0.0.0"]) == 0
    err = capsys.readouterr().err
    assert "flowrl serve: warning: --host 0.0.0.0 serves image generation and rollouts without authentication" in err
    assert main(["serve", "--model", str(tiny_sd3_path)]) == 0
    assert "warning" not in capsys.readouterr().err  # loopback: nothing to warn about


def test_a_started_replica_samples_as_the_trainers_engine(tiny_sd3_path):
    """The options the trainer starts a replica with (rollout_backend.replica_serve_args) reach the
    served engine: batch limits, prompt cache, mixed precision."""
    import argparse

    import torch

    from flowrl.cli import serve as serve_cli
    from flowrl.rollout.backends import replica_serve_args
    from flowrl.run.config import load_train_config

    overrides = ["engine.max_batch_rows=8", "engine.decode_chunk_size=3", "engine.prompt_cache_mb=5"]
    cfg = load_train_config(None, [*overrides, "trainer.mixed_precision=bf16", "rollout.num_replicas=1"])
    parser = argparse.ArgumentParser()
    serve_cli.build_parser(parser)
    engine, _, _ = serve_cli._open(parser.parse_args(["--model", str(tiny_sd3_path), *replica_serve_args(cfg)]))
    try:
        assert (engine.max_batch_rows, engine.executor.decode_chunk_size) == (8, 3)
        assert engine.prompt_cache.max_bytes == 5 * 2**20
        assert engine.executor.autocast_dtype == torch.bfloat16
    finally:
        engine.shutdown()
