"""ReplicaProcesses: started replicas are stopped on SIGTERM to the trainer (which exits through
its clean-up), and a replica that dies before it is ready is reported with its log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from flowrl.client.replicas import ReplicaProcesses

# A stand-in for `flowrl serve`: answers /health on 127.0.0.1:PORT (argv[1]).
HEALTH_SERVER = textwrap.dedent(
    """
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """
)


class FakeServe(ReplicaProcesses):
    def command(self, device, port):
        return [sys.executable, "-c", HEALTH_SERVER, str(port)]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_stops_the_trainer_and_its_replicas(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from test_replicas import FakeServe

        replicas = FakeServe("unused", ["cpu", "cpu"], {str(tmp_path)!r})
        replicas.start()
        try:  # the pids are printed inside the try, so a SIGTERM right after them still runs the finally
            print(" ".join(str(p.pid) for p in replicas.processes), flush=True)
            time.sleep(120)
        finally:
            print("clean-up ran", flush=True)
        """
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pids = [int(pid) for pid in trainer.stdout.readline().split()]
    assert len(pids) == 2 and not any(_gone(pid) for pid in pids), trainer.stderr.read()
    trainer.send_signal(signal.SIGTERM)
    out, err = trainer.communicate(timeout=60)
    assert trainer.returncode == 128 + signal.SIGTERM, err
    assert "clean-up ran" in out
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in pids)


def test_a_replica_that_exits_before_it_is_ready_is_reported_with_its_log(tmp_path):
    class Broken(ReplicaProcesses):
        def command(self, device, port):
            return [sys.executable, "-c", "import sys; print('flowrl serve: error: --model not found'); sys.exit(2)"]

    with pytest.raises(RuntimeError, match=r"(?s)replica 0 .* exited with code 2.*--model not found"):
        Broken("unused", ["cpu"], tmp_path).start()


def test_no_devices():
    with pytest.raises(ValueError, match="at least one device"):
        ReplicaProcesses("unused", [], "unused")
