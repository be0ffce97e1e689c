"""The launch helper the distributed tests share: a launch that hangs fails the test within its
timeout with every process's stack, and leaves no process of it behind."""

from __future__ import annotations

import sys
import textwrap

import psutil
import pytest
from distributed_runs import rank_env, run_together

# A parent that starts a child in a session of its own (as torchrun starts its ranks), both waiting.
HANGING_PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time\\ndef waits_for_a_peer(): time.sleep(600)\\nwaits_for_a_peer()"],
                     start_new_session=True)
    print("started", flush=True)
    time.sleep(600)
    """
)


def test_a_hanging_launch_fails_with_every_process_stack_and_leaves_none_behind():
    before = {p.pid for p in psutil.process_iter()}
    with pytest.raises(AssertionError) as failed:
        run_together([[sys.executable, "-c", HANGING_PARENT]], rank_env(), timeout=3)
    message = str(failed.value)
    assert "ran past 3 s" in message and "started" in message
    assert "waits_for_a_peer" in message  # the child's stack, from its own session
    assert message.count("Current thread") + message.count("Thread 0x") >= 2
    left = [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.pid not in before and "waits_for_a_peer" in " ".join(p.info["cmdline"] or [])
    ]
    assert not left


def test_the_launches_run_side_by_side_and_report_the_worst_exit_code():
    code, log = run_together(
        [[sys.executable, "-c", "print('one')"], [sys.executable, "-c", "import sys; print('two'); sys.exit(3)"]],
        rank_env(),
        timeout=60,
    )
    assert code == 3
    assert log.index("one") < log.index("two")


def test_the_resume_hint_of_a_torchrun_rank_repeats_the_torchrun_launch(monkeypatch):
    """Rank 0 of a torchrun launch prints a resume command that launches the same ranks again."""
    import argparse
    from pathlib import Path
    from types import SimpleNamespace

    from flowrl.cli.train import resume_hint
    from flowrl.distributed.launch import torchrun_command_prefix

    agent = ["/usr/bin/python3", "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "flowrl", "train", "x=1"]
    assert torchrun_command_prefix(agent) == ["torchrun", "--nproc-per-node", "4", "-m", "flowrl"]
    script = ["/venv/bin/python", "/venv/bin/torchrun", "--nnodes", "2", "--rdzv-endpoint", "h:1", "-m", "flowrl.cli"]
    assert torchrun_command_prefix(script) == [
        "torchrun",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "h:1",
        "-m",
        "flowrl.cli",
    ]
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    rebuilt = ["torchrun", "--nnodes", "2", "--nproc-per-node", "4", "-m", "flowrl"]
    assert torchrun_command_prefix(["python", "rank_entry.py"]) == rebuilt  # no module to cut at

    stop = SimpleNamespace(step=3, checkpoint=Path("run/checkpoints/step_000003"), saved_now=True)
    args = argparse.Namespace(config="r.yaml", overrides=["trainer.lr=0.1"])
    tcfg = SimpleNamespace(resume="auto", overwrite=False, output_dir="run")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert resume_hint(stop, args, tcfg).endswith("resume with: flowrl train --config r.yaml trainer.lr=0.1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    hint = resume_hint(stop, args, tcfg)
    assert hint.endswith(
        "resume with: torchrun --nnodes 2 --nproc-per-node 4 -m flowrl train --config r.yaml trainer.lr=0.1"
    )
