"""The scripts users run from benchmarks/ still run on the CPU with tiny models (floor.py has its
own tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(*args: str) -> subprocess.CompletedProcess:
    """`python benchmarks/<args>` from the repository root, offline; its output checked for exit 0."""
    result = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def test_engine_vs_serial_reports_every_way_of_sampling():
    result = run_script("benchmarks/engine_vs_serial.py", "--kind", "sd3", "-n", "4", "--steps", "2", "--size", "64")
    for line in ("engine generate_batched", "engine concurrent singles", "serial B=1", "speed-up batched vs serial"):
        assert line in result.stdout, result.stdout


def test_toy_sft_ceiling_fine_tunes_a_transformer_flowrl_eval_loads(tmp_path):
    result = run_script("benchmarks/toy_sft_ceiling.py", "--steps", "2", "--batch", "4", "--out", str(tmp_path / "t"))
    assert "step 0: flow-matching loss" in result.stdout
    from diffusers import SD3Transformer2DModel

    from flowrl.models.debug.toy import committed_checkpoint

    tuned = SD3Transformer2DModel.from_pretrained(str(tmp_path / "t"))
    base = SD3Transformer2DModel.from_pretrained(str(committed_checkpoint()), subfolder="transformer")
    assert any(not (a == b).all() for a, b in zip(tuned.state_dict().values(), base.state_dict().values()))
