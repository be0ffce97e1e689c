"""`flowrl bench learn --jobs K`: the configurations measured by K processes at once, one report.

A small model (the toy world's) leaves most of a GPU, and all of a many-core CPU, idle; K processes
measuring disjoint configurations fill it. Each configuration stays in one job with its control
(with `--seconds` the control trains the steps its configuration reached). Each job is the same
command with its share of `--run`s, writing OUT/jobs/job-I/ (learn.json, the runs, and job-I.log);
this module then joins their runs, in the order given, into one OUT/learn.json and learn.png.

The jobs share the device, so a run's device-seconds are its steps' wall time under that sharing
(the report says `jobs`); steps, scores and intervals are what one process would measure.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path


class JobFailed(RuntimeError):
    """A job's process exited with an error (its log says why)."""


def split_configurations(configurations: list, jobs: int) -> list[list]:
    """`configurations` in at most `jobs` contiguous groups of near-equal size, none empty."""
    jobs = min(jobs, len(configurations))
    size, extra = divmod(len(configurations), jobs)
    groups, start = [], 0
    for index in range(jobs):
        end = start + size + (1 if index < extra else 0)
        groups.append(configurations[start:end])
        start = end
    return groups


def job_command(args, group: list, out: Path) -> list[str]:
    """The `flowrl bench learn` command line measuring `group` (name, overrides) into `out`."""
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
    if args.no_control:
        command.append("--no-control")
    for name, overrides in group:
        command += ["--run", f"{name}: {shlex.join(overrides)}".rstrip()]
    return command + list(args.overrides)


def run_jobs(args, configurations: list, out: Path, say=print) -> dict:
    """Measure `configurations` in `args.jobs` processes; returns the joined report. JobFailed naming
    the job's log when one fails."""
    groups = split_configurations(configurations, args.jobs)
    processes = []
    for index, group in enumerate(groups):
        folder = out / "jobs" / f"job-{index}"
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / f"job-{index}.log"
        say(f"job {index}: {', '.join(name for name, _ in group)} (log: {log})")
        with open(log, "w") as handle:
            processes.append(
                (
                    folder,
                    log,
                    subprocess.Popen(job_command(args, group, folder), stdout=handle, stderr=subprocess.STDOUT),
                )
            )
    failed = [(folder, log, process.wait()) for folder, log, process in processes]
    failed = [(log, code) for _, log, code in failed if code != 0]
    if failed:
        log, code = failed[0]
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(
            f"bench learn job exited with {code} ({len(failed)} of {len(groups)} failed); see {log}: {tail[0]}"
        )
    reports = [json.loads((folder / "learn.json").read_text()) for folder, _, _ in processes]
    joined = {key: value for key, value in reports[0].items() if key not in ("runs", "wall_seconds")}
    joined["jobs"] = len(groups)
    joined["device_seconds"] += f"; {len(groups)} jobs shared the device"
    joined["runs"] = [run for report in reports for run in report["runs"]]
    return joined
