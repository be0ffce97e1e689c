"""Ctrl-C / SIGTERM during `flowrl train`: a clean stop at a safe point, exit 128 + signal, no
native crash, a checkpoint a resume starts from, and one line saying how (flowrl.run.interrupts)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.run.interrupts import TrainingInterrupted

# Small and slow enough per phase that a signal sent on seeing a phase lands inside it.
FAST_RUN = (
    "trainer.total_steps=3",
    "trainer.prompts_per_step=2",
    "rollout.n=4",
    "rollout.sampling.num_inference_steps=16",
    "trainer.num_val_images=2",
    "logging.tensorboard=false",
)
HINT = re.compile(
    r"^flowrl train: stopped after step (\d+); (\S+) \((saved at the interrupt|the latest checkpoint)\); "
    r"resume with: (flowrl train .*)$"
)


def _train_until(pattern: str, signum: int, argv: list[str], cwd: Path) -> tuple[int, str, float]:
    """Start `flowrl train argv`, send `signum` when stderr matches `pattern`; (exit code, stderr, seconds
    from the signal to the exit)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FLOWRL_CACHE": str(cwd / "cache")}
    process = subprocess.Popen(
        [sys.executable, "-m", "flowrl.cli", "train", *argv], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True
    )
    seen, line, sent_at = "", "", None
    killer = threading.Timer(120, process.kill)  # a hung run fails the test instead of blocking it
    killer.start()
    try:
        while chunk := process.stderr.read(1):
            seen += chunk
            line = "" if chunk in "\r\n" else line + chunk
            if sent_at is None and re.search(pattern, line):
                process.send_signal(signum)
                sent_at = time.monotonic()
        code = process.wait()
    finally:
        killer.cancel()
    assert sent_at is not None, f"never saw {pattern!r}:\n{seen[-2000:]}"
    return code, seen, time.monotonic() - sent_at


def _lines(stderr: str) -> list[str]:
    return [line.strip() for line in stderr.replace("\r", "\n").splitlines() if line.strip()]


def _hint(stderr: str) -> re.Match:
    matches = [m for line in _lines(stderr) if (m := HINT.match(line))]
    assert len(matches) == 1, stderr[-3000:]
    return matches[0]


def test_interrupts_at_three_points_stop_cleanly_and_resume(tiny_sd3_path, tmp_path, monkeypatch):
    out = tmp_path / "run"
    argv = [f"model.path={tiny_sd3_path}", f"trainer.output_dir={out}", "trainer.save_every=1", "trainer.val_every=3"]
    argv += FAST_RUN

    # 1. SIGINT in step 1's update: the update finishes, the step completes (saved by save_every).
    code, stderr, seconds = _train_until(r"0/3 .*update", signal.SIGINT, argv, tmp_path)
    assert code == 130 and "terminate called" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    step, saved, how, command = _hint(stderr).groups()
    assert (step, how) == ("1", "the latest checkpoint") and Path(saved) == out / "checkpoints" / "step_000001"
    assert (Path(saved) / "state.json").is_file() and seconds < 30

    # 2. SIGINT in step 3's rollout (step 2 was saved by save_every): the rollout is dropped.
    code, stderr, _ = _train_until(r"2/3 .*rollout", signal.SIGINT, argv, tmp_path)
    assert code == 130 and "terminate called" not in stderr, stderr[-3000:]
    step, saved, how, command = _hint(stderr).groups()
    assert (step, how) == ("2", "the latest checkpoint") and Path(saved) == out / "checkpoints" / "step_000002"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]  # the dropped step left no line

    # 3. SIGTERM in step 3's validation: step 3 is complete but not yet saved, so it is saved now; exit 143.
    code, stderr, _ = _train_until(r"2/3 .*validation", signal.SIGTERM, argv, tmp_path)
    assert code == 143 and "terminate called" not in stderr, stderr[-3000:]
    step, saved, how, _ = _hint(stderr).groups()
    assert (step, how) == ("3", "saved at the interrupt")

    # The hint's command resumes: the run is complete at step 3, so it ends normally (run in this
    # process: no signal is sent to it).
    assert command.startswith("flowrl train ")
    monkeypatch.chdir(tmp_path)
    assert main([*command.split()[1:], "logging.progress_bar=false"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2, 3]


def test_sigterm_before_the_first_step_leaves_a_fresh_start(tiny_sd3_path, tmp_path):
    from flowrl.config import config_to_dict
    from flowrl.run.config import load_train_config
    from flowrl.run.resume import plan_run, run_files

    out = tmp_path / "run"
    argv = [f"model.path={tiny_sd3_path}", f"trainer.output_dir={out}", "trainer.val_every=3", *FAST_RUN]
    argv.remove("logging.tensorboard=false")  # tensorboard files are removed too
    code, stderr, _ = _train_until(r"validation", signal.SIGTERM, argv, tmp_path)
    assert code == 143 and "terminate called" not in stderr
    assert _lines(stderr)[-1].startswith("flowrl train: stopped before a step completed; nothing to resume")
    # The step-0 files are gone, so the same command is a fresh start rather than a refused used folder.
    assert run_files(out) == []
    cfg = load_train_config(None, argv)
    plan = plan_run(cfg, config_to_dict(cfg))
    assert plan.checkpoint is None and plan.finished is None and plan.delete == []


class _InterruptInStep:
    """A reward that raises SIGINT (as Ctrl-C would) once, while step `step` is being scored."""

    def __init__(self, reward, trainer_step, step: int):
        self.reward, self.trainer_step, self.step, self.is_sent = reward, trainer_step, step, False

    def __getattr__(self, name):
        return getattr(self.reward, name)

    def score_with_components(self, *args):
        if not self.is_sent and self.trainer_step() == self.step - 1:
            self.is_sent = True
            signal.raise_signal(signal.SIGINT)
        return self.reward.score_with_components(*args)


def test_a_dropped_step_leaves_the_checkpoint_of_the_step_before(build_trainer, make_cfg):
    from flowrl.rewards import build_reward_from_config

    overrides = ("trainer.total_steps=2", "trainer.prompts_per_step=2", "rollout.n=2", "trainer.save_every=1")
    straight = make_cfg(*overrides, output="straight")
    straight_trainer = build_trainer(straight)
    straight_trainer.fit()
    straight_trainer.engine.shutdown()
    expected = Path(straight.trainer.output_dir) / "checkpoints" / "step_000001"

    threads_before = set(threading.enumerate())
    cfg = make_cfg(*overrides, "trainer.save_every=0", output="stopped")
    trainer = None
    reward = _InterruptInStep(build_reward_from_config(cfg.reward), lambda: trainer.step, step=2)
    trainer = build_trainer(cfg, reward=reward)
    with pytest.raises(TrainingInterrupted) as stop:
        trainer.fit()
    assert stop.value.exit_code == 130 and stop.value.step == 1 and stop.value.saved_now
    saved = stop.value.checkpoint
    state = json.loads((saved / "state.json").read_text())
    assert state["trainer"] == json.loads((expected / "state.json").read_text())["trainer"]
    for name in ("trainable.safetensors", "rng.safetensors"):
        first, second = load_file(str(expected / name)), load_file(str(saved / name))
        assert first.keys() == second.keys() and all((first[k] == second[k]).all() for k in first), name
    assert set(threading.enumerate()) <= threads_before  # the engine and reward threads were joined


def test_the_resume_hint_keeps_the_checkpoint_it_names(tmp_path):
    import argparse
    from types import SimpleNamespace

    from flowrl.cli.train import resume_hint

    stop = TrainingInterrupted(signal.SIGINT, 4, tmp_path / "checkpoints" / "step_000004", saved_now=True)
    args = argparse.Namespace(config="r.yaml", overrides=["trainer.overwrite=true", "trainer.resume=never"])
    tcfg = SimpleNamespace(resume="never", overwrite=True, output_dir=str(tmp_path))
    command = _hint(resume_hint(stop, args, tcfg)).group(4)
    # The later overrides win: the command resumes instead of starting over or deleting the checkpoint.
    assert command.endswith("trainer.overwrite=true trainer.resume=never trainer.resume=auto trainer.overwrite=false")


# A `flowrl train` whose OCR reward sends SIGINT to its own process at its AT-th row, then goes on
# reading: Ctrl-C while OCR scores, at a known moment (rows are counted over the whole run).
_OCR_INTERRUPTED = """
import os, signal, sys, threading
from flowrl.cli import main
from flowrl.rewards import register_reward
from flowrl.rewards.ocr import OcrReward

class Interrupting(OcrReward):
    rows, lock = 0, threading.Lock()

    def score_row(self, image, prompt, metadata):
        with Interrupting.lock:
            Interrupting.rows += 1
            if Interrupting.rows == int(os.environ["AT"]):
                os.kill(os.getpid(), signal.SIGINT)
        return super().score_row(image, prompt, metadata)

register_reward("ocr_interrupting", Interrupting)
sys.exit(main(["train", *sys.argv[1:], "reward.name=ocr_interrupting"]))
"""


@pytest.mark.slow
def test_sigint_while_ocr_scores_exits_130_in_repeated_runs(tiny_sd3_path, tmp_path):
    """Ctrl-C while the OCR reward scores stopped cleanly and then aborted ("terminate called without
    an active exception", exit 134): the validation's scoring thread a stop leaves behind was still
    inside onnxruntime when the interpreter exited. Now the reward is cancelled at its next row and
    the thread waited for. The signal comes at the first row of step 1's validation (after step 0's
    8 validation rows and step 1's 8 rollout rows), with 7 rows left to read."""
    words = "OPEN EXIT CAFE BAR SHOP SALE PUSH PULL".split()
    prompts = tmp_path / "ocr.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"a sign that says {w}", "ground_truth": w}) + "\n" for w in words)
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FLOWRL_CACHE": str(tmp_path / "cache"), "AT": str(8 + 8 + 1)}
    for attempt in range(3):
        argv = [f"model.path={tiny_sd3_path}", f"trainer.output_dir={tmp_path / f'run{attempt}'}", *FAST_RUN]
        argv += [f"data.train_path={prompts}", "trainer.val_every=1", "trainer.num_val_images=8"]
        argv += ["rollout.val_sampling.height=256", "rollout.val_sampling.width=256"]
        argv += ["trainer.max_steps_without_trained_rows=0"]  # OCR of a random model: no group has a spread
        result = subprocess.run(
            [sys.executable, "-c", _OCR_INTERRUPTED, *argv], capture_output=True, text=True, env=env, timeout=300
        )
        assert result.returncode == 130, (attempt, result.stderr[-3000:])
        assert "terminate called" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert "stopped after step 1;" in result.stderr, result.stderr[-3000:]
