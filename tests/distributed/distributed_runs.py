"""What the distributed tests share: the tiny run's settings, one-process reference runs in this
process, torchrun launches on the loopback (gloo, one thread per rank, as the reference) and the
comparisons of two runs' metrics and final/ folders. A module of its own (not conftest.py), so
`from distributed_runs import ...` names this file whichever other conftest.py pytest loaded."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

ENTRY = Path(__file__).with_name("rank_entry.py")
# Two steps of 4 prompts x 2 samples; two optimizer steps each (mini-batches split unevenly over
# the ranks, so sharded ranks pad); a recomputed PPO denominator, validation of 3 prompts (2 + 1
# per rank) at step 2, a checkpoint after every step.
BASE = (
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    "trainer.total_steps=2",
    "trainer.prompts_per_step=4",
    "rollout.n=2",
    "trainer.micro_batch_size=2",
    "trainer.updates_per_step=2",
    "rollout.sampling.sde_window_size=2",
    "trainer.val_every=2",
    "trainer.num_val_images=3",
    "trainer.save_every=1",
    "trainer.lr=0.001",
    "algorithm.old_log_prob=recompute",
    "distributed.timeout_s=120",  # a collective left waiting fails with its stack, well within TIMEOUT_S
)
LORA = ("trainer.lora.enabled=true", "trainer.lora.rank=4", "algorithm.kl_beta=0.01", "trainer.ema.enabled=true")
FULL = ("trainer.lora.enabled=false", "trainer.ema.enabled=true", "trainer.ema.update_every=1")
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(**extra: str) -> dict:
    """The environment of a launched rank: offline, gloo on the loopback, one thread; SIGABRT
    prints every thread's stack (faulthandler), which `run_together` uses on a launch that hangs."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
        **extra,
    }


def run_together(commands: list[list[str]], env: dict, timeout: float) -> tuple[int, str]:
    """Run the commands (torchrun agents) side by side; returns the largest exit code and their
    output, one after the other. Output goes to files, as a pipe nobody reads yet could block a
    process that another one waits for in a collective. Past `timeout` seconds every process of
    the launch (agents and their ranks, which torchrun starts in sessions of their own) prints its
    threads' stacks and is killed, and the test fails with the output."""
    with tempfile.TemporaryDirectory() as folder:
        logs = [Path(folder) / f"launch{i}.log" for i in range(len(commands))]
        procs = []
        for command, log in zip(commands, logs):
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            _abort_with_stacks(procs)
            raise AssertionError(f"the launch ran past {timeout:.0f} s\n" + _joined(logs, tail=8000)) from None
        return max(proc.returncode for proc in procs), _joined(logs)


def _abort_with_stacks(procs: list[subprocess.Popen]) -> None:
    """SIGABRT to every process of the launch, ranks first (faulthandler prints their stacks),
    then SIGKILL to whatever is left a few seconds later."""
    family = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            parent = psutil.Process(proc.pid)
            family += [*parent.children(recursive=True), parent]
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(signal.SIGABRT)
    _, alive = psutil.wait_procs(family, timeout=5)
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()


def _joined(logs: list[Path], tail: int | None = None) -> str:
    parts = []
    for i, log in enumerate(logs):
        text = log.read_text(errors="replace")
        parts.append(f"--- launch {i} ---\n" + (text[-tail:] if tail else text))
    return "\n".join(parts)


@dataclass
class Launch:
    output: Path
    returncode: int
    log: str
    seconds: float
    rollouts: Path | None = None  # FLOWRL_TEST_RECORD's folder, when recorded


def torchrun(
    overrides,
    output: Path,
    *,
    nproc: int = 2,
    torchrun_args=(),
    env: dict | None = None,
    entry: list[str] | None = None,
    timeout: float = TIMEOUT_S,
) -> Launch:
    """`torchrun --nproc-per-node nproc` on the loopback running `flowrl train` (through
    rank_entry.py unless `entry` names another program) into `output`."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--local-addr",
        "127.0.0.1",
        *torchrun_args,
        *(entry or [str(ENTRY)]),
        "train",
        *overrides,
        f"trainer.output_dir={output}",
    ]
    t0 = time.perf_counter()
    returncode, log = run_together([command], rank_env(**(env or {})), timeout)
    return Launch(output, returncode, log, time.perf_counter() - t0)


@contextlib.contextmanager
def one_thread():
    """torch on one thread, as every launched rank (OMP_NUM_THREADS=1): the same float rounding."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def hooks(record_dir=None, fail=None, rank=0):
    """rank_entry's hooks in this process, undone afterwards."""
    from rank_entry import install_hooks

    from flowrl.rollout.agent_loop import AgentLoop
    from flowrl.trainer.trainer import Trainer

    saved = AgentLoop.generate_sequences, Trainer.train_step
    install_hooks(record_dir and str(record_dir), fail, rank)
    try:
        yield
    finally:
        AgentLoop.generate_sequences, Trainer.train_step = saved


def train_one_process(overrides, output: Path, record_dir=None) -> Path:
    """The same run in this process (world size 1); returns its output folder."""
    from flowrl.run.config import load_train_config
    from flowrl.trainer.trainer import Trainer

    cfg = load_train_config(None, [*overrides, f"trainer.output_dir={output}"])
    with one_thread(), hooks(record_dir), Trainer(cfg) as trainer:
        trainer.fit()
    return output


def metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output) / "metrics.jsonl").read_text().splitlines()]


# Metrics that measure when things happened, not what was trained: they differ between two runs
# of the same training (the early share: how much of the recompute ran before the rewards were in).
TIMING_METRICS = ("timing/", "perf/", "rollout/images_per_second", "actor/old_log_prob_early_share")


def trained_metrics(record: dict) -> dict:
    """A metrics record without its `TIMING_METRICS`."""
    return {key: value for key, value in record.items() if not key.startswith(TIMING_METRICS)}


def final_weights(output: Path, folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files under output/final/folder."""
    weights = {}
    for file in sorted((Path(output) / "final" / folder).glob("*.safetensors")):
        weights.update(load_file(str(file)))
    assert weights, f"no weights under {output}/final/{folder}"
    return weights


def max_weight_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def final_entries(output: Path) -> dict[str, Path]:
    """Every file of output/final by relative path, and every symlinked component folder (not
    descended into: its target is the base model's)."""
    root = Path(output) / "final"
    entries = {}
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(folder) / name
            if path.is_symlink() or path.is_file():
                entries[path.relative_to(root).as_posix()] = path
    assert entries, f"{root} is empty"
    return entries


# Settings that say where and how a run ran, not what it trained (full_two_ranks checkpoints "auto").
RUN_ONLY_KEYS = ("trainer.output_dir", "distributed.", "trainer.gradient_checkpointing")


def _trained_config(run_info: dict) -> dict:
    from flowrl.run.resume import flatten

    flat = flatten(run_info.pop("config"))
    return {**run_info, "config": {k: v for k, v in flat.items() if not k.startswith(RUN_ONLY_KEYS)}}


def assert_same_final(a: Path, b: Path, atol_weights: float = 1e-5) -> None:
    """The two runs' final/ folders are the same pipeline folder: the same entries, links to the
    same base model components, weights within atol_weights, flowrl_run.json equal but for the
    run-only keys, every other file byte for byte."""
    ea, eb = final_entries(a), final_entries(b)
    assert ea.keys() == eb.keys()
    for name, path in ea.items():
        other = eb[name]
        if path.is_symlink() or other.is_symlink():
            assert path.is_symlink() and other.is_symlink() and path.resolve() == other.resolve(), name
        elif name.endswith(".safetensors"):
            assert max_weight_difference(load_file(str(path)), load_file(str(other))) < atol_weights, name
        elif name == "flowrl_run.json":
            infos = [_trained_config(json.loads(p.read_text())) for p in (path, other)]
            assert infos[0] == infos[1]
        else:
            assert path.read_bytes() == other.read_bytes(), name


def assert_same_training(a: Path, b: Path, atol_weights: float = 1e-5) -> None:
    """The two runs logged the same steps with reward stats within 1e-6, trained the same rows
    with as many optimizer steps, and ended with the same final/ folder (`assert_same_final`)."""
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    for ra, rb in zip(ma, mb):
        for key in ("reward/mean", "reward/std", "val/reward_mean"):
            if key in ra:
                assert abs(ra[key] - rb[key]) < 1e-6, (ra["step"], key, ra[key], rb[key])
        for key in ("adv/num_rows_trained", "actor/num_optimizer_steps", "rollout/policy_version"):
            assert ra.get(key) == rb.get(key), (ra["step"], key)
    assert_same_final(a, b, atol_weights)


# Progress bars of model loading and saving: left out of a failed launch's log, which they would drown.
_PROGRESS = re.compile(r"^\s*(Loading (weights|pipeline components)|Writing model shards)[^\n]*$\n?", re.MULTILINE)


def check_launch(launch: Launch) -> Launch:
    assert launch.returncode == 0, _PROGRESS.sub("", launch.log.replace("\r", "\n"))[-6000:]
    return launch
