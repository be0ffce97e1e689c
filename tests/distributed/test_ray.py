"""The Ray launcher: 2 CPU workers on a local Ray bound to 127.0.0.1 train 2 steps with the same
metrics and weights as the torchrun launch of the same run, and no process of the run listens on
an address other than the loopback. One Ray for this file (its start costs seconds)."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import tempfile
import threading

import psutil
import pytest
from distributed_runs import assert_same_final, metrics, trained_metrics

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (pip install 'ray[train]')")


def _ip(address: str):
    ip = ipaddress.ip_address(address)
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


class Listeners:
    """Samples the listening TCP sockets of this process and its descendants (Ray's servers and
    workers) in the background."""

    def __init__(self):
        self.seen: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.5):
            me = psutil.Process()
            pids = {me.pid, *(child.pid for child in me.children(recursive=True))}
            for conn in psutil.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
                    self.seen.add((conn.laddr.ip, conn.pid))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_ray_launcher_trains_as_torchrun_on_the_loopback(
    local_ray, lora_args, lora_two_nodes, tmp_path, monkeypatch, capfd
):
    import time

    from flowrl.cli import main

    monkeypatch.chdir(tmp_path)  # a relative output_dir: the workers resolve it where the driver does
    output = tmp_path / "run"
    args = ["train", *lora_args, "trainer.output_dir=run", "distributed.launcher=ray"]
    with Listeners() as listeners:
        assert main([*args, "distributed.num_workers=2"]) == 0
    assert listeners.seen, "no listening socket was sampled"
    assert not [(ip, pid) for ip, pid in listeners.seen if not _ip(ip).is_loopback]
    ray_run, torchrun_run = metrics(output), metrics(lora_two_nodes.output)
    assert [r["step"] for r in ray_run] == [r["step"] for r in torchrun_run] == [0, 1, 2]
    for a, b in zip(ray_run, torchrun_run):
        assert a.keys() == b.keys()
        for key, value in trained_metrics(a).items():
            assert value == pytest.approx(b[key], abs=1e-6), (a["step"], key)
    assert_same_final(output, lora_two_nodes.output)
    # The run's output says each thing once, without Ray's and transformers' noise (issue 52).
    seen, deadline = "", time.monotonic() + 10
    while "metrics: " not in seen and time.monotonic() < deadline:  # Ray forwards worker lines late
        time.sleep(0.2)
        captured = capfd.readouterr()
        seen += captured.out + captured.err
    assert seen.count("steps trained: 2") == 1, seen[-3000:]
    assert "Failed to query Ray Train Controller" not in seen and "requires torchvision" not in seen, seen[-3000:]


@pytest.mark.slow
def test_the_ray_command_on_its_own_local_ray_prints_each_line_once(lora_args, tmp_path):
    """`flowrl train distributed.launcher=ray` in a process of its own (its own local Ray, started
    by flowrl): the summary once, none of Ray's State API notices or transformers' torchvision ones."""
    import subprocess
    import sys

    ray_tmp = tempfile.TemporaryDirectory(prefix="ray", ignore_cleanup_errors=True)  # short socket paths
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_TMPDIR": ray_tmp.name, "RAY_AUTH_MODE": "disabled"}
    command = [sys.executable, "-m", "flowrl", "train", *lora_args, f"trainer.output_dir={tmp_path / 'run'}"]
    command += ["distributed.launcher=ray", "distributed.num_workers=2", "trainer.total_steps=1"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    ray_tmp.cleanup()
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert output.count("steps trained: 1") == 1, output[-3000:]
    assert "Failed to query Ray Train Controller" not in output and "requires torchvision" not in output


def test_ray_processes_drop_exactly_the_known_notices():
    """The faster sibling of the two tests above: the hook of flowrl's local Ray filters the State
    API notice of Ray Train's placement-group cleaner and transformers' torchvision notice, and
    nothing else."""
    import logging

    from flowrl.console import quiet_local_ray_worker

    quiet_local_ray_worker()
    quiet_local_ray_worker()  # idempotent: one filter each

    def passes(logger_name: str, message: str) -> bool:
        record = logging.LogRecord(logger_name, logging.WARNING, __file__, 1, message, None, None)
        return logging.getLogger(logger_name).filter(record)

    cleaner = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
    assert not passes(cleaner, "Failed to query Ray Train Controller actor state. State API may be ...")
    assert passes(cleaner, "Controller actor died; removing placement group")
    assert not passes("transformers.utils.import_utils", "`X` requires torchvision (not installed); falling back to Y")
    assert len(logging.getLogger(cleaner).filters) == 1
