"""`flowrl bench learn --jobs K`: the runs measured by up to K processes at once, one report.

A small model (the toy world's) leaves most of a GPU, and all of a many-core CPU, idle; K processes
measuring disjoint runs fill it. A unit of work is a configuration or its control, each in a process
of its own (the same command with one `--run` and `--no-control` or `--controls-only`), except under
`--seconds`, where a control trains the steps its configuration reached and so follows it in the
same process. Each unit writes OUT/jobs/unit-I/ (learn.json, its runs, unit.log); this module then
joins their runs, in the order one process measures them, into one OUT/learn.json and learn.png.
Stopped (Ctrl-C, SIGTERM), it stops the units and joins what each measured so far (a unit
rewrites its learn.json after every evaluation).

The processes share the device, so a run's device-seconds are its steps' wall time under that
sharing (the report says `jobs`); steps, scores and intervals are what one process would measure.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path


class JobFailed(RuntimeError):
    """A unit's process exited with an error (its log says why)."""


def job_units(args, configurations: list) -> list[tuple[list, str]]:
    """What the jobs share out: (configurations, which) with which = "both" (a configuration and its
    control, in order), "trained" or "controls"."""
    if args.no_control:
        return [([item], "trained") for item in configurations]
    if args.controls_only:
        return [([item], "controls") for item in configurations]
    if args.seconds is not None:
        return [([item], "both") for item in configurations]
    return [([item], which) for item in configurations for which in ("trained", "controls")]


def job_command(args, group: list, which: str, out: Path) -> list[str]:
    """The `flowrl bench learn` command line measuring `group` (name, overrides) into `out`: the
    configurations, their controls, or both (`which`)."""
    command = [sys.executable, "-m", "flowrl.cli", "bench", "learn", "--config", str(args.config)]
    command += ["--steps", str(args.steps), "--eval-seeds", str(args.eval_seeds), "--out", str(out), "--overwrite"]
    for flag, value in (
        ("--eval-every", args.eval_every),
        ("--seconds", args.seconds),
        ("--prompts", args.prompts),
        ("--eval-prompts", args.eval_prompts),
    ):
        if value is not None:
            command += [flag, str(value)]
    command += {"both": [], "trained": ["--no-control"], "controls": ["--controls-only"]}[which]
    for name, overrides in group:
        command += ["--run", f"{name}: {shlex.join(overrides)}".rstrip()]
    return command + list(args.overrides)


def run_jobs(args, configurations: list, out: Path, say=print) -> dict:
    """Measure `configurations` with at most `args.jobs` processes at a time, one per unit of
    `job_units` (the next starts when one ends); returns the joined report (`"complete": false`
    when a stop signal ended it early). JobFailed naming the unit's log when one fails."""
    units = job_units(args, configurations)
    waiting, running, done = list(enumerate(units)), [], {}
    try:
        _run_units(args, out, waiting, running, done, say)
    except KeyboardInterrupt:
        _stop(running)
        for index, folder, _, _ in running:
            partial = folder / "learn.json"
            if partial.is_file():
                done[index] = json.loads(partial.read_text())
        return join_reports([done[index] for index in sorted(done)], args.jobs, complete=False)
    return join_reports([done[index] for index in sorted(done)], args.jobs, complete=True)


def _stop(running: list, grace: float = 10.0) -> None:
    """SIGTERM to every running unit (a unit then keeps what it measured), SIGKILL after `grace` s."""
    for entry in running:
        entry[3].terminate()
    deadline = time.monotonic() + grace
    for entry in running:
        try:
            entry[3].wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            entry[3].kill()


def join_reports(reports: list[dict], jobs: int, complete: bool) -> dict:
    """The units' reports as one, their runs in order (none: an empty report)."""
    if not reports:
        return {"complete": False, "runs": []}
    joined = {key: value for key, value in reports[0].items() if key not in ("runs", "wall_seconds")}
    joined["jobs"] = jobs
    joined["device_seconds"] += f"; up to {jobs} processes shared the device"
    joined["runs"] = [run for report in reports for run in report["runs"]]
    joined["complete"] = complete and all(report.get("complete", True) for report in reports)
    return joined


def _run_units(args, out: Path, waiting: list, running: list, done: dict, say) -> None:
    while waiting or running:
        while waiting and len(running) < args.jobs:
            index, (group, which) = waiting.pop(0)
            folder = out / "jobs" / f"unit-{index}"
            folder.mkdir(parents=True, exist_ok=True)
            log = folder / "unit.log"
            (folder / "learn.json").unlink(missing_ok=True)  # an earlier run's: a stop must not join it
            say(f"unit {index}: {', '.join(name for name, _ in group)} ({which}; log: {log})")
            with open(log, "w") as handle:
                command = job_command(args, group, which, folder)
                running.append((index, folder, log, subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT)))
        time.sleep(0.2)
        for entry in [entry for entry in running if entry[3].poll() is not None]:
            running.remove(entry)
            index, folder, log, process = entry
            if process.returncode != 0:
                for other in running:
                    other[3].kill()
                tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise JobFailed(f"bench learn unit {index} exited with {process.returncode}; see {log}: {tail[0]}")
            done[index] = json.loads((folder / "learn.json").read_text())
