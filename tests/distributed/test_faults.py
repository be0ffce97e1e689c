"""Faults of a torchrun launch: a killed rank with --max-restarts 1 restarts the group, which
resumes from the latest checkpoint and ends as the uninterrupted run; a rank that raises ends the
whole job quickly, its error in the output; a stop signal to one rank stops every rank after the
same step, with a checkpoint of it."""

from __future__ import annotations

import re
import time

from distributed_runs import assert_same_training, check_launch, metrics, torchrun


def test_a_killed_rank_restarts_the_group_which_resumes_and_finishes(full_args, full_reference, tmp_path):
    launch = check_launch(
        torchrun(
            full_args, tmp_path / "run", torchrun_args=["--max-restarts", "1"], env={"FLOWRL_TEST_FAIL": "1:2:kill"}
        )
    )
    assert re.search(r"resumed from \S*step_000001 at step 1", launch.log), launch.log[-3000:]
    assert_same_training(launch.output, full_reference)


def test_a_rank_that_raises_ends_the_job_within_a_minute_with_its_error(lora_args, tmp_path):
    launch = torchrun(lora_args, tmp_path / "run", env={"FLOWRL_TEST_FAIL": "1:1:raise"}, timeout=180)
    ended = time.time()
    assert launch.returncode != 0
    raised = re.search(r"injected failure on rank 1 at step 1 \(time ([\d.]+)\)", launch.log)
    assert raised, launch.log[-3000:]
    assert ended - float(raised.group(1)) < 60


def test_a_stop_signal_to_one_rank_stops_every_rank_after_the_same_step(lora_args, tmp_path):
    """SIGTERM to rank 1 during step 1: no rank drops its phase alone (the other would wait in its
    collectives); both finish step 1, agree to stop, save it together and exit with 143."""
    launch = torchrun(lora_args, tmp_path / "run", env={"FLOWRL_TEST_FAIL": "1:1:term"}, timeout=240)
    assert launch.returncode != 0, launch.log[-3000:]
    assert re.search(r"stopped after step 1; \S*step_000001 \(", launch.log), launch.log[-3000:]
    # The resume hint repeats the torchrun launch, not a one-process `flowrl train` (rank_entry.py,
    # not `-m flowrl`, started these ranks: the launch is rebuilt from torchrun's environment).
    assert "resume with: torchrun --nproc-per-node 2 -m flowrl train " in launch.log, launch.log[-3000:]
    assert "exitcode: 143" in launch.log, launch.log[-3000:]
    assert (launch.output / "checkpoints" / "step_000001").is_dir()
    assert [r["step"] for r in metrics(launch.output)] == [0, 1]  # step-0 validation, then step 1
