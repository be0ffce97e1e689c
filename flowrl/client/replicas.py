"""ReplicaProcesses: `flowrl serve` processes a trainer starts for itself, and stops.

`ReplicaProcesses(model_path, devices, ...)` starts one `flowrl serve` per device, each on
127.0.0.1 and a free port, with a fresh admin token passed in its environment (never on the
command line, where other users could read it), and waits until every one answers /health. Its
output goes to `<log_dir>/replica_<i>.log`; a replica that exits before it is ready raises an
error quoting the end of its log.

They are stopped (SIGTERM, then SIGKILL after a grace period) by `stop()`, on leaving a `with`
block, at interpreter exit, and on SIGTERM to the trainer (turned into SystemExit while replicas
run, so the trainer's own clean-up runs too); on Linux each replica also gets SIGTERM if the
trainer process dies without any of that (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from flowrl.client.remote_engine import ADMIN_TOKEN_ENV

STOP_GRACE_S = 10.0
LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


# Resolved here, not in the child: between fork and exec the child should only make the call.
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies (Linux; elsewhere nothing)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ReplicaProcesses:
    """Started `flowrl serve` replicas (module docstring); `urls` once `start()` returned.

    serve_args: extra `flowrl serve` arguments for every replica (dtype, batch limits, ...)."""

    def __init__(
        self,
        model_path: str | Path,
        devices: list[str],
        log_dir: str | Path,
        serve_args: list[str] | None = None,
        startup_timeout_s: float = 600.0,
    ):
        if not devices:
            raise ValueError("ReplicaProcesses needs at least one device (rollout.num_replicas >= 1)")
        self.model_path = str(model_path)
        self.devices = list(devices)
        self.log_dir = Path(log_dir)
        self.serve_args = list(serve_args or [])
        self.startup_timeout_s = startup_timeout_s
        self.admin_token = secrets.token_urlsafe(24)
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self._previous_sigterm = None

    def command(self, device: str, port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "flowrl.cli",
            "serve",
            "--model",
            self.model_path,
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--device",
            device,
            *self.serve_args,
        ]

    def start(self) -> list[str]:
        """Start every replica and wait until each answers /health; returns their URLs."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start every replica's process (they load their model in the background)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, ADMIN_TOKEN_ENV: self.admin_token}
        atexit.register(self.stop)
        self._stop_on_sigterm()
        try:
            for index, device in enumerate(self.devices):
                port = free_port()
                log = open(self.log_path(index), "wb")  # noqa: SIM115 - the child holds it open
                self.processes.append(
                    subprocess.Popen(
                        self.command(device, port),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        start_new_session=True,  # a terminal's Ctrl-C reaches the trainer, which stops them
                        preexec_fn=_die_with_parent,
                    )
                )
                log.close()
                self.urls.append(f"http://{LOOPBACK}:{port}")
        except BaseException:
            self.stop()
            raise

    def wait_ready(self) -> list[str]:
        """Wait until every launched replica answers /health; returns their URLs."""
        try:
            for index in range(len(self.processes)):
                self._wait_ready(index)
        except BaseException:
            self.stop()
            raise
        return list(self.urls)

    def log_path(self, index: int) -> Path:
        return self.log_dir / f"replica_{index}.log"

    def _wait_ready(self, index: int) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        process, url = self.processes[index], self.urls[index]
        while True:
            code = process.poll()
            if code is not None:
                raise RuntimeError(
                    f"rollout replica {index} (`flowrl serve` on {self.devices[index]}) exited with code {code} "
                    f"before it was ready; the end of {self.log_path(index)}:\n{self.log_tail(index)}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rollout replica {index} ({url}) did not answer /health within {self.startup_timeout_s:.0f} s; "
                    f"see {self.log_path(index)}"
                )
            time.sleep(0.2)

    def log_tail(self, index: int, num_lines: int = 20) -> str:
        try:
            lines = self.log_path(index).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    def kill(self, index: int) -> None:
        """Kill replica `index` at once (SIGKILL), as a crash would (used to test failover)."""
        self.processes[index].kill()
        self.processes[index].wait()

    def stop(self) -> None:
        """Stop every replica still running: SIGTERM, then SIGKILL after the grace period."""
        running = [p for p in self.processes if p.poll() is None]
        for process in running:
            process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for process in running:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._restore_sigterm()
        atexit.unregister(self.stop)

    def __enter__(self):
        if not self.processes:
            self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    # --- SIGTERM -----------------------------------------------------------------------------------
    def _stop_on_sigterm(self) -> None:
        """While replicas run, SIGTERM to this process raises SystemExit in the main thread, so
        `finally` blocks (and `stop()`) run instead of the process vanishing with its replicas."""
        if threading.current_thread() is not threading.main_thread() or self._previous_sigterm is not None:
            return

        def on_sigterm(signum, frame):
            raise SystemExit(128 + signum)

        self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
